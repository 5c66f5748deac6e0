"""The runs' watchdog: one thread for the whole data plane that cancels every run still going
at its deadline (the earliest ``timeout`` of its requests, or its model's ``max_run_ms``).

One thread and a heap, not a timer per run: a run costs a push under one lock, and the
thread sleeps until the earliest deadline.  A run that ends first is only marked finished;
its entry leaves the heap when it reaches the top (or when the heap is compacted), and it
has dropped what it referenced by then, so a finished run holds no request's tensors.

Whichever comes first wins, once: the run's ``finish`` (its results go to its requests) or
the watchdog's cancellation (the ``cancel`` callback terminates the run and answers its
requests; the worker must then answer nothing).

The thread starts with the first run watched and so inherits that run's thread's CPUs and
scheduling (the profile's inference ones): it only sleeps and sets flags, and a realtime
policy keeps a cancellation on time under load.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable

from agent.kernel.process import name_current_thread

COMPACT_AT = 1024  # entries before finished ones are swept out of the heap


class Watch:
    """One run under the watchdog."""

    __slots__ = ("_cancel", "_lock", "cancelled_ns", "deadline_ns", "finished")

    def __init__(self, deadline_ns: int, cancel: Callable[[int], None]) -> None:
        self.deadline_ns = deadline_ns
        self._cancel: Callable[[int], None] | None = cancel
        self._lock = threading.Lock()
        self.finished = False
        self.cancelled_ns = 0  # when it was cancelled (perf_counter_ns); 0: it was not

    def finish(self) -> bool:
        """The run came back: True when its results are its requests' to have (it was not
        cancelled first)."""
        with self._lock:
            self.finished = True
            self._cancel = None
            return not self.cancelled_ns

    def expire(self, now_ns: int) -> None:
        """Cancel the run unless it finished; ``cancel`` gets ``now_ns``.  Called outside
        the lock: the run may come back meanwhile, and ``finish`` then says it was
        cancelled, so only ``cancel`` answers its requests."""
        with self._lock:
            cancel, self._cancel = self._cancel, None
            if self.finished or cancel is None:
                return
            self.cancelled_ns = now_ns
        cancel(now_ns)


class Watchdog:
    """Cancels runs past their deadlines; its thread starts with the first run watched."""

    def __init__(self, name: str = "run-watchdog") -> None:
        self._name = name
        self._ready = threading.Condition(threading.Lock())  # not re-entered: no RLock
        self._heap: list[tuple[int, int, Watch]] = []
        self._order = itertools.count()  # ties never compare two Watch objects
        self._compact_at = COMPACT_AT
        self._thread: threading.Thread | None = None

    def watch(self, deadline_ns: int, cancel: Callable[[int], None]) -> Watch:
        """A run that ``cancel`` cuts short if it has not finished by ``deadline_ns``
        (perf_counter_ns)."""
        entry = Watch(deadline_ns, cancel)
        with self._ready:
            heapq.heappush(self._heap, (deadline_ns, next(self._order), entry))
            if len(self._heap) >= self._compact_at:
                self._compact()
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name,
                                                daemon=True)
                self._thread.start()
            elif self._heap[0][2] is entry:  # earlier than what the thread sleeps for
                self._ready.notify()
        return entry

    def _compact(self) -> None:
        """Sweep out finished runs; the next sweep waits until the heap doubles, so a push
        costs O(log n) amortised however many runs finish before their deadlines."""
        self._heap = [item for item in self._heap if not item[2].finished]
        heapq.heapify(self._heap)
        self._compact_at = max(COMPACT_AT, 2 * len(self._heap))

    def _loop(self) -> None:
        # started by the first run's thread, whose kernel name (infer-http_0) it would keep:
        # its own, so ``top -H`` and the profile's thread patterns do not take it for one
        name_current_thread(self._name)
        while True:
            due = []
            with self._ready:
                now = time.perf_counter_ns()
                while self._heap and (self._heap[0][0] <= now or self._heap[0][2].finished):
                    _, _, entry = heapq.heappop(self._heap)
                    if not entry.finished:
                        due.append(entry)
                if not due:
                    wait = (self._heap[0][0] - now) / 1e9 if self._heap else None
                    self._ready.wait(wait)
                    continue
            for entry in due:  # outside the lock: a cancel answers requests
                entry.expire(now)


# the data plane's one watchdog: every scheduler shares its thread (started on first use)
WATCHDOG = Watchdog()
