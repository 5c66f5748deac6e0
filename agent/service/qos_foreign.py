"""The cores busy outside the agent and its data plane over each QoS window: the load of
co-located apps (and of a VM's neighbours, whose steal time counts as busy), which the
controller reads to tell when the load its steps met has gone (agent.control.qos).

psutil's counters: the whole machine's busy time less this process's and the data plane's
CPU time, over the wall time between two readings.  The whole of both, not of one root's
/proc: these are the processes running here, whatever ``--root`` the device's files are read
under."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import NamedTuple

import psutil


def machine_busy_s() -> float:
    """CPU seconds every CPU spent not idle since boot (guest time is inside user's)."""
    t = psutil.cpu_times()
    return float(t.user + t.nice + t.system + getattr(t, "irq", 0.0)
                 + getattr(t, "softirq", 0.0) + getattr(t, "steal", 0.0))


def process_cpu_s(pid: int) -> float:
    """A process's CPU seconds so far, its threads included (psutil.Error if it is gone)."""
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


class Reading(NamedTuple):
    at: float
    busy_s: float
    ours_s: float
    plane: int


class ForeignLoad:
    """Called once a window with the data plane's pid: the cores busy outside both
    processes since the last call; None for the first window, the first after the data
    plane restarted (its counters start again), or when a counter cannot be read."""

    def __init__(self, busy: Callable[[], float] = machine_busy_s,
                 cpu: Callable[[int], float] = process_cpu_s,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._busy, self._cpu, self._clock = busy, cpu, clock
        self._last: Reading | None = None

    def __call__(self, plane: int) -> float | None:
        try:
            now = Reading(self._clock(), self._busy(),
                          self._cpu(os.getpid()) + self._cpu(plane), plane)
        except (psutil.Error, OSError):
            self._last = None
            return None
        last, self._last = self._last, now
        if last is None or last.plane != plane or now.at <= last.at:
            return None
        outside = (now.busy_s - last.busy_s) - (now.ours_s - last.ours_s)
        return max(0.0, outside / (now.at - last.at))
