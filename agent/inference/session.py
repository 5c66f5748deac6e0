"""Builds the ONNX Runtime session: reads the (pinned) model, then builds its session with the
providers and threads chosen for it, through the optimised-graph cache.  The model and its
external data reach ORT as bytes (``model_files``): ORT opens no path of the model's.

The choices themselves are made elsewhere: the providers in ``providers``, the threads and
session options in ``options``, the cache in ``graph_cache``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import onnxruntime as ort

from agent.inference.errors import model_error
from agent.inference.graph_cache import (
    COMPILING_PROVIDERS,
    CacheState,
    Provider,
    create_session,
    provider_names,
)
from agent.inference.model_files import ModelFiles, open_model
from agent.inference.options import GraphOptimization, optimisation_level, session_options
from agent.kernel.process import name_current_thread

logger = logging.getLogger(__name__)

BUILDING_EVERY_S = 10.0  # how often a compiling build says it is still going
Building = Callable[[float], None]  # seconds so far; the service extends systemd's timeout


@dataclass(frozen=True)
class BuiltSession:
    """A ready session and how it came to be, for the status report and the logs."""

    session: ort.InferenceSession
    providers: list[str]  # what ORT actually registered, in priority order
    intra_op: int
    inter_op: int
    model_sha256: str
    load_ms: float
    cache: CacheState
    # ORT's intra-op worker threads, born with the session: the loop gives them its own
    # scheduling, or a SCHED_FIFO loop thread could starve the workers it waits for.
    worker_tids: frozenset[int] = frozenset()


def load_model(path: Path, expected_sha256: str | None) -> bytes:
    """The model's bytes, refused unless they match the pinned digest (when one is pinned)."""
    with _open_pinned(path, expected_sha256) as files:
        return files.model


def _open_pinned(path: Path, expected_sha256: str | None) -> ModelFiles:
    """The model and its external files, hashed once: the digest is also the cache key."""
    files = open_model(path)
    if expected_sha256 is not None and files.sha256 != expected_sha256.strip().lower():
        files.close()
        raise model_error(path, f"has sha256 {files.sha256}, expected {expected_sha256}; "
                          "refusing to load it")
    return files


def build_session(model_path: Path, *, providers: Sequence[Provider], intra_op: int,
                  inter_op: int, cache_dir: Path | None, expected_sha256: str | None = None,
                  graph_optimization: GraphOptimization = "all",
                  allow_spinning: bool | None = None,
                  stop_spinning_after_run: bool = False,
                  memory_arena: bool = True,
                  building: Building | None = None) -> BuiltSession:
    """Load the (pinned) model and build its session, through the optimised-graph cache.
    ``providers``: names or (name, options) pairs.  ``building`` is called every
    BUILDING_EVERY_S while a compiling provider (TensorRT: minutes) builds its engines."""
    start = time.perf_counter()
    optimisation_level(graph_optimization)  # a typo fails before the model is read
    fresh = functools.partial(session_options, intra_op, inter_op, graph_optimization,
                              allow_spinning, stop_spinning_after_run=stop_spinning_after_run,
                              memory_arena=memory_arena)
    compiling = building is not None and COMPILING_PROVIDERS.intersection(
        provider_names(providers))
    with _open_pinned(model_path, expected_sha256) as files, _Workers() as workers, \
            _heartbeat(building if compiling else None, start):
        session, cache = create_session(model_path, files.model, files.sha256,
                                        list(providers), lambda: files.attach(fresh()),
                                        cache_dir, graph_optimization)
    built = BuiltSession(session=session, providers=list(session.get_providers()),
                         intra_op=intra_op, inter_op=inter_op, model_sha256=files.sha256,
                         load_ms=(time.perf_counter() - start) * 1000, cache=cache,
                         worker_tids=workers.tids)
    logger.info("model %s: providers %s, threads %d/%d, cache %s, %.1f ms", model_path,
                built.providers, intra_op, inter_op, cache, built.load_ms)
    return built


class _heartbeat:
    """Calls ``building(seconds so far)`` every BUILDING_EVERY_S until the block ends."""

    def __init__(self, building: Building | None, start: float) -> None:
        self.building, self.start = building, start
        self.done = threading.Event()
        self.thread: threading.Thread | None = None

    def __enter__(self) -> None:
        if self.building is not None:
            self.thread = threading.Thread(target=self._beat, name="session-building",
                                           daemon=True)
            self.thread.start()

    def __exit__(self, *_: object) -> None:
        self.done.set()
        if self.thread is not None:
            self.thread.join()

    def _beat(self) -> None:
        assert self.building is not None
        while not self.done.wait(BUILDING_EVERY_S):
            try:
                self.building(time.perf_counter() - self.start)
            except Exception:  # a progress report must never fail the build
                logger.exception("session build progress hook failed")


class _Workers:
    """The threads ORT starts for a session built in the block, told from any other thread
    the process starts meanwhile (a front end's handler, gRPC's own, another model's build):
    they are given the profile's scheduling and pinned to the model's CPUs.  The building
    thread takes a name of its own for the block, which the threads it starts inherit (a new
    thread takes its creator's comm); they take its usual name back afterwards."""

    def __init__(self) -> None:
        self.tids: frozenset[int] = frozenset()
        self._marker = f"ort-b-{threading.get_native_id():x}"  # 15 bytes at most

    def __enter__(self) -> _Workers:
        self._name = _comm("thread-self")
        self._before = _own_threads()
        if self._name is not None:
            name_current_thread(self._marker)
        self._marked = _comm("thread-self") == self._marker
        return self

    def __exit__(self, *_: object) -> None:
        if self._name is not None:
            name_current_thread(self._name)
        new = _own_threads() - self._before
        if not self._marked or self._name is None:  # nothing to tell them by: every new
            self.tids = frozenset(new)  # thread but Python's
            return
        self.tids = frozenset(tid for tid in new if _comm(f"self/task/{tid}") == self._marker)
        for tid in self.tids:
            with contextlib.suppress(OSError):  # one that has exited meanwhile
                Path(f"/proc/self/task/{tid}/comm").write_text(self._name)


def _comm(thread: str) -> str | None:
    """``/proc/<thread>/comm`` (None: gone, or no procfs)."""
    try:
        return Path(f"/proc/{thread}/comm").read_text().rstrip("\n")
    except OSError:
        return None


def _own_threads() -> set[int]:
    """Thread ids of this process but its Python threads (ORT's are not Python's)."""
    tids = {int(tid) for tid in os.listdir("/proc/self/task")}
    return tids - {thread.native_id for thread in threading.enumerate()}
