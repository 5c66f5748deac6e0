"""The device's power while a candidate is measured: the rails' total, as telemetry's
PowerCollector reads it (``total_mw``'s rule), sampled every SAMPLE_S in a thread of its
own and averaged.  A rail reads what its sensor last averaged (L4T's INA3221: 512 samples
every 430 ms), so a sample every 100 ms misses none of its updates."""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import TracebackType

from agent.discovery.model import Topology
from agent.kernel.fsroot import Root
from agent.kernel.reader import SysReader
from agent.telemetry.collectors.base import rounded
from agent.telemetry.collectors.power import (
    INPUT_RAILS,
    PowerCollector,
    summed_rails,
    total_mw,
)

SAMPLE_S = 0.1
STOP_S = 1.0  # a read blocked this long is left to its daemon thread, not waited for


class RailPower:
    """The device's power now (mW), read from its rails under a root."""

    def __init__(self, root: Root, topology: Topology) -> None:
        self._collector = PowerCollector(SysReader(root), topology)
        names = [rail.name for rail in topology.power_rails]
        summed = summed_rails(names)
        self.described = f"{summed[0]} (the input rail)" if summed[:1] and \
            summed[0] in INPUT_RAILS else f"{' + '.join(summed)} (no input rail: approximate)"

    @classmethod
    def of(cls, root: Root, topology: Topology) -> RailPower | None:
        """None on a board without rails."""
        return cls(root, topology) if topology.power_rails else None

    def read(self) -> float | None:
        return total_mw(self._collector.collect())


class Sampling:
    """``with Sampling(read) as s:`` reads every SAMPLE_S (once at least) until the block
    ends; ``s.mean_mw()`` then averages the reads that had a value (None: none had, or
    ``read`` is None).  A running sum, not a list: memory does not grow with the window."""

    def __init__(self, read: Callable[[], float | None] | None,
                 interval_s: float = SAMPLE_S) -> None:
        self._read, self._interval = read, interval_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._sum, self._count = 0.0, 0
        self._thread = None if read is None else threading.Thread(
            target=self._run, name="tune-power", daemon=True)

    def __enter__(self) -> Sampling:
        if self._thread is not None:
            self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(STOP_S)

    def _run(self) -> None:
        assert self._read is not None
        while True:
            value = self._read()
            if value is not None:
                with self._lock:
                    self._sum += value
                    self._count += 1
            if self._stop.wait(self._interval):
                return

    def mean_mw(self) -> float | None:
        with self._lock:
            return rounded(self._sum / self._count) if self._count else None
