"""The data plane's inference threads, and the profile's scheduling for them.

The profile's ``rt.inference`` policy, priority and CPUs apply to the threads that run
models: each version's scheduler workers and ONNX Runtime's intra-op workers, and the front
ends' worker threads that hand requests to them, not the event loop or the gRPC poller.
The supervisor hands the scheduling over at spawn and again after a profile switch or a
rollback (a file and SIGHUP); with none, every adopted thread is put back to what threads
have before any profile: SCHED_OTHER at nice 0 on every CPU this process may use.  Not what
each one had when adopted: a thread born of a SCHED_FIFO thread inherits FIFO and its CPUs,
so a rollback from ``realtime`` would leave it there.

The ``realtime`` lever lifts one model's threads to SCHED_FIFO (placement.py): one above the
profile's real-time priority, or LIFTED_PRIORITY where it has none, on the same CPUs.  While
any model is lifted, and the profile gives them no real-time priority of their own, the front
ends' request threads go to FRONT_PRIORITY: a request waits on them before and after its run,
so a lifted model behind a front end at normal priority still waited for whatever else ran
there.  One below the lifted models, so that what else runs on a front end's thread (another
model's decoding, a load's build) never holds a lifted model's run off its CPU.
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

FRONT_PRIORITY = 1  # SCHED_FIFO of the front ends' threads while a model is lifted (no RT profile)
LIFTED_PRIORITY = FRONT_PRIORITY + 1  # of a lifted model's threads where the profile has none


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
        self._lifted: set[int] = set()  # the realtime lever's threads
        self._front: set[int] = set()  # the front ends' request threads
        self._lock = threading.Lock()
        self.errors: list[str] = []

    def adopt_current(self) -> None:
        """For a thread pool's initializer: this worker runs models.  It also takes its
        Python name as the kernel's (``infer-http_0``), so ``top -H`` and a profile's
        ``rt.threads`` comm patterns can tell it from the event loop."""
        name_current_thread(threading.current_thread().name)
        self.adopt([threading.get_native_id()])

    def adopt_front(self) -> None:
        """``adopt_current`` for a front end's pool: lifted while any model is."""
        self.adopt_current()
        with self._lock:
            self._front.add(threading.get_native_id())
            self._apply_one(threading.get_native_id())

    def adopt(self, tids: Iterable[int]) -> None:
        """New inference threads (a thread is adopted once, as it starts): a tid seen
        before belonged to a thread that has exited, and its pin is not this one's."""
        with self._lock:
            for tid in tids:
                if not _alive(tid):
                    continue  # gone already
                self._tids.add(tid)
                self._placed.pop(tid, None)
                self._lifted.discard(tid)
                self._front.discard(tid)
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

    def lift(self, tids: Iterable[int], on: bool) -> list[str]:
        """Lift adopted threads of a model (the realtime lever), or put them back, and the
        front ends' threads with the first model lifted or the last put back; what the
        kernel refused, as messages."""
        with self._lock:
            self._lifted = {tid for tid in self._lifted if _alive(tid)}  # a retired version's
            self._front = {tid for tid in self._front if _alive(tid)}  # have exited
            before = bool(self._lifted)
            changed = [tid for tid in tids if tid in self._tids]
            (self._lifted.update if on else self._lifted.difference_update)(changed)
            if before != bool(self._lifted):
                changed += sorted(self._front)
            refused = [self._apply_one(tid) for tid in changed]
            return [message for message in refused if message]

    def switch(self, wanted: rt.ThreadSched | None) -> None:
        """A new profile's scheduling (None: the baseline), for every live thread."""
        with self._lock:
            self.wanted = wanted
            for tid in sorted(self._tids):
                if not _alive(tid):
                    self._tids.discard(tid)
                    self._placed.pop(tid, None)
                    self._lifted.discard(tid)
                    self._front.discard(tid)
                    continue
                self._apply_one(tid)

    def _apply_one(self, tid: int) -> str:
        """Schedule one thread as the profile, its pin and its lift say; "" or why not."""
        placed = self._placed.get(tid)
        lifted = tid in self._lifted or (tid in self._front and bool(self._lifted) and not (
            self.wanted is not None and rt.is_realtime(self.wanted)))
        try:
            if lifted:
                rt.apply_thread_sched(tid, self._lifted_sched(placed, tid in self._lifted))
            elif self.wanted is None:
                rt.reset_thread_sched(tid, placed or self.full_cpus)
            else:
                rt.apply_thread_sched(tid, self.wanted if placed is None else
                                      dataclasses.replace(self.wanted, cpus=placed))
        except ProcessLookupError:
            return ""  # exited meanwhile
        except (OSError, rt.RtError) as error:
            message = f"thread {tid}: {error}"
            logger.warning("inference thread scheduling: %s", message)
            self.errors = [*self.errors[-9:], message]
            return message
        return ""

    def _lifted_sched(self, placed: list[int] | None, model: bool) -> rt.ThreadSched:
        """SCHED_FIFO above the profile's inference threads (a front end's: FRONT_PRIORITY),
        on its (or the pin's) CPUs."""
        wanted = self.wanted
        priority = (min(99, wanted.priority + 1) if wanted is not None and rt.is_realtime(wanted)
                    else LIFTED_PRIORITY if model else FRONT_PRIORITY)
        cpus = placed or (wanted.cpus if wanted is not None else self.full_cpus)
        return rt.ThreadSched("fifo", priority, list(cpus))


def _alive(tid: int) -> bool:
    """Whether thread ``tid`` of this process still runs."""
    return os.path.exists(f"/proc/self/task/{tid}")
