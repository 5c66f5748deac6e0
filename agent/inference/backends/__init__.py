"""One interface for everything that runs a model instance (Triton's backend API, small):
a backend is loaded by its module's ``load``, then ``run`` executes a batch, ``get_inputs`` /
``get_outputs`` describe its tensors, ``describe`` says what it is for the status and the
Prometheus labels, and ``close`` unloads it.  The server core owns queues, batching and
statistics; a new accelerator is one new module here.

``run`` has ONNX Runtime's signature (``run(output_names, feeds) -> [arrays]``) so that the
ONNX Runtime backend hands the scheduler ORT's own call: nothing is added to the hot path.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol


class TensorInfo(NamedTuple):
    """A tensor as ORT's NodeArg describes one: ``tensor(float)``, dims (str/None: dynamic)."""

    name: str
    type: str
    shape: Sequence[int | str | None]


class Backend(Protocol):
    kind: str  # onnxruntime | rknn
    device: str  # what it runs on: cpu, gpu:0, dla:1, npu:0-2
    precision: str  # fp32 | fp16 | int8
    providers: list[str]  # ORT's registered providers; [kind] for others
    intra_op: int  # CPU threads it computes with (0: none of the server's)

    def run(self, names: Sequence[str], feeds: Mapping[str, Any]) -> list[Any]: ...

    def get_inputs(self) -> Sequence[Any]: ...

    def get_outputs(self) -> Sequence[Any]: ...

    def describe(self) -> dict[str, Any]: ...

    def close(self) -> None: ...
