"""CPU utilisation per core from /proc/stat deltas, frequency from each core's cpufreq policy.

Only online cores are reported: /proc/stat leaves offline ones out, so a core that nvpmodel
takes down disappears from the next sample, and the inactive policy of an offline cluster
(which answers EBUSY) is never read.
"""

from __future__ import annotations

from typing import Any

from agent.discovery.cpu import CPU
from agent.discovery.model import Topology
from agent.kernel.counters import CpuTicks, ProcStat, parse_proc_stat
from agent.kernel.reader import SysReader
from agent.telemetry.collectors.base import percent


def busy_percent(before: CpuTicks | None, after: CpuTicks) -> float | None:
    """Share of the jiffies between two readings that were not idle."""
    if before is None:
        return None
    return percent(after.busy - before.busy, after.total - before.total)


class CpuCollector:
    key = "cpu"

    def __init__(self, reader: SysReader, topology: Topology) -> None:
        self._reader = reader
        # cpu -> its policy's scaling_cur_freq; cores of one cluster share one read
        self._freq_file = {
            cpu: f"{CPU}/cpufreq/{cluster.policy}/scaling_cur_freq"
            for cluster in topology.cpu.clusters if cluster.policy for cpu in cluster.cpus}
        self._previous: ProcStat | None = None

    def collect(self) -> dict[str, Any]:
        stat = self._reader.parsed("/proc/stat", parse_proc_stat)
        if stat is None:
            return {"util_pct": None, "cores": []}
        previous, self._previous = self._previous, stat
        khz: dict[str, int | None] = {}
        cores = []
        for cpu, ticks in stat.cores.items():
            freq_file = self._freq_file.get(cpu)
            if freq_file is not None and freq_file not in khz:
                khz[freq_file] = self._reader.integer(freq_file)
            cores.append({
                "cpu": cpu,
                "util_pct": busy_percent(previous.cores.get(cpu) if previous else None, ticks),
                "freq_khz": khz[freq_file] if freq_file is not None else None})
        return {"util_pct": busy_percent(previous.total if previous else None, stat.total),
                "cores": cores}
