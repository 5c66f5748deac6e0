"""model tune's open loop: the requests waiting for a client stay bounded, whatever the
rate asked for (``--rate 1e9`` once queued hundreds of millions of due times: gigabytes and
minutes before the first measurement ended)."""

from __future__ import annotations

import time
from queue import SimpleQueue

import pytest

from agent.modeltune import load


class Counted(SimpleQueue[float]):
    """A SimpleQueue that keeps the most it ever held."""

    most = 0

    def put(self, item: float, block: bool = True, timeout: float | None = None) -> None:
        super().put(item, block, timeout)
        Counted.most = max(Counted.most, self.qsize())


def test_an_open_loop_far_above_what_is_answered_queues_no_more_than_its_backlog(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(load, "MAX_BACKLOG", 200)
    monkeypatch.setattr(load, "SimpleQueue", Counted)
    answered = []

    def call(index: int) -> None:
        time.sleep(0.002)
        answered.append(index)

    sample = load.open_loop(call, 1e6, 0.3, 2)
    assert Counted.most <= 200 + 2  # the backlog, and the two stops
    assert len(sample.latencies) == len(answered) > 0
    # every request that fell due (but in the last tick) was answered or counted as failed
    assert len(sample.latencies) + sample.errors >= 0.99 * 0.3 * 1e6
    assert sample.first_error == "not sent: 200 requests were already waiting"


def test_an_open_loop_the_data_plane_keeps_up_with_fails_nothing() -> None:
    sample = load.open_loop(lambda index: None, 200, 0.5, 2)
    assert sample.errors == 0
    assert len(sample.latencies) >= 0.5 * 200
