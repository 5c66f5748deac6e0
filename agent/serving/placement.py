"""Where a model's threads run: the ``cpus`` lever pins every thread that computes one of
its runs, which is the scheduler's worker that calls ONNX Runtime (the calling thread
computes a share of each run) and the intra-op workers each session was born with.  The
lever moves those threads where they are (Version.place), as a build (a load, the
``threads`` lever's rebuild) pins a new version's before it serves.

The pin is the kernel's affinity (sched_setaffinity on each thread id), not ORT's
``session.intra_op_thread_affinities``: the server adopts a session's workers as inference
threads and gives them the profile's CPUs after ORT made them, which would undo ORT's
setting, and the calling thread is not ORT's to place at all.  The server's InferenceThreads
keeps the pin through a later profile switch (threads.py).

The ``realtime`` lever lifts the same threads to SCHED_FIFO, above every thread of normal
priority, a co-located app's included: on a 2-core VM a latency-critical model beside a
process spinning half a core met its objective in 16-37 % of 1-s windows at its default
scheduling and in 95-100 % lifted, with the front ends' request threads lifted too
(threads.py); lifting its own threads alone held 74-89 %.  Never for a version whose ORT
workers spin between a run's ops: a spinning real-time thread yields its CPU to nothing of
lower priority (options.spinning_for).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from agent.kernel import sched as rt
from agent.serving.threads import LIFTED_PRIORITY

logger = logging.getLogger(__name__)


class Scheduling(Protocol):
    """How a model's threads are placed and lifted: the server's InferenceThreads (which
    keeps both through a profile switch), or ``Unscheduled`` where there is none."""

    def place(self, tids: Iterable[int], cpus: Sequence[int] | None) -> None: ...

    def lift(self, tids: Iterable[int], on: bool) -> list[str]:
        """Lift (or put back) the threads; what the kernel refused, as messages."""
        ...


class Unscheduled:
    """A registry's threads where no profile schedules them (tests, tools): pinned and
    lifted directly, put back to SCHED_OTHER."""

    @staticmethod
    def place(tids: Iterable[int], cpus: Sequence[int] | None) -> None:
        pin(tids, cpus)

    @staticmethod
    def lift(tids: Iterable[int], on: bool) -> list[str]:
        refused = []
        for tid in tids:
            try:
                cpus = sorted(os.sched_getaffinity(tid))
                if on:
                    rt.apply_thread_sched(tid, rt.ThreadSched("fifo", LIFTED_PRIORITY, cpus))
                else:
                    rt.reset_thread_sched(tid, cpus)
            except ProcessLookupError:
                continue
            except (OSError, rt.RtError) as error:
                refused.append(f"thread {tid}: {error}")
        return refused


def pin(tids: Iterable[int], cpus: Sequence[int] | None) -> None:
    """Pin each thread to ``cpus``, None: the process's CPUs (``Unscheduled``, where no
    InferenceThreads schedules the threads); one that has exited meanwhile is skipped, a
    refusal (CPUs a cpuset took away since the lever was checked) logged: a worker must
    still start."""
    if cpus is None:
        cpus = sorted(os.sched_getaffinity(0))
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:
            continue
        except OSError as error:
            logger.warning("thread %d: not pinned to CPUs %s: %s", tid, list(cpus), error)


def spinning_workers(built: Sequence[tuple[Any, Any]]) -> bool:
    """Whether a session of these ``(instance, backend)`` pairs has intra-op workers that
    spin (no ``realtime`` for it); a session whose options cannot be read (not ORT's own,
    a wrapper) is taken to spin."""
    return any(getattr(backend.built, "worker_tids", ()) and _spins(backend.built.session)
               for _, backend in built if getattr(backend, "built", None) is not None)


def _spins(session: Any) -> bool:
    from agent.inference.options import session_spins  # onnxruntime: only where served

    try:
        return session_spins(session)
    except AttributeError:
        return True


def worker_tids(built: Sequence[tuple[Any, Any]]) -> set[int]:
    """The ORT intra-op workers ``(instance, backend)`` pairs' sessions were born with
    (none for other backends)."""
    return {tid for _, backend in built
            for tid in getattr(getattr(backend, "built", None), "worker_tids", ())}
