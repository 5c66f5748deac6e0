"""``inference.source: synthetic | npy:DIR``: a load test sent through the data plane.

The agent no longer feeds a model by itself: applications call the server.  When an
operator asks for load (a soak test, a guard window with traffic), this thread sends it
through the server's own HTTP front end, at ``rate_hz`` or as fast as answers come, so it
measures what an application would see.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import numpy as np

from agent.serving.core import DATATYPES, ModelMetadata

if TYPE_CHECKING:
    from agent.serving.http_client import HttpClient

logger = logging.getLogger(__name__)

RETRY_S = 1.0  # after a refusal or while the server is away


def synthetic_feeds(metadata: ModelMetadata, dims: Mapping[str, int],
                    seed: int = 0) -> dict[str, np.ndarray]:
    """Random inputs shaped from the model's metadata; a dynamic dimension is 1 unless
    ``dims`` names its position as ``<input>.<axis>`` (or the axis alone)."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for spec in metadata.inputs:
        shape = [dim if dim >= 0 else int(dims.get(f"{spec.name}.{axis}", dims.get(
            str(axis), 1))) for axis, dim in enumerate(spec.shape)]
        dtype = DATATYPES[spec.datatype]
        feeds[spec.name] = (rng.random(shape) * (1 if dtype.kind == "f" else 100)).astype(dtype)
    return feeds


def npy_feeds(directory: str, metadata: ModelMetadata) -> list[dict[str, np.ndarray]]:
    """Every ``*.npy`` of the directory (sorted), each fed to the model's first input."""
    from agent.inference.io import NpyDirectorySource

    source = NpyDirectorySource(directory, metadata.inputs[0].name)
    return [{source.input_name: array} for array in source.arrays]


class LoadDriver:
    """Sends the configured load to one model until stopped; failures are counted."""

    def __init__(self, client: Callable[[], HttpClient], model: str, source: str,
                 dims: Mapping[str, int], rate_hz: float | None) -> None:
        self.client, self.model, self.source, self.dims = client, model, source, dims
        self.period_s = 1.0 / rate_hz if rate_hz else 0.0
        self.sent = 0
        self.failed = 0
        self.last_error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="load-driver", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        from agent.serving.errors import ServeError

        while not self._stop.is_set():
            try:
                self._drive(self.client())
            except (ServeError, OSError, ValueError) as error:
                self.last_error = str(error)
            except Exception as error:  # a thread that must stay alive
                logger.exception("load driver")
                self.last_error = f"{type(error).__name__}: {error}"
            self._stop.wait(RETRY_S)

    def _drive(self, client: HttpClient) -> None:
        metadata = client.model_metadata(self.model)
        feeds = (npy_feeds(self.source.removeprefix("npy:"), metadata)
                 if self.source.startswith("npy:") else [synthetic_feeds(metadata, self.dims)])
        due = time.monotonic()
        index = 0
        while not self._stop.is_set():
            try:
                client.infer(self.model, feeds[index % len(feeds)])
                self.sent += 1
            except Exception:
                self.failed += 1
                raise
            index += 1
            if self.period_s:
                due += self.period_s
                self._stop.wait(max(0.0, due - time.monotonic()))
