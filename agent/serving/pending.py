"""One version's queue of requests waiting for a worker: a FIFO per priority level, bounded,
with deadlines, closed for good when the version is dropped.

Workers ``take`` the next run: the oldest request of the highest level, alone or (when the
policy batches) with the requests behind it that can share its run, in queue order — a
request that cannot join stops the batch rather than being skipped, so no request is
overtaken by one of its own level.  When nothing is queued and the version does not batch, a
caller may ``claim`` an idle worker's instance and run on its own thread (``restore`` hands it
back): no request waits then, so no order is broken, and the two thread hand-offs a queued
request costs are saved.  Everything is under one condition variable.

A full queue still admits a request of a higher level than some queued ones: the newest
request of the lowest non-empty level below it is shed (answered UNAVAILABLE, saying so), so
clients flooding a low level cannot starve a high one.  Shedding rather than a quota per
level keeps the whole queue for whoever needs it (a model with one busy level loses
nothing), and the newest is shed because it has waited least: the older ones are closest
to their run.  A request is refused only when nothing queued is below it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from agent.serving.batching import Signature, cut
from agent.serving.core import Tensor
from agent.serving.errors import ServeError, unavailable
from agent.serving.policy import SchedulePolicy


class Retired(ServeError):
    """A submit to a version that no longer serves (after a swap or an unload): the registry
    sends the request to what serves now."""

    def __init__(self, label: str) -> None:
        super().__init__("UNAVAILABLE", f"{label} no longer serves")


class Answer:
    """A request's outputs (by name) or error, handed from its worker to its caller.

    A bare lock, held until answered, is the cheapest wait there is; a request allocates
    few objects this way, so the garbage collector, whose pauses show in a p99, runs less.
    """

    __slots__ = ("_unanswered", "answered", "error", "outputs")

    def __init__(self) -> None:
        self._unanswered = threading.Lock()
        self._unanswered.acquire()
        self.answered = False
        self.outputs: dict[str, np.ndarray] = {}
        self.error: ServeError | None = None

    def set(self, outputs: dict[str, np.ndarray] | None = None,
            error: ServeError | None = None) -> None:
        """Answer once (by the one thread that holds the request)."""
        self.outputs, self.error = outputs or {}, error
        self.answered = True
        self._unanswered.release()

    def wait(self, timeout_s: float = -1) -> bool:
        """Whether it is answered, waiting at most ``timeout_s`` (-1: as long as it takes)."""
        if self._unanswered.acquire(timeout=timeout_s):
            self._unanswered.release()
            return True
        return False

    def result(self) -> dict[str, np.ndarray]:
        self.wait()
        if self.error is not None:
            raise ServeError(self.error.code, self.error.message,  # one raise per caller
                             self.error.http_status)
        return self.outputs


@dataclass(eq=False, slots=True)
class Pending:
    """A request waiting for its run, and where its answer goes."""

    inputs: tuple[Tensor, ...]
    outputs: tuple[str, ...]
    rows: int  # its batch size (1 for a model that does not batch)
    level: int
    key: Signature
    timeout_ns: int = 0
    enqueued_ns: int = field(default_factory=time.perf_counter_ns)
    answer: Answer = field(default_factory=Answer)

    @property
    def deadline_ns(self) -> int:
        return self.enqueued_ns + self.timeout_ns if self.timeout_ns else 0


def deadline_exceeded(item: Pending, label: str) -> ServeError:
    return ServeError("DEADLINE_EXCEEDED", f"the request waited in the queue of {label} past "
                      f"its timeout of {item.timeout_ns / 1e6:g} ms")


class PendingQueue:
    def __init__(self, policy: SchedulePolicy, label: str) -> None:
        self.policy = policy
        self.label = label
        self._levels: list[deque[Pending]] = [deque() for _ in range(policy.levels)]
        self._size = 0
        self._ready = threading.Condition()
        self.closed = False
        self.refused = 0  # submits to a full queue
        self.shed = 0  # queued requests dropped for a higher-level one
        self.expired = 0  # requests answered DEADLINE_EXCEEDED unrun
        self._idle: list[int] = []  # instances whose worker waits for work
        self._lent: set[int] = set()  # instances a caller runs on its own thread

    @property
    def depth(self) -> int:
        return self._size

    def put(self, item: Pending) -> None:
        """Queue ``item``; when the queue is full, shed a lower-level request for it or
        answer UNAVAILABLE at once; Retired once closed."""
        with self._ready:
            if self.closed:
                raise Retired(self.label)
            if self._size >= self.policy.max_queue:
                self._shed_for(item.level)
            self._levels[item.level - 1].append(item)
            self._size += 1
            if self._lent:  # a lent instance's worker must not be the one woken
                self._ready.notify_all()
            else:
                self._ready.notify()

    def _shed_for(self, level: int) -> None:
        """Room for a request of ``level``: the newest of the lowest level below it goes,
        answered UNAVAILABLE; none below it: UNAVAILABLE for the newcomer."""
        for lower in range(self.policy.levels, level, -1):
            queued = self._levels[lower - 1]
            if queued:
                shed = queued.pop()
                self._size -= 1
                self.shed += 1
                shed.answer.set(error=unavailable(
                    f"queue of {self.label} is full ({self.policy.max_queue}): this request "
                    f"(priority level {lower}) was shed for one of higher priority {level}; "
                    "try again"))
                return
        self.refused += 1
        raise unavailable(f"queue of {self.label} is full ({self.policy.max_queue})")

    def retune(self, policy: SchedulePolicy) -> None:
        """A new policy, live (the QoS controller's levers): every waiting worker cuts again
        by it, so a shorter queue delay frees a batch that waited for company at once."""
        with self._ready:
            if policy.levels != self.policy.levels:
                raise ValueError("retune keeps the priority levels")
            self.policy = policy
            self._ready.notify_all()

    def claim(self) -> int | None:
        """An idle worker's instance for the caller to run on, when nothing is queued and
        the version does not batch (a batch would wait for company); None otherwise."""
        with self._ready:
            if self._size or self.closed or self.policy.batching or not self._idle:
                return None
            instance = self._idle.pop()
            self._lent.add(instance)
            return instance

    def restore(self, instance: int) -> None:
        """The claimed instance back to its worker, which takes what queued meanwhile.  With
        nothing queued the worker, still waiting in ``take``, is listed idle again without
        being woken: waking it only to wait again cost each such request a thread switch."""
        with self._ready:
            self._lent.discard(instance)
            if self._size or self.closed:
                self._ready.notify_all()
            elif instance not in self._idle:
                self._idle.append(instance)

    def withdraw(self, item: Pending) -> bool:
        """Take back a request past its deadline; False when a worker has it already."""
        with self._ready:
            try:
                self._levels[item.level - 1].remove(item)
            except ValueError:
                return False
            self._size -= 1
            self.expired += 1
            return True

    def close(self) -> None:
        """No more submits; what is queued is still served, then ``take`` returns None."""
        with self._ready:
            self.closed = True
            self._ready.notify_all()

    def take(self, instance: int = 0) -> list[Pending] | None:
        """The next run's requests for ``instance``'s worker, waiting as long as there are
        none or a caller has the instance; None once closed and drained."""
        with self._ready:
            while True:
                now = time.perf_counter_ns()
                self._expire(now)
                if self._size == 0 or instance in self._lent:
                    if self.closed and instance not in self._lent:
                        return None
                    if instance not in self._lent and instance not in self._idle:
                        self._idle.append(instance)
                    self._ready.wait()
                    continue
                if instance in self._idle:
                    self._idle.remove(instance)
                if not self.policy.batching:
                    return [self._pop()]
                chosen, can_grow = self._candidates()
                waited_until = chosen[0].enqueued_ns + self.policy.delay_ns
                count = cut([item.rows for item in chosen], self.policy.preferred, can_grow,
                            self.closed or now >= waited_until)
                if count:
                    return [self._pop() for _ in range(count)]
                self._ready.wait((waited_until - now) / 1e9)

    def _queued(self) -> Iterator[Pending]:
        for level in self._levels:
            yield from level

    def _pop(self) -> Pending:
        for level in self._levels:
            if level:
                self._size -= 1
                return level.popleft()
        raise IndexError("take from an empty queue")

    def _candidates(self) -> tuple[list[Pending], bool]:
        """The requests from the head that can share one run, and whether more could join
        (none in the way, room below max_batch)."""
        items = self._queued()
        first = next(items)
        chosen, rows = [first], first.rows
        for item in items:
            if item.key != first.key or rows + item.rows > self.policy.max_batch:
                return chosen, False
            chosen.append(item)
            rows += item.rows
        return chosen, rows < self.policy.max_batch

    def _expire(self, now: int) -> None:
        """Answer every request past its deadline without running it."""
        for level in self._levels:
            late = [item for item in level if item.deadline_ns and item.deadline_ns <= now]
            for item in late:
                level.remove(item)
                self._size -= 1
                self.expired += 1
                item.answer.set(error=deadline_exceeded(item, self.label))
