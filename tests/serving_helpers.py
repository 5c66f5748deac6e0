"""A minimal ``Models`` over the bundled demo model (real ONNX Runtime), for the front-end
tests until they run on the real registry.  Replaced by agent.serving.registry at integration."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnxruntime as ort

from agent.inference.demo_model import DEMO_MODEL_PATH
from agent.serving.core import (
    IndexEntry,
    InferRequest,
    InferResult,
    InstanceGroup,
    ModelConfigView,
    ModelMetadata,
    Tensor,
    TensorSpec,
)
from agent.serving.errors import ServeError, not_found, unavailable
from agent.serving.tensors import ORT_DATATYPES, check_inputs


def _spec(arg: Any) -> TensorSpec:
    return TensorSpec(arg.name, ORT_DATATYPES[arg.type],
                      tuple(d if isinstance(d, int) else -1 for d in arg.shape))


class DemoModels:
    """``demo`` version 1; load/unload flip whether it is loaded."""

    def __init__(self) -> None:
        self.session = ort.InferenceSession(str(DEMO_MODEL_PATH),
                                            providers=["CPUExecutionProvider"])
        self.inputs = tuple(_spec(a) for a in self.session.get_inputs())
        self.outputs = tuple(_spec(a) for a in self.session.get_outputs())
        self.loaded = True
        self.lock = threading.Lock()
        self.count = 0

    def live(self) -> bool:
        return True

    def ready(self) -> bool:
        return self.loaded

    def server_metadata(self) -> dict[str, Any]:
        return {"name": "edge-agent", "version": "0.1.0",
                "extensions": ["binary_tensor_data", "model_repository",
                               "model_configuration", "parameters", "statistics"]}

    def _check(self, name: str, version: str) -> None:
        if name != "demo" or version not in ("", "1"):
            raise not_found(f"unknown model {name!r} version {version!r}")

    def model_ready(self, name: str, version: str) -> bool:
        self._check(name, version)
        return self.loaded

    def model_metadata(self, name: str, version: str) -> ModelMetadata:
        self._check(name, version)
        if not self.loaded:
            raise unavailable("model demo is not loaded")
        return ModelMetadata("demo", ("1",), self.inputs, self.outputs)

    def model_config(self, name: str) -> ModelConfigView:
        self._check(name, "")
        return ModelConfigView(
            "demo", 4, tuple(TensorSpec(s.name, s.datatype, s.shape[1:]) for s in self.inputs),
            tuple(TensorSpec(s.name, s.datatype, s.shape[1:]) for s in self.outputs),
            (InstanceGroup("KIND_CPU", 1),), {"latest": 1}, {"providers": "CPUExecutionProvider"})

    def infer(self, request: InferRequest) -> InferResult:
        self._check(request.model, request.version)
        if not self.loaded:
            raise unavailable("model demo is not loaded")
        check_inputs("demo", self.inputs, request.inputs)
        names = [o.name for o in request.outputs] or [s.name for s in self.outputs]
        for name in names:
            if name not in {s.name for s in self.outputs}:
                raise ServeError("INVALID_ARGUMENT", f"model demo has no output {name!r}")
        feeds = {t.name: t.array for t in request.inputs}
        arrays = self.session.run(names, feeds)
        with self.lock:
            self.count += 1
        return InferResult("demo", "1", request.id,
                           tuple(Tensor(n, np.asarray(a)) for n, a in zip(names, arrays,
                                                                          strict=True)))

    def index(self, ready_only: bool) -> list[IndexEntry]:
        if ready_only and not self.loaded:
            return []
        return [IndexEntry("demo", "1" if self.loaded else "",
                           "READY" if self.loaded else "UNAVAILABLE",
                           "" if self.loaded else "unloaded")]

    def load(self, name: str, parameters: Mapping[str, Any]) -> None:
        self._check(name, "")
        self.loaded = True

    def unload(self, name: str, parameters: Mapping[str, Any]) -> None:
        self._check(name, "")
        self.loaded = False

    def statistics(self, name: str, version: str) -> list[dict[str, Any]]:
        if name:
            self._check(name, version)
        return [{"name": "demo", "version": "1", "inference_count": self.count,
                 "execution_count": self.count}]
