"""LatencyStats: percentiles against numpy, exact counters, fixed memory, windows, and
concurrent readers."""

from __future__ import annotations

import threading
import tracemalloc
from collections.abc import Iterable

import numpy as np
import pytest

from agent.inference.stats import BUCKET_COUNT, HISTOGRAM_LIMIT_NS, LatencyStats

MS = 1_000_000
S = 1_000_000_000
# A percentile is its bucket's midpoint: within half a bucket (1/128 of the value) of the
# sample, plus the 1 ns the snapshot's 6-decimal milliseconds may round away.
REL_ERROR = 1 / 128


def _recorded(latencies: Iterable[int], start_ns: int = 0, period_ns: int = 0) -> LatencyStats:
    stats = LatencyStats()
    t = start_ns
    for latency in latencies:
        stats.call_started(t)
        stats.record(latency)
        t += period_ns or latency
    return stats


def _distributions() -> dict[str, np.ndarray]:
    rng = np.random.RandomState(7)
    n = 50_000
    bimodal = np.concatenate([rng.normal(2 * MS, 0.1 * MS, int(n * 0.9)),
                              rng.normal(40 * MS, 2 * MS, n // 10)])
    rng.shuffle(bimodal)
    return {
        "lognormal": np.exp(rng.normal(np.log(5 * MS), 0.5, n)),
        "bimodal": bimodal,
        "constant": np.full(n, 1_234_567.0),
        "wide_2us_5s": np.exp(rng.uniform(np.log(2_000), np.log(5 * S), n)),
    }


DISTRIBUTIONS = _distributions()


@pytest.mark.parametrize("name", sorted(DISTRIBUTIONS))
def test_percentiles_match_numpy_within_the_histogram_error(name: str) -> None:
    values = DISTRIBUTIONS[name].astype(np.int64)
    snap = _recorded(int(v) for v in values).snapshot()
    for q, key in ((50, "p50"), (95, "p95"), (99, "p99")):
        # The histogram reports the ceil(q% * n)-th smallest sample: numpy's inverted_cdf.
        expected_ns = float(np.percentile(values, q, method="inverted_cdf"))
        got_ns = snap["latency_ms"][key] * MS
        assert abs(got_ns - expected_ns) <= expected_ns * REL_ERROR + 1, (key, got_ns,
                                                                           expected_ns)


@pytest.mark.parametrize("name", sorted(DISTRIBUTIONS))
def test_mean_and_max_are_exact(name: str) -> None:
    values = DISTRIBUTIONS[name].astype(np.int64)
    stats = _recorded(int(v) for v in values)
    window = stats.window()
    assert window.sum_ns == int(values.sum())
    assert window.max_ns == int(values.max())
    snap = stats.snapshot()
    assert snap["latency_ms"]["mean"] == pytest.approx(values.sum() / len(values) / MS, abs=1e-6)
    assert snap["latency_ms"]["max"] == pytest.approx(values.max() / MS, abs=1e-6)


def test_counters_and_contract_shape() -> None:
    stats = LatencyStats()
    for i in range(100):
        stats.call_started(i * 10 * MS)
        # A failed call's latency (here huge) stays out of the latency statistics.
        stats.record(2 * MS if i % 10 else 5 * S, ok=bool(i % 10))
    for _ in range(3):
        stats.deadline_missed()
    snap = stats.snapshot()
    assert set(snap) == {"count", "errors", "deadline_misses", "throughput_per_s", "latency_ms"}
    assert set(snap["latency_ms"]) == {"mean", "p50", "p95", "p99", "max"}
    assert (snap["count"], snap["errors"], snap["deadline_misses"]) == (90, 10, 3)
    assert snap["latency_ms"]["max"] == 2.0
    assert snap["latency_ms"]["mean"] == 2.0
    assert stats.window().error_rate == pytest.approx(0.1)


def test_throughput_spans_first_start_to_last_end() -> None:
    # 100 calls of 2 ms, one every 10 ms from t=1 s: the last ends at 1 s + 992 ms.
    stats = _recorded([2 * MS] * 100, start_ns=1 * S, period_ns=10 * MS)
    assert stats.snapshot()["throughput_per_s"] == pytest.approx(100 / 0.992, rel=1e-4)


def test_empty_statistics_report_zeros() -> None:
    snap = LatencyStats().snapshot()
    assert snap["count"] == 0
    assert snap["throughput_per_s"] == 0.0
    assert snap["latency_ms"] == {"mean": 0.0, "p50": 0.0, "p95": 0.0, "p99": 0.0, "max": 0.0}


def test_latency_beyond_the_histogram_saturates_but_max_stays_exact() -> None:
    huge = HISTOGRAM_LIMIT_NS * 3
    stats = _recorded([1 * MS, huge])
    window = stats.window()
    assert window.max_ns == huge
    assert window.sum_ns == 1 * MS + huge
    assert window.percentile_ns(100) >= HISTOGRAM_LIMIT_NS * (1 - REL_ERROR)


def test_misuse_is_loud() -> None:
    stats = LatencyStats()
    with pytest.raises(RuntimeError, match="call_started"):
        stats.record(1 * MS)
    stats.call_started(0)
    with pytest.raises(ValueError, match="negative latency"):
        stats.record(-5)
    assert stats.window().last_end_ns is None  # nothing was half-recorded
    stats.record(1 * MS)
    assert stats.snapshot()["count"] == 1


def test_memory_is_fixed_however_many_calls() -> None:
    rng = np.random.RandomState(3)
    latencies = [int(v) for v in np.exp(rng.uniform(0, np.log(10 * S), 50_000))]

    def record_all() -> None:
        for latency in latencies:
            stats.call_started(0)
            stats.record(latency)

    stats = LatencyStats()
    for _ in range(20):  # 1e6 calls
        record_all()
    assert len(stats.window().buckets) == BUCKET_COUNT
    tracemalloc.start()
    try:
        record_all()  # the counts it touches become traced objects
        before, _ = tracemalloc.get_traced_memory()
        record_all()
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # A count is an int replaced on each increment, so nothing accumulates; the few hundred
    # bytes seen come from counts outgrowing CPython's cached small ints (<= 256).  Any per-call
    # growth would be >= 8 bytes x 50,000 calls.
    assert after - before < 4096
    assert stats.snapshot()["count"] == 22 * len(latencies)


def test_window_since_a_mark_holds_only_the_later_calls() -> None:
    stats = _recorded([1 * MS] * 1000, period_ns=1 * MS)
    mark = stats.window()
    t = mark.last_end_ns
    assert t is not None
    for i in range(1000):
        stats.call_started(t)
        stats.record(5 * MS, ok=i % 100 != 0)
        t += 5 * MS
    recent = stats.window().since(mark)
    assert (recent.count, recent.errors) == (990, 10)
    assert recent.error_rate == pytest.approx(0.01)
    assert recent.max_ns == 5 * MS
    assert recent.percentile_ns(99) == pytest.approx(5 * MS, rel=REL_ERROR)
    assert recent.snapshot()["latency_ms"]["mean"] == 5.0
    assert recent.throughput_per_s == pytest.approx(990 / 5.0)


def test_window_max_below_the_earlier_max_is_the_bucket_edge() -> None:
    stats = _recorded([9 * MS, 3 * MS])
    mark = stats.window()
    stats.call_started(0)
    stats.record(3_300_000)
    recent = stats.window().since(mark)
    assert 3_300_000 <= recent.max_ns <= 3_300_000 * (1 + 2 * REL_ERROR)


def test_reset_forgets_and_separates_windows() -> None:
    stats = _recorded([1 * MS] * 10)
    mark = stats.window()
    stats.reset()
    assert stats.snapshot()["count"] == 0
    assert stats.snapshot()["latency_ms"]["max"] == 0.0
    stats.call_started(0)
    stats.record(2 * MS)
    assert stats.snapshot()["latency_ms"]["max"] == 2.0
    with pytest.raises(ValueError, match="reset"):
        stats.window().since(mark)


def test_concurrent_readers_see_consistent_growing_totals() -> None:
    stats = LatencyStats()
    calls = 200_000
    done = threading.Event()
    failures: list[BaseException] = []

    def record() -> None:
        try:
            for i in range(calls):
                stats.call_started(i * 1000)
                stats.record(500 + i % 997, ok=i % 50 != 0)
        except BaseException as error:  # pragma: no cover - reported below
            failures.append(error)
        finally:
            done.set()

    def read() -> None:
        seen = 0
        try:
            while not done.is_set():
                snap = stats.snapshot()
                assert snap["count"] + snap["errors"] >= seen
                if snap["count"]:  # recorded latencies are 500..1496 ns
                    assert 0.000496 <= snap["latency_ms"]["p50"] <= 0.0015
                seen = snap["count"] + snap["errors"]
        except BaseException as error:
            failures.append(error)

    threads = [threading.Thread(target=record), threading.Thread(target=read)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not failures
    final = stats.window()
    assert (final.count, final.errors) == (calls - calls // 50, calls // 50)
    assert sum(final.buckets) == final.count
