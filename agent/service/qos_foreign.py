"""The cores busy outside the agent and its data plane over each QoS window: the load of
co-located apps (and of a VM's neighbours, whose steal time counts as busy), which the
controller reads to tell when the load its steps met has gone (agent.control.qos).

The whole machine's busy time less this process's and the data plane's CPU time
(telemetry.cpu_time), over the wall time between two readings."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import NamedTuple

import psutil

from agent.telemetry.cpu_time import machine_busy_s, process_cpu_s


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
