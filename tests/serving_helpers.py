"""The real model registry over the bundled demo model, for the front ends' tests: model
``demo`` version 1 served in place, an empty repository beside it, CPU sessions."""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import onnxruntime as ort

from agent.inference.demo_model import DEMO_MODEL_PATH
from agent.inference.session import BuiltSession, build_session
from agent.serving.core import InferRequest, InferResult
from agent.serving.registry import ModelRegistry


def cpu_factory(path: Path, *, sha256: str | None, providers: Sequence[str] | None,
                threads: int | None, device: str = "auto",
                precision: str = "fp32") -> BuiltSession:
    """Sessions as the server builds them (the model's providers, else the CPU), without a
    graph cache; every device is served on them (the ONNX Runtime backend wraps them)."""
    return build_session(path, providers=list(providers or ["CPUExecutionProvider"]),
                         intra_op=threads or 1, inter_op=1, cache_dir=None,
                         expected_sha256=sha256)


class WrappedSession:
    """A real session behind a test's own ``run`` (a gate, a failure): the metadata calls
    pass through; subclasses override ``run``."""

    def __init__(self, session: Any) -> None:
        self.session = session

    def get_inputs(self) -> Any:
        return self.session.get_inputs()

    def get_outputs(self) -> Any:
        return self.session.get_outputs()

    def run(self, names: Any, feeds: Any, options: Any = None) -> Any:
        return self.session.run(names, feeds, options)


class DemoModels(ModelRegistry):
    """Started at once; ``session`` is a plain ONNX Runtime session of the same model, to
    compare the served answers with."""

    def __init__(self) -> None:
        self.scratch = tempfile.TemporaryDirectory(prefix="edge-agent-repository-")
        super().__init__(Path(self.scratch.name), {"demo": DEMO_MODEL_PATH}, cpu_factory,
                         probe_interval_s=3600)
        self.start()
        self.session = ort.InferenceSession(str(DEMO_MODEL_PATH),
                                            providers=["CPUExecutionProvider"])


class RecordingModels(DemoModels):
    """DemoModels that keeps every request it is asked to run."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[InferRequest] = []

    def infer(self, request: InferRequest) -> InferResult:
        self.requests.append(request)
        return super().infer(request)
