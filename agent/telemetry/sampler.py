"""The sampler: every interval, one record from all collectors into the outbox.

Records are stamped with (session, seq) when they are taken, not when they are sent, so a
record written during a broker outage keeps the identity it had when it was measured.  The
schedule is fixed-rate on the monotonic clock: a slow sample delays the next one, it does
not shift every later one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from agent.telemetry.collectors.base import Collector
from agent.telemetry.outbox import Outbox
from agent.telemetry.records import Sequence, encode, stamp

logger = logging.getLogger(__name__)


class FunctionCollector:
    """A metric group the service computes itself (inference statistics, tuning status)."""

    def __init__(self, key: str, read: Callable[[], Any]) -> None:
        self.key, self._read = key, read

    def collect(self) -> Any:
        return self._read()


class Sampler:
    def __init__(self, collectors: Iterable[Collector], outbox: Outbox, sequence: Sequence,
                 topic: str, interval_s: float, max_payload_bytes: int,
                 metrics: Iterable[str] | None = None) -> None:
        self.collectors = list(collectors)
        self.outbox, self.sequence, self.topic = outbox, sequence, topic
        self.interval_s, self.max_payload_bytes = interval_s, max_payload_bytes
        self.metrics = set(metrics) if metrics is not None else None
        self.last: dict[str, Any] | None = None  # the latest record, for status and /metrics
        self.oversized = 0
        self._failing: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def set_collectors(self, collectors: Iterable[Collector]) -> None:
        """Sample from these from the next round on (the device changed)."""
        self.collectors = list(collectors)

    def set_metrics(self, metrics: Iterable[str] | None) -> None:
        """Limit records to these groups (None: all); takes effect at the next sample."""
        self.metrics = set(metrics) if metrics is not None else None

    def collect(self) -> dict[str, Any]:
        """Every selected group; a collector that raises is logged once and reported null."""
        metrics: dict[str, Any] = {}
        for collector in self.collectors:
            if self.metrics is not None and collector.key not in self.metrics:
                continue
            try:
                metrics[collector.key] = collector.collect()
            except Exception as error:  # one broken source must not stop telemetry
                metrics[collector.key] = None
                if collector.key not in self._failing:
                    self._failing.add(collector.key)
                    logger.warning("telemetry: collector %s failed: %s", collector.key, error)
        return metrics

    def sample_once(self) -> dict[str, Any]:
        """Take one record and queue it; returns it."""
        metrics = self.collect()

        def queue(session: int, seq: int) -> dict[str, Any]:
            record = stamp("telemetry/1", session=session, seq=seq, historical=False,
                           metrics=metrics)
            payload = encode(record)
            if len(payload) > self.max_payload_bytes:
                self.oversized += 1
                logger.error("telemetry: record %d/%d is %d bytes, above mqtt.max_payload_kb;"
                             " not queued (select fewer groups with telemetry.metrics)",
                             session, seq, len(payload))
            else:
                self.outbox.put(self.topic, payload)
            return record

        self.last = self.sequence.issue(queue)
        return self.last

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="telemetry", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        deadline = time.monotonic()
        while not self._stop.is_set():
            self.sample_once()
            deadline += self.interval_s
            now = time.monotonic()
            if deadline < now:  # fell behind (suspend, overload): start again from now
                deadline = now
            self._stop.wait(deadline - now)
