"""The data plane's inference threads, and the profile's scheduling for them.

The profile's ``rt.inference`` policy, priority and CPUs apply to the threads that run
models: each version's scheduler workers and ONNX Runtime's intra-op workers, and the front
ends' worker threads that hand requests to them, not the event loop or the gRPC poller.
The supervisor hands the scheduling over at spawn and again after a profile switch (a file
and SIGHUP); with none, every adopted thread gets back what it had.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterable
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
    """Threads adopted as inference threads, with what they had before."""

    def __init__(self, wanted: rt.ThreadSched | None) -> None:
        self.wanted = wanted
        self._originals: dict[int, rt.ThreadSched] = {}
        self._lock = threading.Lock()
        self.errors: list[str] = []

    def adopt_current(self) -> None:
        """For a thread pool's initializer: this worker runs models.  It also takes its
        Python name as the kernel's (``infer-http_0``), so ``top -H`` and a profile's
        ``rt.threads`` comm patterns can tell it from the event loop."""
        name_current_thread(threading.current_thread().name)
        self.adopt([threading.get_native_id()])

    def adopt(self, tids: Iterable[int]) -> None:
        with self._lock:
            for tid in tids:
                if tid in self._originals:
                    continue
                try:
                    self._originals[tid] = rt.read_thread_sched(tid)
                except (OSError, rt.RtError):
                    continue  # gone already
                self._apply_one(tid)

    def switch(self, wanted: rt.ThreadSched | None) -> None:
        """A new profile's scheduling (None: restore the originals), for every live thread."""
        with self._lock:
            self.wanted = wanted
            for tid in list(self._originals):
                if not os.path.exists(f"/proc/self/task/{tid}"):
                    del self._originals[tid]
                    continue
                self._apply_one(tid)

    def _apply_one(self, tid: int) -> None:
        try:
            if self.wanted is None:
                rt.restore_thread_sched(tid, self._originals[tid])
            else:
                rt.apply_thread_sched(tid, self.wanted)
        except (OSError, rt.RtError) as error:
            message = f"thread {tid}: {error}"
            logger.warning("inference thread scheduling: %s", message)
            self.errors = [*self.errors[-9:], message]
