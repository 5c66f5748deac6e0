"""The speed ratio of a built model to the original, measured on this device: both sessions
run interleaved (ABBA), so drift in clocks and load falls on both, and the ratio of their
median latencies is taken.  Tests inject a measurement instead of asserting a speed.  And
the build's peak memory, which a 4 GB board running an agent beside it must have."""

from __future__ import annotations

import contextlib
import resource
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.modelbuild.request import Feed

# original session, built session, one input -> original latency / built latency
Measure = Callable[[Any, Any, Feed], float]

WARMUP_RUNS = 3
MIN_RUNS = 12
MAX_RUNS = 80
BUDGET_S = 8.0  # per variant: enough runs for a stable median on a noisy 2-core machine


def _once(session: Any, feed: Feed) -> float:
    start = time.perf_counter()
    session.run(None, feed)
    return time.perf_counter() - start


def interleaved(original: Any, built: Any, feed: Feed) -> float:
    for _ in range(WARMUP_RUNS):
        original.run(None, feed)
        built.run(None, feed)
    a: list[float] = []
    b: list[float] = []
    deadline = time.monotonic() + BUDGET_S
    while len(a) < MAX_RUNS and (len(a) < MIN_RUNS or time.monotonic() < deadline):
        first, second = (original, built) if len(a) % 2 == 0 else (built, original)
        t1, t2 = _once(first, feed), _once(second, feed)
        a.append(t1 if first is original else t2)
        b.append(t2 if first is original else t1)
    return statistics.median(a) / max(statistics.median(b), 1e-9)


class PeakMemory:
    """The highest resident memory (MB) of a build: this process's high-water mark (VmHWM,
    reset at the start where the kernel lets a process reset its own, so an agent's earlier
    peaks do not count), or a child's (the .rknn converter) when one rose above it."""

    STATUS = Path("/proc/self/status")  # the process itself, not hardware: never below --root

    def __init__(self) -> None:
        with contextlib.suppress(OSError):
            Path("/proc/self/clear_refs").write_text("5")  # 5: reset the peak RSS only
        self.children_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss

    def mb(self) -> float:
        own_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        with contextlib.suppress(OSError, IndexError, ValueError):
            own_kb = int(self.STATUS.read_text().split("VmHWM:")[1].split()[0])
        children_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        if children_kb > self.children_kb:
            own_kb = max(own_kb, children_kb)
        return round(own_kb / 1024, 1)
