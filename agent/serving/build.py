"""Building one served version: its sessions from the model file (checked against its pinned
digest), placed on the ``cpus`` lever's CPUs when it has them, and probed once before it may
serve (a version that cannot run one call never takes a request)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from agent.inference.backends import Backend
from agent.inference.backends.onnx import as_backend
from agent.inference.errors import SessionError
from agent.inference.model_files import model_sha256
from agent.inference.session import BuiltSession
from agent.serving.errors import invalid
from agent.serving.placement import Scheduling
from agent.serving.settings import ModelSettings
from agent.serving.versions import Version


class SessionFactory(Protocol):
    """Builds one instance of a model file on ``device`` in ``precision``: the server wires
    the backends with the providers, thread plan and caches it chose; None means "your
    choice".  A BuiltSession it returns is served by the ONNX Runtime backend."""

    def __call__(self, path: Path, *, sha256: str | None, providers: Sequence[str] | None,
                 threads: int | None, device: str,
                 precision: str) -> BuiltSession | Backend: ...


def build(model: str, number: int, path: Path, settings: ModelSettings,
          factory: SessionFactory, *, intra_op_threads: int | None = None,
          worker_start: Callable[[], None] | None = None,
          root: Path | None = None, threads: int | None = None,
          cpus: tuple[int, ...] | None = None, sched: Scheduling | None = None) -> Version:
    """Build and probe one version; ServeError INVALID_ARGUMENT naming it when the file,
    its pinned digest, a session or the probe fails.  ``intra_op_threads``: the threads the
    server may give one version, shared out among the sessions of instances that name no
    ``threads`` of their own, so N instances do not oversubscribe the CPUs (None: the
    factory's choice).  ``root``: the repository the model file must lie in, its links
    followed (None for a built-in, served in place).  The digest covers the external data
    files the model names (model_files), which must lie in its version directory.
    ``threads``: every session's intra-op threads (None: as above); ``cpus``: the CPUs its
    sessions' ORT workers and its scheduler's workers are pinned to, through ``sched``."""
    label = f"model {model} version {number}"
    try:
        digest = model_sha256(path, root=root)
    except SessionError as error:
        raise invalid(f"{label}: {error}") from None
    pin = settings.sha256.get(number)
    if pin is not None and pin != digest:
        raise invalid(f"{label}: {path} has sha256 {digest}, but it is pinned to {pin}; "
                      "refused")
    sessions = sum(instance.count for instance in settings.instances)
    share = None if intra_op_threads is None else max(1, intra_op_threads // sessions)
    configured = [instance.threads or share for instance in settings.instances
                  for _ in range(instance.count)]
    built = []
    try:
        for instance in settings.instances:
            for _ in range(instance.count):
                made = factory(path, sha256=pin, providers=settings.providers,
                               threads=threads or instance.threads or share,
                               device=instance.device, precision=settings.precision)
                built.append((instance, as_backend(made, instance.device,
                                                   settings.precision)))
        version = Version(model, number, path, digest, built, settings, worker_start,
                          configured=configured, threads=threads)
        if cpus is not None and sched is not None:
            version.place(cpus, sched)  # as the lever moves it, before it serves
    except Exception as error:  # a file ORT refuses, a provider it lacks, a bad batch size
        for _, backend in built:
            backend.close()
        raise invalid(f"{label}: {error}") from None
    reason = version.probe()
    if reason:
        version.close()
        raise invalid(f"{label}: probe failed: {reason}")
    return version
