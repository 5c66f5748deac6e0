"""Pure parsers for the procfs and cgroup formats telemetry samples: text in, typed value out,
ValueError on garbage.

Formats discovery or tuning read too (meminfo, ``[selected]`` lists, Mali and rknpu ``load``,
plain integers, PSI, ``memory.events``) are parsed by :mod:`agent.kernel.parsers`.
"""

from __future__ import annotations

import re
from typing import NamedTuple


class CpuTicks(NamedTuple):
    busy: int  # jiffies not idle (steal and irq time count as busy)
    total: int


class ProcStat(NamedTuple):
    total: CpuTicks
    cores: dict[int, CpuTicks]  # online CPUs only: /proc/stat leaves offline ones out


def _ticks(fields: list[str]) -> CpuTicks:
    """user nice system idle [iowait irq softirq steal [guest guest_nice]]; guest time is
    already inside user/nice, so only the first eight columns add up to the total."""
    if len(fields) < 4:
        raise ValueError(f"a /proc/stat cpu line needs at least 4 columns: {fields}")
    values = [int(field) for field in fields[:8]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # iowait is idle time
    total = sum(values)
    return CpuTicks(busy=total - idle, total=total)


def parse_proc_stat(text: str) -> ProcStat:
    """The ``cpu`` and ``cpuN`` lines of /proc/stat (they come first; the rest is skipped)."""
    total: CpuTicks | None = None
    cores: dict[int, CpuTicks] = {}
    for line in text.splitlines():
        if not line.startswith("cpu"):
            break
        name, *fields = line.split()
        if name == "cpu":
            total = _ticks(fields)
        elif name[3:].isdigit():
            cores[int(name[3:])] = _ticks(fields)
        else:
            raise ValueError(f"not a /proc/stat cpu line: {line[:60]!r}")
    if total is None:
        raise ValueError("no 'cpu' line in /proc/stat")
    return ProcStat(total, cores)


class LoadAvg(NamedTuple):
    avg1: float
    avg5: float
    avg15: float
    running: int  # runnable threads
    total: int  # all threads


def parse_loadavg(text: str) -> LoadAvg:
    """``"0.52 0.58 0.59 2/1017 12345"`` -> averages and runnable/total threads."""
    fields = text.split()
    if len(fields) != 5 or "/" not in fields[3]:
        raise ValueError(f"not a /proc/loadavg line: {text.strip()[:60]!r}")
    running, _, total = fields[3].partition("/")
    return LoadAvg(float(fields[0]), float(fields[1]), float(fields[2]), int(running),
                   int(total))


def parse_cgroup_path(text: str) -> str:
    """/proc/self/cgroup -> the cgroup v2 path of the ``0::`` line (v1 lines are ignored)."""
    for line in text.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, sep, path = rest.partition(":")
        if hierarchy == "0" and sep and not controllers and path.startswith("/"):
            return path
    raise ValueError("no cgroup v2 ('0::') line in /proc/self/cgroup")


def parse_cgroup_limit(text: str) -> int | None:
    """``memory.max`` / ``memory.high``: bytes, or None for ``max`` (no limit)."""
    value = text.strip()
    return None if value == "max" else int(value)


class DiskCounters(NamedTuple):
    read_sectors: int  # 512-byte sectors, whatever the device's block size
    write_sectors: int
    io_ticks_ms: int  # time the device had I/O in flight


def parse_diskstats(text: str) -> dict[str, DiskCounters]:
    """/proc/diskstats -> {device name: counters}; lines have 11, 15 or 17 counters."""
    disks: dict[str, DiskCounters] = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 14:
            raise ValueError(f"a diskstats line needs 14 fields: {line.strip()[:60]!r}")
        disks[fields[2]] = DiskCounters(int(fields[5]), int(fields[9]), int(fields[12]))
    return disks


class NetCounters(NamedTuple):
    rx_bytes: int
    tx_bytes: int
    rx_errors: int
    tx_errors: int


def parse_net_dev(text: str) -> dict[str, NetCounters]:
    """/proc/net/dev -> {interface: counters}, after the two header lines."""
    interfaces: dict[str, NetCounters] = {}
    for line in text.splitlines()[2:]:
        name, sep, counters = line.partition(":")
        fields = counters.split()
        if not sep or len(fields) != 16:
            raise ValueError(f"not a /proc/net/dev line: {line.strip()[:60]!r}")
        interfaces[name.strip()] = NetCounters(int(fields[0]), int(fields[8]), int(fields[2]),
                                               int(fields[10]))
    return interfaces


_THP_COUNTER = re.compile(r"^(thp_\w+) (\d+)$", re.MULTILINE)


def parse_thp_counters(text: str) -> dict[str, int]:
    """Every ``thp_*`` line of /proc/vmstat (which ones exist depends on the kernel)."""
    return {name: int(value) for name, value in _THP_COUNTER.findall(text)}
