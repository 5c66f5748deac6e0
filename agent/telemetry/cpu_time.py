"""CPU seconds from psutil's counters: the whole machine's busy time and one process's.
What the QoS loop (the cores busy outside the agent) and model tune (a candidate's CPU per
second of load) subtract between two readings.  The processes running here, whatever
``--root`` the device's files are read under."""

from __future__ import annotations

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
