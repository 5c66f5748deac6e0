"""The real model registry over the bundled demo model, for the front ends' tests: model
``demo`` version 1 served in place, an empty repository beside it, CPU sessions."""

from __future__ import annotations

import contextlib
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from agent.inference.demo_model import DEMO_MODEL_PATH
from agent.inference.session import BuiltSession, build_session
from agent.serving.core import InferRequest, InferResult, Tensor
from agent.serving.errors import ServeError
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


@contextlib.contextmanager
def streaming(registry: ModelRegistry, model: str, inputs: tuple[Tensor, ...],
              expected: np.ndarray, clients: int = 6) -> Iterator[tuple[list[str], list[int]]]:
    """``clients`` threads sending ``inputs`` to ``model`` back to back for the block's
    length: ``(failures, [answered])``, each failure a wrong answer or an error's code and
    message, the count of answers growing as they come (the threads end with the block)."""
    stop = threading.Event()
    failures: list[str] = []
    answered = [0]

    def send() -> None:
        while not stop.is_set():
            try:
                got = registry.infer(InferRequest(model, "", inputs)).outputs[0].array
                if not np.allclose(got, expected, rtol=1e-5, atol=1e-6):
                    failures.append("a wrong answer")
                answered[0] += 1
            except ServeError as error:
                failures.append(f"{error.code}: {error.message}")

    threads = [threading.Thread(target=send) for _ in range(clients)]
    for thread in threads:
        thread.start()
    try:
        yield failures, answered
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
