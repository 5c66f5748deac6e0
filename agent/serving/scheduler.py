"""The workers of one served version: one thread per session (instance), all fed from the
version's one queue, so N instances of a model share its priorities, bounds and batches.  A
request that finds an idle instance and nothing queued runs on its caller's thread, unless
that thread runs at another real-time priority than the workers (the ``realtime`` lever,
threads.py): a front end lifted for a model would lend another model's run its lift, and a
lifted model's run on a front end's thread would lose its own.

A worker never dies of a request: whatever a run raises answers every request of that run
and the worker takes the next.  ``close`` lets the workers drain the queue and exit.

A run is one request's problem, not the process's: the watchdog cancels a run still going at
its deadline — the earliest ``timeout`` of its requests, or the model's ``max_run_ms`` —
through the backend's run control (ORT's ``RunOptions.terminate``), and its requests are
answered DEADLINE_EXCEEDED at once, naming the model and the limit (a run on its caller's
own thread hands the answer over when the runtime gives the run back: within one operator
for ORT, after the row on the NPU for RKNN).  Only a run that does not
come back within CANCEL_GRACE_S of its cancellation makes the version ``stuck``, which is
what the supervisor kills the process for: the runtime itself no longer answers then.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from agent.serving.batching import combine, split
from agent.serving.counters import Counters, Run
from agent.serving.errors import ServeError, invalid, unavailable
from agent.serving.levers import Admission
from agent.serving.pending import Pending, PendingQueue, deadline_exceeded
from agent.serving.policy import SchedulePolicy
from agent.serving.tensors import ort_message
from agent.serving.watchdog import WATCHDOG, Watch, Watchdog

logger = logging.getLogger(__name__)

# A cancelled ORT run stops within one operator; one that has not come back this long after
# its cancellation is a runtime that no longer answers (a hung driver, an NPU inference
# that cannot be cut), and only then is the process worth killing.
CANCEL_GRACE_S = 5.0


class Scheduler:
    def __init__(self, label: str, thread_name: str, sessions: Sequence[Any],
                 output_names: Sequence[str], policy: SchedulePolicy, counters: Counters,
                 worker_start: Callable[[], None] | None = None,
                 warm_up: Callable[[Any], object] | None = None, *,
                 max_run_ms: int, watchdog: Watchdog = WATCHDOG) -> None:
        """Threads ``{thread_name}-{index}``; ``worker_start`` runs first on each (the
        server adopts it as an inference thread for the profile's scheduling), then
        ``warm_up`` with the worker's session: a first run on a thread costs milliseconds
        that no client's request should pay.  ``max_run_ms``: the longest a run may take
        (config.yaml ``max_run_ms``)."""
        self.label = label
        self.output_names = tuple(output_names)
        self.queue = PendingQueue(policy, label)
        self.counters = counters
        self.max_run_ms = max_run_ms
        self._watchdog = watchdog
        self._worker_start = worker_start
        self._warm_up = warm_up
        self._sessions = tuple(sessions)
        self._controls = [session.run_options() for session in self._sessions]
        self._runs: list[Watch | None] = [None] * len(sessions)  # each instance's run
        self.cancelled = 0  # runs the watchdog cut short
        self.admission = Admission()  # the QoS controller's cap (none until it sets one)
        self.inline = True  # an idle instance may run a request on its caller's thread
        self._threads = [threading.Thread(target=self._work, args=(index, session),
                                          name=f"{thread_name}-{index}",
                                          daemon=True)
                         for index, session in enumerate(sessions)]
        # each worker's start done before the version can serve: a move of its CPUs
        # (Version.place) must find every worker adopted, and none pins itself afterwards
        self._started = [threading.Event() for _ in self._threads]
        for thread in self._threads:
            thread.start()
        for started in self._started:
            started.wait()

    def submit(self, item: Pending) -> dict[str, np.ndarray]:
        """Queue ``item`` and wait for its outputs; past its deadline while still queued it
        is taken back and answered DEADLINE_EXCEEDED (a run in progress is cancelled by
        the watchdog, which answers it); UNAVAILABLE at once above the admission cap."""
        if not self.admission.admit():
            raise unavailable(f"{self.label} admits at most {self.admission.rate:g} "
                              "requests/s now (the QoS controller holds it for a model of "
                              "a higher class); try again")
        instance = self.queue.claim() if self.inline and self._inline_here() else None
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

    def _inline_here(self) -> bool:
        """Whether the caller's thread runs at the workers' priority."""
        try:
            return os.sched_getparam(0).sched_priority == os.sched_getparam(
                self._threads[0].native_id or 0).sched_priority
        except OSError:  # a worker gone (closing): its queue answers
            return False

    def tids(self) -> list[int]:
        """The workers' kernel thread ids (each has started: see ``__init__``)."""
        return [thread.native_id for thread in self._threads if thread.native_id is not None]

    def close(self) -> None:
        self.queue.close()

    def join(self, timeout_s: float) -> bool:
        """Wait for the workers to drain and exit; whether they all did."""
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in self._threads)

    def stuck(self) -> bool:
        """Whether a run was cancelled more than CANCEL_GRACE_S ago and is still going."""
        grace = time.perf_counter_ns() - int(CANCEL_GRACE_S * 1e9)
        return any(0 < run.cancelled_ns < grace for run in list(self._runs)
                   if run is not None)

    def _work(self, index: int, session: Any) -> None:
        try:
            if self._worker_start is not None:
                self._worker_start()
        finally:
            self._started[index].set()
        if self._warm_up is not None:
            self._warm_up(session)
        while (batch := self.queue.take(index)) is not None:
            self._serve(index, session, batch)

    def _serve(self, index: int, session: Any, batch: list[Pending]) -> None:
        """One run answering every request of ``batch``, whatever it raises, unless the
        watchdog cancelled it (then the watchdog has answered them)."""
        start = time.perf_counter_ns()
        control = self._controls[index]
        watch = self._runs[index] = self._watchdog.watch(
            self._deadline(start, batch), lambda now: self._cancel(control, batch, start, now))
        try:
            shares, figures = self._run(index, session, control, batch, start)
        except Exception as error:  # the run's requests get the error; the worker goes on
            if not watch.finish():
                self._controls[index] = session.run_options()  # this one says terminate
                return
            if not isinstance(error, ServeError):
                logger.exception("%s: a run failed", self.label)
                error = ServeError("INTERNAL", f"{self.label}: the run failed inside the "
                                   "server (a bug: the agent's log has the details)")
            for item in batch:
                item.answer.set(error=error)
            return
        finally:
            self._runs[index] = None
        if not watch.finish():  # it came back as the watchdog cancelled it: answered
            self._controls[index] = session.run_options()
            return
        self.counters.executed(figures)
        for item, share in zip(batch, shares, strict=True):
            item.answer.set(share)

    def _deadline(self, start: int, batch: list[Pending]) -> int:
        """The run's deadline: its earliest request's, or max_run_ms from its start."""
        deadlines = [item.deadline_ns for item in batch if item.timeout_ns]
        return min([start + self.max_run_ms * 1_000_000, *deadlines])

    def _cancel(self, control: Any, batch: list[Pending], start: int, now: int) -> None:
        """The watchdog's side: terminate the run and answer each request with the limit
        the run went past."""
        control.terminate = True
        self.cancelled += 1
        by_timeout = self._deadline(start, batch) < start + self.max_run_ms * 1_000_000
        for item in batch:
            if item.timeout_ns and item.deadline_ns <= now:
                why = f"past the request's timeout of {item.timeout_ns / 1e6:g} ms"
            elif by_timeout:
                why = "at the timeout of another request batched with it"
            else:
                why = f"past its max_run_ms {self.max_run_ms} (config.yaml)"
            item.answer.set(error=ServeError(
                "DEADLINE_EXCEEDED", f"{self.label}: the run was cancelled after "
                f"{(now - start) / 1e6:.0f} ms, {why}"))

    def _run(self, index: int, session: Any, control: Any, batch: list[Pending],
             start: int) -> tuple[list[dict[str, np.ndarray]], Run]:
        """Each request's share of the run's outputs, and the run's figures."""
        wanted = {name for item in batch for name in item.outputs}
        names = [name for name in self.output_names if name in wanted]
        feeds = combine([item.inputs for item in batch])
        ready = time.perf_counter_ns()
        try:
            arrays = session.run(names, feeds, control)
        except Exception as error:  # ORT refusing the data: the request's fault
            raise invalid(f"{self.label}: onnxruntime: {ort_message(error)}") from None
        ran = time.perf_counter_ns()
        rows = [item.rows for item in batch]
        shares = split(names, [np.asarray(array) for array in arrays], rows)
        end = time.perf_counter_ns()
        return ([{name: share[name] for name in item.outputs}
                 for item, share in zip(batch, shares, strict=True)],
                Run(index, rows, [item.enqueued_ns for item in batch], start, ready, ran, end))
