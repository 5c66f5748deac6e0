"""The cores busy outside the agent and its data plane, as the QoS loop reads them each
window: the machine's busy time less both processes' CPU time, over the window's wall time;
nothing for a first window, a data plane restarted or a counter that cannot be read; and on
the real counters, a process spinning beside them counts in full."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import psutil
import pytest

from agent.service.qos_foreign import ForeignLoad
from agent.telemetry.cpu_time import machine_busy_s, process_cpu_s

PLANE = 4242


def counters(*rows: tuple[float, float, float, float]) -> ForeignLoad:
    """(clock, machine busy, this process's CPU, the data plane's CPU) for each call."""
    readings: Iterator[tuple[float, float, float, float]] = iter(rows)
    now = {"row": rows[0]}

    def clock() -> float:
        now["row"] = next(readings)
        return now["row"][0]

    def cpu(pid: int) -> float:
        if now["row"][3] < 0:
            raise psutil.NoSuchProcess(pid)
        return now["row"][2] if pid == os.getpid() else now["row"][3]

    return ForeignLoad(busy=lambda: now["row"][1], cpu=cpu, clock=clock)


def test_the_machines_busy_time_less_ours_over_the_window() -> None:
    load = counters((0.0, 10.0, 1.0, 2.0), (2.0, 12.0, 1.2, 2.8), (3.0, 12.1, 1.5, 2.8))
    assert load(PLANE) is None  # the first window: nothing to compare with
    assert load(PLANE) == pytest.approx((2.0 - 0.2 - 0.8) / 2.0)
    assert load(PLANE) == 0.0  # ours took all of it (ticks round): never below nothing


def test_a_restarted_data_plane_or_one_gone_gives_no_figure_for_that_window() -> None:
    load = counters((0.0, 10.0, 1.0, 2.0), (1.0, 11.0, 1.0, 2.5), (2.0, 12.0, 1.0, 0.1),
                    (3.0, 13.0, 1.0, -1.0), (4.0, 14.0, 1.0, 0.2), (5.0, 14.5, 1.0, 0.3))
    assert load(PLANE) is None
    assert load(PLANE) == pytest.approx(0.5)
    assert load(PLANE + 1) is None  # another process: its counters started again
    assert load(PLANE + 1) is None  # gone: unreadable
    assert load(PLANE + 1) is None  # the first reading after it
    assert load(PLANE + 1) == pytest.approx(0.4)


def test_on_the_real_counters_a_process_spinning_beside_them_counts_in_full() -> None:
    """A stand-in data plane sleeps; another process spins: all of the spinner's CPU time
    in the window is outside (the machine's own ticks round to 10 ms)."""
    plane = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        clock = iter([0.0, 1.0])
        load = ForeignLoad(clock=lambda: next(clock))
        assert load(plane.pid) is None
        start = process_cpu_s(spinner.pid)
        while process_cpu_s(spinner.pid) - start < 0.5:
            time.sleep(0.02)  # polled: the condition is the spinner's own CPU time
        spun_before = process_cpu_s(spinner.pid) - start
        outside = load(plane.pid)  # cores over a "second": CPU seconds outside
        assert outside is not None and outside >= spun_before - 0.05
        assert machine_busy_s() > 0
    finally:
        for process in (plane, spinner):
            process.kill()
            process.wait()
