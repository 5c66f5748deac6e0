"""The ``threads`` lever: a model's served versions rebuilt with other intra-op threads (and
the CPUs the same request asks for, else the ones they run on), off the hot path, then
swapped in as a load swaps.  (``cpus`` alone moves the threads where they are.)

The route only checks the request and starts the rebuild on a thread of its own: a build
takes seconds (longer than the controller's client waits), and the controller reads the
outcome where it reads every lever, in the statistics (``edge_agent.levers`` shows the new
values once they serve, ``edge_agent.rebuild`` the rebuild's state).  One rebuild per model
at a time: a second request while one runs is refused UNAVAILABLE (the controller asks
again in a later window, with what it then wants), rather than queued behind a decision
that may be stale by the time it runs.  The rebuild holds the model's load lock, so a load
and a rebuild never interleave; a load afterwards builds config.yaml's threads again (they
are in the version key) and unpins what it keeps.  A rebuild that fails leaves what
served serving, logs why, and says it in ``edge_agent.rebuild``.  The new versions keep the
instant levers the old ones had.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from agent.serving.errors import ServeError, invalid, unavailable
from agent.serving.levers import LeverChange
from agent.serving.placement import Scheduling
from agent.serving.settings import THREADS_PER_CPU, ModelSettings, ModelSettingsError, check_threads
from agent.serving.state import Served
from agent.serving.versions import Version

logger = logging.getLogger(__name__)

# (number, path, settings, threads, cpus) -> a built and probed version
BuildOne = Callable[[int, Path, ModelSettings, int | None, tuple[int, ...] | None], Version]
Target = tuple[int | None, tuple[int, ...] | None]  # (threads, cpus) a rebuild serves


def target(name: str, served: Served, change: LeverChange, cpus: int) -> Target:
    """The threads and CPUs the model is to serve with after ``change`` (a lever it does not
    name keeps its value); INVALID_ARGUMENT naming ``threads`` and its allowed range when
    that many threads per session would go past what config.yaml could set
    (settings.check_threads, over ``cpus`` inference CPUs)."""
    current = served.versions[served.default]
    threads = change.threads if change.rethread else current.threads
    placed = change.cpus if change.place else current.cpus
    if threads is not None:
        settings = served.settings
        lever = tuple(dataclasses.replace(i, threads=threads) for i in settings.instances)
        try:
            check_threads(dataclasses.replace(settings, instances=lever), "levers", cpus)
        except ModelSettingsError:
            sessions = sum(instance.count for instance in settings.instances)
            bound = max(1, THREADS_PER_CPU * cpus // sessions)
            raise invalid(f"threads must be null (config.yaml's) or an integer 1..{bound} "
                          f"for model {name} ({sessions} sessions, at most {THREADS_PER_CPU} "
                          f"threads per inference CPU, {cpus} CPUs)") from None
    return threads, placed


def rebuilt(old: Served, threads: int | None, cpus: tuple[int, ...] | None,
            build_one: BuildOne, sched: Scheduling) -> Served:
    """Every version of ``old`` built anew with ``threads`` and ``cpus`` (ServeError as a
    load's build raises it; what was built is closed then), carrying the instant levers
    the old versions serve now (``realtime`` through ``sched``)."""
    versions: dict[int, Version] = {}
    try:
        for number, version in sorted(old.versions.items()):
            versions[number] = built = build_one(number, version.path, old.settings, threads,
                                                 cpus)
            if version.realtime and built.liftable:  # a lift refused fails the rebuild
                built.lift(True, sched)
    except BaseException:
        for version in versions.values():
            version.close()
        raise
    for number, version in versions.items():
        before = old.versions[number].scheduler
        version.scheduler.queue.retune(before.queue.policy)
        version.scheduler.admission.set_rate(before.admission.rate)
    return Served(versions, old.default, old.settings)


def _rebuilding(name: str) -> ServeError:
    return unavailable(f"model {name} is rebuilding already; ask again once its "
                       "statistics' edge_agent.rebuild says it is done")


class Rebuilds:
    """The rebuilds running, one per model, and each model's last one for the statistics."""

    def __init__(self, run: Callable[[str, Target], None]) -> None:
        """``run(model, target)``: the registry's rebuild and swap, on the rebuild's thread."""
        self._run = run
        self._lock = threading.Lock()
        self._running: dict[str, threading.Thread] = {}
        self._last: dict[str, Mapping[str, Any]] = {}  # model -> replaced, never changed

    @contextlib.contextmanager
    def starting(self, name: str, wanted: Target) -> Iterator[None]:
        """Reserve the model's rebuild (UNAVAILABLE while one runs), and start it once the
        block ends without an error (the instant levers of the same request apply there)."""
        with self._lock:
            if name in self._running:
                raise _rebuilding(name)
            thread = threading.Thread(target=self._rebuild, args=(name, wanted),
                                      name=f"rebuild-{name}", daemon=True)
            self._running[name] = thread
        try:
            yield
        except BaseException:
            with self._lock:
                del self._running[name]
            raise
        self._last[name] = self._state(wanted, "rebuilding", time.time())
        thread.start()

    @staticmethod
    def _state(wanted: Target, state: str, started: float, error: str = "") -> dict[str, Any]:
        threads, cpus = wanted
        return {"state": state, "threads": threads,
                "cpus": None if cpus is None else list(cpus), "error": error,
                "started": round(started, 3),
                "took_s": round(time.time() - started, 3) if state != "rebuilding" else None}

    def _rebuild(self, name: str, wanted: Target) -> None:
        started, error = time.time(), ""
        try:
            self._run(name, wanted)
        except ServeError as failure:
            error = failure.message
        except Exception as failure:  # the thread's end must not hide why
            logger.exception("model %s: rebuild failed", name)
            error = f"{type(failure).__name__}: {failure}"
        if error:
            logger.warning("model %s: rebuild for threads %s, cpus %s failed, the versions "
                           "before it still serve: %s", name, *wanted, error)
        self._last[name] = self._state(wanted, "failed" if error else "done", started, error)
        with self._lock:
            del self._running[name]

    def guarding(self, name: str, served: Served, change: LeverChange, cpus: int
                 ) -> contextlib.AbstractContextManager[None]:
        """What a levers request of ``served`` runs in: its rebuild reserved (``threads``,
        over ``cpus`` inference CPUs), rebuilds held off (``cpus`` or ``realtime`` alone), or
        nothing."""
        if change.rebuilds:
            return self.starting(name, target(name, served, change, cpus))
        return self.idle(name) if change.place or change.lift else contextlib.nullcontext()

    @contextlib.contextmanager
    def idle(self, name: str) -> Iterator[None]:
        """Hold off rebuilds of the model through the block: UNAVAILABLE while one runs
        (its versions take the CPUs it was asked with, and the lift of the ones they replace
        as it was when they were built, so a move of those now would be lost)."""
        with self._lock:
            if name in self._running:
                raise _rebuilding(name)
            yield

    def view(self, name: str) -> Mapping[str, Any] | None:
        """The model's last rebuild (None: none since the data plane started)."""
        return self._last.get(name)

    def join(self, timeout_s: float) -> bool:
        """Wait for the rebuilds running now; whether they all ended."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            threads = list(self._running.values())
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in threads)


def set_all(versions: Sequence[Version], change: LeverChange, sched: Scheduling) -> None:
    """``change`` on every version of a model, the lift on all of them or none: one that
    refuses it puts back those lifted before it."""
    done: list[Version] = []
    try:
        for version in versions:
            version.set_levers(change, sched)
            done.append(version)
    except ServeError:
        for version in done if change.lift and change.realtime else ():
            version.lift(False, sched)
        raise
