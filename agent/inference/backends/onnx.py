"""The ONNX Runtime backend: a session built by ``session.build_session`` (providers,
threads, optimised-graph cache), served as it is.

``run``, ``get_inputs`` and ``get_outputs`` are the session's own bound methods, so a request
costs exactly what it cost before there was a backend interface (bench/serve.py).  A run is
cancelled through ORT's ``RunOptions.terminate``, which the executor checks between operators:
a run stops within one operator's time of the watchdog setting it (a TensorRT engine is one
operator to ORT: it runs to its end first).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import onnxruntime as ort

from agent.inference.providers import CPU, CUDA, OPENVINO, TENSORRT
from agent.inference.session import BuiltSession

_DEVICE_OF = {TENSORRT: "gpu", CUDA: "gpu", OPENVINO: "openvino", CPU: "cpu"}


def resolved_device(device: str, providers: Sequence[str]) -> str:
    """``auto`` as what it turned into: the first registered provider's device."""
    if device != "auto":
        return device
    first = _DEVICE_OF.get(providers[0], "cpu") if providers else "cpu"
    return "gpu:0" if first == "gpu" else first


class OnnxBackend:
    kind = "onnxruntime"

    run: Callable[..., list[Any]]  # (names, feeds, run_options=None)

    def __init__(self, built: BuiltSession, device: str = "auto",
                 precision: str = "fp32") -> None:
        self.built = built
        self.session = built.session
        self.run = built.session.run  # ORT's own call: the hot path gains nothing
        self.get_inputs = built.session.get_inputs
        self.get_outputs = built.session.get_outputs
        self.providers = list(built.providers)
        self.intra_op = built.intra_op
        self.device = resolved_device(device, self.providers)
        self.precision = precision

    def run_options(self) -> ort.RunOptions:
        return ort.RunOptions()

    def describe(self) -> dict[str, Any]:
        return {"backend": self.kind, "device": self.device, "precision": self.precision,
                "providers": list(self.providers), "threads": self.intra_op,
                "cache": self.built.cache}

    def close(self) -> None:
        """ORT frees a session with its last reference; nothing to release early."""


def as_backend(item: Any, device: str = "auto", precision: str = "fp32") -> Any:
    """A factory's product as a backend: a BuiltSession is wrapped, a backend passes."""
    return OnnxBackend(item, device, precision) if isinstance(item, BuiltSession) else item
