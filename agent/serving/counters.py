"""One version's figures in the shape of Triton's statistics extension, plus the queue wait
and per-instance figures this server adds.

As Triton counts them: ``success``/``fail`` and ``queue`` per request; a run's
``compute_*`` durations are added to each request it served (so their counts are requests)
and once to ``batch_stats`` under the run's batch size (counts there are runs);
``inference_count`` is the batch rows of successful requests, ``execution_count`` the runs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

from agent.inference.stats import LatencyStats

COMPUTE = ("compute_input", "compute_infer", "compute_output")


class Run(NamedTuple):
    """One execution: its instance, its requests' batch rows and submit times, and the
    perf_counter_ns marks of its phases (start, inputs ready, model ran, outputs split).
    A tuple: one is built per run, and a frozen dataclass's ``__init__`` cost 2 us."""

    instance: int
    rows: Sequence[int]
    enqueued_ns: Sequence[int]
    start: int
    ready: int
    ran: int
    end: int

    def compute(self) -> tuple[int, int, int]:
        return self.ready - self.start, self.ran - self.ready, self.end - self.ran


class Counters:
    KINDS = ("success", "fail", "queue", *COMPUTE)

    def __init__(self, instances: int) -> None:
        self.lock = threading.Lock()
        self.count = dict.fromkeys(self.KINDS, 0)
        self.ns = dict.fromkeys(self.KINDS, 0)
        self.inference_count = 0
        self.execution_count = 0
        self.last_inference_ms = 0
        self.batches: dict[int, list[int]] = {}  # batch size -> [runs, input, infer, output ns]
        self.executions = [0] * instances
        self.busy_ns = [0] * instances
        self.queue_wait = LatencyStats()
        # per instance, each request's latency (submit to answer) and queue wait: the data
        # plane's Prometheus histograms per model, version and instance
        self.instance_latency = [LatencyStats() for _ in range(instances)]
        self.instance_wait = [LatencyStats() for _ in range(instances)]

    def _add(self, kind: str, ns: int, times: int = 1) -> None:
        self.count[kind] += times
        self.ns[kind] += ns * times

    def failed(self, ns: int) -> None:
        with self.lock:
            self._add("fail", ns)

    def executed(self, run: Run) -> None:
        """A run that answered each of its requests."""
        compute = run.compute()
        size = sum(run.rows)
        requests = len(run.rows)
        start, end, instance = run.start, run.end, run.instance
        waits = (self.queue_wait, self.instance_wait[instance])
        latency = self.instance_latency[instance]
        count, total = self.count, self.ns
        with self.lock:
            for enqueued in run.enqueued_ns:
                wait = start - enqueued
                for stats in waits:
                    stats.call_started(enqueued)
                    stats.record(wait)
                latency.call_started(enqueued)
                latency.record(end - enqueued)
                total["success"] += end - enqueued
                total["queue"] += wait
            count["success"] += requests
            count["queue"] += requests
            for kind, ns in zip(COMPUTE, compute, strict=True):
                self._add(kind, ns, requests)
            batch = self.batches.get(size)
            if batch is None:
                batch = self.batches[size] = [0, 0, 0, 0]
            batch[0] += 1
            batch[1] += compute[0]
            batch[2] += compute[1]
            batch[3] += compute[2]
            self.inference_count += size
            self.execution_count += 1
            self.executions[instance] += 1
            self.busy_ns[instance] += end - start
            self.last_inference_ms = time.time_ns() // 1_000_000

    def view(self) -> dict[str, Any]:
        """Triton's model_stats fields."""
        with self.lock:
            return {
                "last_inference": self.last_inference_ms,
                "inference_count": self.inference_count,
                "execution_count": self.execution_count,
                "inference_stats": {kind: {"count": self.count[kind], "ns": self.ns[kind]}
                                    for kind in self.KINDS},
                "batch_stats": [
                    {"batch_size": size,
                     **{kind: {"count": runs[0], "ns": runs[index]}
                        for index, kind in enumerate(COMPUTE, 1)}}
                    for size, runs in sorted(self.batches.items())],
            }

    def instances(self) -> list[dict[str, Any]]:
        """Each instance's runs and busy time, and its requests' latency and queue-wait
        windows (``Window.to_dict``)."""
        with self.lock:
            return [{"index": index, "executions": self.executions[index],
                     "busy_ns": self.busy_ns[index],
                     "window": self.instance_latency[index].window().to_dict(),
                     "queue": self.instance_wait[index].window().to_dict()}
                    for index in range(len(self.executions))]

    def queue_window(self) -> dict[str, Any]:
        """Every request's queue wait (``Window.to_dict``)."""
        with self.lock:
            return self.queue_wait.window().to_dict()

    def queue_snapshot(self) -> dict[str, Any]:
        with self.lock:
            return self.queue_wait.snapshot()
