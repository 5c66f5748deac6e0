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
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

logger = logging.getLogger(__name__)

# pins threads (tids) to CPUs; None: unpinned, on the CPUs of threads no profile places
Place = Callable[[Iterable[int], Sequence[int] | None], None]


def pin(tids: Iterable[int], cpus: Sequence[int] | None) -> None:
    """Pin each thread to ``cpus``, None: the process's CPUs (the default ``Place`` where
    no InferenceThreads schedules the threads); one that has exited meanwhile is skipped, a
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


def worker_tids(built: Sequence[tuple[Any, Any]]) -> set[int]:
    """The ORT intra-op workers ``(instance, backend)`` pairs' sessions were born with
    (none for other backends)."""
    return {tid for _, backend in built
            for tid in getattr(getattr(backend, "built", None), "worker_tids", ())}
