"""The data plane's memory budget: admission before the work, refusal at once, release."""

from __future__ import annotations

import threading

import pytest

from agent.serving.budget import MB, MemoryBudget, default_limit_bytes
from agent.serving.errors import ServeError


def test_a_reservation_that_does_not_fit_is_refused_with_503_and_changes_nothing() -> None:
    budget = MemoryBudget(10 * MB)
    held = budget.reserve(8 * MB, "a body")
    with pytest.raises(ServeError) as refused:
        budget.reserve(3 * MB, "another body")
    assert refused.value.code == "RESOURCE_EXHAUSTED"
    assert refused.value.http_status == 503
    assert "another body" in refused.value.message
    assert "max_inflight_mb 10 MB" in refused.value.message
    assert budget.snapshot() == {"limit_bytes": 10 * MB, "in_use_bytes": 8 * MB,
                                 "peak_bytes": 8 * MB, "refused": 1}
    held.release()
    with budget.reserve(10 * MB, "the whole budget"):
        assert budget.in_use == 10 * MB
    assert budget.in_use == 0 and budget.peak == 10 * MB


def test_grow_refuses_but_keeps_what_was_held_and_count_never_refuses() -> None:
    budget = MemoryBudget(4 * MB)
    with budget.reserve(3 * MB, "a body") as reservation:
        with pytest.raises(ServeError):
            reservation.grow(2 * MB, "its decoded tensors")
        assert reservation.held == 3 * MB
        reservation.count(5 * MB)  # outputs that exist already
        assert budget.in_use == 8 * MB and budget.peak == 8 * MB
    assert budget.in_use == 0
    reservation.release()  # twice: nothing more is given back
    assert budget.in_use == 0


def test_threads_never_take_more_than_the_limit() -> None:
    budget = MemoryBudget(100)
    admitted: list[int] = []
    seen_peak: list[int] = []
    start = threading.Barrier(8)

    def take() -> None:
        start.wait()
        for _ in range(2000):
            try:
                reservation = budget.reserve(30, "a request")
            except ServeError:
                continue
            seen_peak.append(budget.in_use)
            admitted.append(1)
            reservation.release()

    threads = [threading.Thread(target=take) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert admitted and max(seen_peak) <= 90 and budget.peak <= 90 and budget.in_use == 0


@pytest.mark.parametrize(("memory", "request_bytes", "expected"), [
    (4 << 30, 64 * MB, 512 * MB),       # a 4 GB board: an eighth
    (64 << 30, 64 * MB, 1 << 30),       # a big box: capped
    (1 << 30, 64 * MB, 256 * MB),       # a small one: four of the largest requests
    (None, 64 * MB, 512 * MB),          # memory unknown: taken as 4 GB
])
def test_the_default_follows_the_device(memory: int | None, request_bytes: int,
                                        expected: int) -> None:
    assert default_limit_bytes(memory, request_bytes) == expected
