"""Per-model inference statistics, cheap enough to record every call.

Latencies go into a fixed log-linear histogram (HDR-style): values below 128 ns have a bucket
each, and every power of two above is split into 64 equal buckets, so a bucket is at most 1/64
of its lower edge wide.  A percentile is reported as its bucket's midpoint, within 1/128
(< 0.8 %) of the true order statistic; mean and max are exact.  The bucket list is allocated
once and never grows: 2240 buckets cover 0 ns to 2**40 ns (18 min); slower calls land in the
top bucket and still count exactly in max and mean.

Threads: one thread (the inference loop) calls ``call_started``/``record``/``deadline_missed``;
any other thread may call ``window`` and ``snapshot``.  There
is no lock: every field is written by the loop alone, and in CPython a single attribute store or
list-item store is atomic, so a reader sees each field either before or after a store, never torn.
A reader may see one call counted in some fields and not yet in others; percentiles are computed
from one atomic copy of the buckets, so they always agree with their own total.

Counting: ``count`` is the successful calls (the latency samples), ``errors`` the failed ones, so
calls in all are ``count + errors``.  A failed call's latency is left out: a fast failure is not
a fast inference.  ``throughput_per_s`` is successful calls per second from the start of the
first call to the end of the last.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from operator import sub
from typing import Any

_SUB_BITS = 6  # 64 linear buckets per power of two: bucket width <= 1/64 of its lower edge
_LINEAR_LIMIT = 2 << _SUB_BITS  # values below this have one bucket each
_TOP_BIT_LENGTH = 40
HISTOGRAM_LIMIT_NS = 1 << _TOP_BIT_LENGTH
BUCKET_COUNT = (_TOP_BIT_LENGTH - _SUB_BITS + 1) << _SUB_BITS
# Shift that maps a value of a given bit length into its power of two's 64 sub-buckets; a table
# lookup is cheaper on the hot path than max(bit_length - 7, 0).
_SHIFT_FOR_BIT_LENGTH = tuple(max(n - _SUB_BITS - 1, 0) for n in range(_TOP_BIT_LENGTH + 1))

_QUANTILES = (50.0, 95.0, 99.0)


def _bucket_bounds(index: int) -> tuple[int, int]:
    """Lowest value and width (ns) of a bucket: the inverse of the index ``record`` computes."""
    if index < _LINEAR_LIMIT:
        return index, 1
    shift = (index >> _SUB_BITS) - 1
    return (index - (shift << _SUB_BITS)) << shift, 1 << shift


def _bucket_index(value_ns: int) -> int:
    """The bucket a latency lands in (``record`` inlines the same arithmetic)."""
    if value_ns >= HISTOGRAM_LIMIT_NS:
        return BUCKET_COUNT - 1
    shift = _SHIFT_FOR_BIT_LENGTH[value_ns.bit_length()]
    return (shift << _SUB_BITS) + (value_ns >> shift)


def _percentiles_ns(buckets: tuple[int, ...], qs: tuple[float, ...], max_ns: int) -> list[int]:
    """Bucket midpoints of the ``ceil(q% * n)``-th smallest samples, clamped to the exact max;
    zeros when there are no samples.  Cumulative sums and bisection keep the work in C, so a
    reader holds the GIL (and so delays the loop) for under 0.1 ms, half a Python loop's time."""
    cumulative = list(accumulate(buckets))
    total = cumulative[-1]
    if total == 0:
        return [0] * len(qs)
    found = []
    for q in qs:
        low, width = _bucket_bounds(bisect_left(cumulative, max(1, math.ceil(q * total / 100))))
        found.append(min(low + width // 2, max_ns))
    return found


def _ms(ns: float) -> float:
    return round(ns / 1e6, 6)


@dataclass(frozen=True)
class Window:
    """An immutable copy of the counters over a span of calls.

    ``LatencyStats.window()`` gives the span since construction (or the last reset);
    ``later.since(earlier)`` gives the calls between two such copies, which is how a canary
    compares a model's last minutes with another model's, without resetting either.
    """

    generation: int
    count: int
    errors: int
    deadline_misses: int
    sum_ns: int
    max_ns: int
    first_start_ns: int | None
    last_end_ns: int | None
    buckets: tuple[int, ...]

    @property
    def error_rate(self) -> float:
        calls = self.count + self.errors
        return self.errors / calls if calls else 0.0

    @property
    def throughput_per_s(self) -> float:
        if self.first_start_ns is None or self.last_end_ns is None:
            return 0.0
        span_ns = self.last_end_ns - self.first_start_ns
        return self.count * 1e9 / span_ns if span_ns > 0 else 0.0

    def percentile_ns(self, q: float) -> int:
        """The q-th percentile (0 < q <= 100) of the successful calls' latency."""
        return _percentiles_ns(self.buckets, (q,), self.max_ns)[0]

    def cumulative(self, bounds_ns: Sequence[int]) -> list[int]:
        """How many successful calls took at most each bound (ascending, below
        ``HISTOGRAM_LIMIT_NS``): Prometheus's cumulative buckets.  A fine bucket that straddles
        a bound counts above it, so no figure claims a call faster than it was."""
        running = list(accumulate(self.buckets))
        counts = []
        for bound in bounds_ns:
            index = _bucket_index(bound)
            low, width = _bucket_bounds(index)
            whole = index + 1 if low + width - 1 == bound else index
            counts.append(running[whole - 1] if whole else 0)
        return counts

    def since(self, earlier: Window) -> Window:
        """The calls recorded after ``earlier`` up to this window.

        Max is exact when the largest latency fell inside the span; otherwise it is the upper
        edge of the highest bucket the span touched (a histogram cannot subtract a max).
        """
        if earlier.generation != self.generation:
            raise ValueError("the statistics were reset between the two windows")
        buckets = tuple(map(sub, self.buckets, earlier.buckets))
        count = self.count - earlier.count
        if count == 0:
            max_ns = 0
        elif self.max_ns > earlier.max_ns:
            max_ns = self.max_ns
        else:
            top = max(i for i, n in enumerate(buckets) if n)
            low, width = _bucket_bounds(top)
            max_ns = min(low + width - 1, self.max_ns)
        return Window(
            generation=self.generation,
            count=count,
            errors=self.errors - earlier.errors,
            deadline_misses=self.deadline_misses - earlier.deadline_misses,
            sum_ns=self.sum_ns - earlier.sum_ns,
            max_ns=max_ns,
            first_start_ns=(earlier.last_end_ns if earlier.last_end_ns is not None
                            else self.first_start_ns),
            last_end_ns=self.last_end_ns,
            buckets=buckets,
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON form with the buckets sparse (index: count): how the data plane hands a
        version's window to the control plane, whose guards compare windows."""
        return {"generation": self.generation, "count": self.count, "errors": self.errors,
                "deadline_misses": self.deadline_misses, "sum_ns": self.sum_ns,
                "max_ns": self.max_ns, "first_start_ns": self.first_start_ns,
                "last_end_ns": self.last_end_ns,
                "buckets": {str(i): n for i, n in enumerate(self.buckets) if n}}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Window:
        """The window ``to_dict`` wrote; ValueError (or KeyError/TypeError) for anything
        else."""
        buckets = [0] * BUCKET_COUNT
        for index, count in data["buckets"].items():
            buckets[int(index)] = int(count)
        optional = [None if data[k] is None else int(data[k])
                    for k in ("first_start_ns", "last_end_ns")]
        return cls(generation=int(data["generation"]), count=int(data["count"]),
                   errors=int(data["errors"]), deadline_misses=int(data["deadline_misses"]),
                   sum_ns=int(data["sum_ns"]), max_ns=int(data["max_ns"]),
                   first_start_ns=optional[0], last_end_ns=optional[1],
                   buckets=tuple(buckets))

    def snapshot(self) -> dict[str, Any]:
        """The shape ``infer --json`` prints and telemetry carries as ``metrics.inference``;
        latencies are 0 with no successful call."""
        p50, p95, p99 = _percentiles_ns(self.buckets, _QUANTILES, self.max_ns)
        return {
            "count": self.count,
            "errors": self.errors,
            "deadline_misses": self.deadline_misses,
            "throughput_per_s": round(self.throughput_per_s, 3),
            "latency_ms": {
                "mean": _ms(self.sum_ns / self.count) if self.count else 0.0,
                "p50": _ms(p50),
                "p95": _ms(p95),
                "p99": _ms(p99),
                "max": _ms(self.max_ns),
            },
        }


class LatencyStats:
    """Statistics of one model's calls: histogram, counters and the call in progress.

    All timestamps are one clock's integer nanoseconds: whatever the loop passes to
    ``call_started`` (``time.perf_counter_ns`` and ``time.monotonic_ns`` are the same clock on
    Linux).  Whether a run is stuck is the server's scheduler's business (a run past its
    deadline is cancelled there), not the statistics'.
    """

    __slots__ = (
        "_buckets",
        "_count",
        "_deadline_misses",
        "_errors",
        "_first_start_ns",
        "_generation",
        "_last_end_ns",
        "_max_ns",
        "_started_ns",
        "_sum_ns",
    )

    def __init__(self) -> None:
        self._buckets = [0] * BUCKET_COUNT
        self._generation = 0
        self._started_ns: int | None = None
        self._zero()

    def _zero(self) -> None:
        self._buckets[:] = [0] * BUCKET_COUNT  # in place: the list keeps its one allocation
        self._count = 0
        self._errors = 0
        self._deadline_misses = 0
        self._sum_ns = 0
        self._max_ns = 0
        self._first_start_ns: int | None = None
        self._last_end_ns: int | None = None

    def reset(self) -> None:
        """Forget every recorded call.  Call it only while no call is being recorded on this
        object (from the loop thread, or before the model goes live); windows taken before
        cannot be compared with windows taken after."""
        self._zero()
        self._generation += 1

    def call_started(self, t_ns: int) -> None:
        """Mark a call in progress; ``record`` closes it.  One atomic attribute store."""
        self._started_ns = t_ns

    def record(self, latency_ns: int, ok: bool = True) -> None:
        """Close the call opened by ``call_started``: it ended at start + latency."""
        start = self._started_ns
        if start is None:
            raise RuntimeError("LatencyStats.record() without a preceding call_started()")
        if 0 <= latency_ns < HISTOGRAM_LIMIT_NS:  # bucket index, inlined: a call adds ~60 ns
            shift = _SHIFT_FOR_BIT_LENGTH[latency_ns.bit_length()]
            index = (shift << _SUB_BITS) + (latency_ns >> shift)
        elif latency_ns < 0:
            raise ValueError(f"negative latency {latency_ns} ns: start and end from two clocks?")
        else:
            index = BUCKET_COUNT - 1
        self._started_ns = None
        self._last_end_ns = start + latency_ns
        if self._first_start_ns is None:
            self._first_start_ns = start
        if not ok:
            self._errors += 1
            return
        self._buckets[index] += 1
        self._count += 1
        self._sum_ns += latency_ns
        if latency_ns > self._max_ns:
            self._max_ns = latency_ns

    def deadline_missed(self) -> None:
        """Count a call that finished after its period's deadline (the loop knows the period)."""
        self._deadline_misses += 1

    def window(self) -> Window:
        """A copy of the counters since construction or the last reset."""
        return Window(
            generation=self._generation,
            count=self._count,
            errors=self._errors,
            deadline_misses=self._deadline_misses,
            sum_ns=self._sum_ns,
            max_ns=self._max_ns,
            first_start_ns=self._first_start_ns,
            last_end_ns=self._last_end_ns,
            buckets=tuple(self._buckets),  # one C-level copy: atomic under the GIL
        )

    def snapshot(self) -> dict[str, Any]:
        """``{count, errors, deadline_misses, throughput_per_s, latency_ms: {...}}``."""
        return self.window().snapshot()
