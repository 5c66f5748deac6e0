"""What a collector is, and the arithmetic that rate collectors share.

A collector is built once from the topology and then only reads values: no directory walks
and no symlink resolution per sample.  Rates come from counter deltas over the interval
between two calls, so the first call of a rate collector reports None.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from agent.kernel.reader import SysReader

Clock = Callable[[], float]
DECIMALS = 3  # telemetry floats carry at most this many decimals


class Collector(Protocol):
    """One metric group: ``key`` names it in telemetry ``metrics``."""

    key: str

    def collect(self) -> Any:
        """A JSON-able value; absent hardware and unreadable files are None, never raised."""
        ...


class Interval:
    """Seconds between successive calls, measured on an injectable monotonic clock."""

    def __init__(self, clock: Clock = time.monotonic) -> None:
        self._clock = clock
        self._last: float | None = None

    def elapsed(self) -> float | None:
        """Seconds since the previous call; None on the first call or if the clock stood."""
        now = self._clock()
        last, self._last = self._last, now
        if last is None or now <= last:
            return None
        return now - last


def rate(before: int | None, after: int | None, seconds: float | None,
         scale: float = 1.0) -> float | None:
    """``(after - before) * scale`` per second; None without a previous value or when the
    counter went backwards (a device re-added, a driver reloaded)."""
    if before is None or after is None or seconds is None or after < before:
        return None
    return round((after - before) * scale / seconds, DECIMALS)


def rounded(value: float | None) -> float | None:
    """A measurement as a telemetry float."""
    return round(float(value), DECIMALS) if value is not None else None


def percent(part: float, whole: float) -> float | None:
    """``part`` as a percentage of ``whole``, clamped to 0..100 (counters sampled a tick
    apart can overshoot); None when ``whole`` is not positive."""
    if whole <= 0:
        return None
    return round(min(max(100.0 * part / whole, 0.0), 100.0), DECIMALS)


def resolved(reader: SysReader, path: str) -> str:
    """``path`` with its symlinks resolved once, at build time, so that a sample does not walk
    them again; the path as given when it does not exist."""
    return reader.realpath(path) or path
