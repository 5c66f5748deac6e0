"""One interface for everything that runs a model instance (Triton's backend API, small):
a backend is loaded by its module's ``load``, then ``run`` executes a batch, ``get_inputs`` /
``get_outputs`` describe its tensors, ``describe`` says what it is for the status and the
Prometheus labels, and ``close`` unloads it.  The server core owns queues, batching and
statistics; a new accelerator is one new module here.

``run`` has ONNX Runtime's signature (``run(output_names, feeds, run_options) ->
[arrays]``) so that the ONNX Runtime backend hands the scheduler ORT's own call: nothing is
added to the hot path.  ``run_options`` makes the object a run takes as its third argument:
setting its ``terminate`` from another thread cancels that run as far as the runtime can
(ORT: between two operators; RKNN: between two rows of a batch, a single NPU inference is
never cut).  The scheduler's watchdog sets it past a run's deadline and answers the run's
requests at once; a runtime that does not come back soon after is the one thing the
supervisor still kills the process for.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol


class TensorInfo(NamedTuple):
    """A tensor as ORT's NodeArg describes one: ``tensor(float)``, dims (str/None: dynamic)."""

    name: str
    type: str
    shape: Sequence[int | str | None]


class RunControl(Protocol):
    """ORT's ``RunOptions`` as the scheduler uses it: a flag another thread may set."""

    terminate: bool


class Terminate:
    """The ``RunControl`` of a backend without ORT's: checked where the backend can stop."""

    __slots__ = ("terminate",)

    def __init__(self) -> None:
        self.terminate = False


class Backend(Protocol):
    kind: str  # onnxruntime | rknn
    device: str  # what it runs on: cpu, gpu:0, dla:1, npu:0-2
    precision: str  # fp32 | fp16 | int8
    providers: list[str]  # ORT's registered providers; [kind] for others
    intra_op: int  # CPU threads it computes with (0: none of the server's)

    def run(self, names: Sequence[str], feeds: Mapping[str, Any],
            run_options: Any = None) -> list[Any]: ...

    def run_options(self) -> RunControl:
        """A fresh control for one run (reused until a run is cancelled with it)."""
        ...

    def get_inputs(self) -> Sequence[Any]: ...

    def get_outputs(self) -> Sequence[Any]: ...

    def describe(self) -> dict[str, Any]: ...

    def close(self) -> None: ...
