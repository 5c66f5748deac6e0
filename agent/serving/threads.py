"""The data plane's inference threads, and the profile's scheduling for them.

The profile's ``rt.inference`` policy, priority and CPUs apply to the threads that run
models: each version's scheduler workers and ONNX Runtime's intra-op workers, and the front
ends' worker threads that hand requests to them, not the event loop or the gRPC poller.
The supervisor hands the scheduling over at spawn and again after a profile switch or a
rollback (a file and SIGHUP); with none, every adopted thread is put back to what threads
have before any profile: SCHED_OTHER at nice 0 on every CPU this process may use.  Not what
each one had when adopted: a thread born of a SCHED_FIFO thread inherits FIFO and its CPUs,
so a rollback from ``realtime`` would leave it there.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

from agent.kernel import sched as rt
from agent.kernel.process import name_current_thread

logger = logging.getLogger(__name__)


def read_sched_file(path: Path | None) -> rt.ThreadSched | None:
    """``{policy, priority, cpus}`` or ``null``; a missing or unreadable file is None."""
    if path is None:
        return None
    try:
        data = json.loads(path.read_text())
        if data is None:
            return None
        return rt.ThreadSched(policy=str(data["policy"]), priority=int(data["priority"]),
                              cpus=[int(cpu) for cpu in data["cpus"]])
    except (OSError, ValueError, KeyError, TypeError) as error:
        logger.warning("%s: no thread scheduling read (%s)", path, error)
        return None


def write_sched_file(path: Path, wanted: rt.ThreadSched | None) -> None:
    """Atomically, so the data plane never reads half a file."""
    data = None if wanted is None else {"policy": wanted.policy, "priority": wanted.priority,
                                        "cpus": list(wanted.cpus)}
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(data))
    partial.replace(path)


class InferenceThreads:
    """Threads adopted as inference threads; made before any of them, from the thread whose
    CPUs (the process's, never profiled) are what "every CPU" means on a restore."""

    def __init__(self, wanted: rt.ThreadSched | None) -> None:
        self.wanted = wanted
        self.full_cpus = sorted(os.sched_getaffinity(0))
        self._tids: set[int] = set()
        self._placed: dict[int, list[int]] = {}  # tid -> the cpus lever's CPUs (placement)
        self._lock = threading.Lock()
        self.errors: list[str] = []

    def adopt_current(self) -> None:
        """For a thread pool's initializer: this worker runs models.  It also takes its
        Python name as the kernel's (``infer-http_0``), so ``top -H`` and a profile's
        ``rt.threads`` comm patterns can tell it from the event loop."""
        name_current_thread(threading.current_thread().name)
        self.adopt([threading.get_native_id()])

    def adopt(self, tids: Iterable[int]) -> None:
        """New inference threads (a thread is adopted once, as it starts): a tid seen
        before belonged to a thread that has exited, and its pin is not this one's."""
        with self._lock:
            for tid in tids:
                if not os.path.exists(f"/proc/self/task/{tid}"):
                    continue  # gone already
                self._tids.add(tid)
                self._placed.pop(tid, None)
                self._apply_one(tid)

    def place(self, tids: Iterable[int], cpus: Sequence[int] | None) -> None:
        """Pin adopted threads of a model to ``cpus`` (the ``cpus`` lever, placement.py):
        they keep the profile's policy and priority, on these CPUs instead of its, also
        after a switch; None: on the profile's CPUs again."""
        with self._lock:
            for tid in tids:
                if tid in self._tids:
                    if cpus is None:
                        self._placed.pop(tid, None)
                    else:
                        self._placed[tid] = list(cpus)
                    self._apply_one(tid)

    def switch(self, wanted: rt.ThreadSched | None) -> None:
        """A new profile's scheduling (None: the baseline), for every live thread."""
        with self._lock:
            self.wanted = wanted
            for tid in sorted(self._tids):
                if not os.path.exists(f"/proc/self/task/{tid}"):
                    self._tids.discard(tid)
                    self._placed.pop(tid, None)
                    continue
                self._apply_one(tid)

    def _apply_one(self, tid: int) -> None:
        placed = self._placed.get(tid)
        try:
            if self.wanted is None:
                rt.reset_thread_sched(tid, placed or self.full_cpus)
            else:
                rt.apply_thread_sched(tid, self.wanted if placed is None else
                                      dataclasses.replace(self.wanted, cpus=placed))
        except (OSError, rt.RtError) as error:
            message = f"thread {tid}: {error}"
            logger.warning("inference thread scheduling: %s", message)
            self.errors = [*self.errors[-9:], message]
