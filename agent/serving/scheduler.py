"""The workers of one served version: one thread per session (instance), all fed from the
version's one queue, so N instances of a model share its priorities, bounds and batches.  A
request that finds an idle instance and nothing queued runs on its caller's thread.

A worker never dies of a request: whatever a run raises answers every request of that run
and the worker takes the next.  ``close`` lets the workers drain the queue and exit.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from agent.serving.batching import combine, split
from agent.serving.counters import Counters, Run
from agent.serving.errors import ServeError, invalid
from agent.serving.pending import Pending, PendingQueue, deadline_exceeded
from agent.serving.policy import SchedulePolicy
from agent.serving.tensors import ort_message

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, label: str, thread_name: str, sessions: Sequence[Any],
                 output_names: Sequence[str], policy: SchedulePolicy, counters: Counters,
                 worker_start: Callable[[], None] | None = None,
                 warm_up: Callable[[Any], object] | None = None) -> None:
        """Threads ``{thread_name}-{index}``; ``worker_start`` runs first on each (the
        server adopts it as an inference thread for the profile's scheduling), then
        ``warm_up`` with the worker's session: a first run on a thread costs milliseconds
        that no client's request should pay."""
        self.label = label
        self.output_names = tuple(output_names)
        self.queue = PendingQueue(policy, label)
        self.counters = counters
        self._worker_start = worker_start
        self._warm_up = warm_up
        self._sessions = tuple(sessions)
        self._busy_since: list[int | None] = [None] * len(sessions)
        self._threads = [threading.Thread(target=self._work, args=(index, session),
                                          name=f"{thread_name}-{index}",
                                          daemon=True)
                         for index, session in enumerate(sessions)]
        for thread in self._threads:
            thread.start()

    def submit(self, item: Pending) -> dict[str, np.ndarray]:
        """Queue ``item`` and wait for its outputs; past its deadline while still queued it
        is taken back and answered DEADLINE_EXCEEDED (a run once started is not cut)."""
        instance = self.queue.claim()
        if instance is not None:
            try:
                self._serve(instance, self._sessions[instance], [item])
            finally:
                self.queue.restore(instance)
            return item.answer.result()
        self.queue.put(item)
        if item.timeout_ns:
            left = item.deadline_ns - time.perf_counter_ns()
            if not item.answer.wait(max(left, 0) / 1e9) and self.queue.withdraw(item):
                raise deadline_exceeded(item, self.label)
        return item.answer.result()

    def close(self) -> None:
        self.queue.close()

    def join(self, timeout_s: float) -> bool:
        """Wait for the workers to drain and exit; whether they all did."""
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in self._threads)

    def longest_run_ns(self) -> int:
        """How long the oldest run in progress has taken so far (0: none runs)."""
        starts = [start for start in self._busy_since if start is not None]
        return time.perf_counter_ns() - min(starts) if starts else 0

    def _work(self, index: int, session: Any) -> None:
        if self._worker_start is not None:
            self._worker_start()
        if self._warm_up is not None:
            self._warm_up(session)
        while (batch := self.queue.take(index)) is not None:
            self._serve(index, session, batch)

    def _serve(self, index: int, session: Any, batch: list[Pending]) -> None:
        """One run answering every request of ``batch``, whatever it raises."""
        try:
            self._run(index, session, batch)
        except Exception as error:  # the run's requests get the error; the worker goes on
            if not isinstance(error, ServeError):
                logger.exception("%s: a run failed", self.label)
                error = ServeError("INTERNAL", f"{self.label}: the run failed inside the "
                                   "server (a bug: the agent's log has the details)")
            for item in batch:
                if not item.answer.answered:
                    item.answer.set(error=error)
        finally:
            self._busy_since[index] = None

    def _run(self, index: int, session: Any, batch: list[Pending]) -> None:
        start = time.perf_counter_ns()
        self._busy_since[index] = start
        wanted = {name for item in batch for name in item.outputs}
        names = [name for name in self.output_names if name in wanted]
        feeds = combine([item.inputs for item in batch])
        ready = time.perf_counter_ns()
        try:
            arrays = session.run(names, feeds)
        except Exception as error:  # ORT refusing the data: the request's fault
            raise invalid(f"{self.label}: onnxruntime: {ort_message(error)}") from None
        ran = time.perf_counter_ns()
        rows = [item.rows for item in batch]
        shares = split(names, [np.asarray(array) for array in arrays], rows)
        end = time.perf_counter_ns()
        self.counters.executed(Run(index, rows, [item.enqueued_ns for item in batch],
                                   start, ready, ran, end))
        for item, share in zip(batch, shares, strict=True):
            item.answer.set({name: share[name] for name in item.outputs})
