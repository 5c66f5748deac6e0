"""Symbolic profile values resolved against the discovered topology.

``min``/``max`` and ``~N`` (nearest available step) for frequencies, cluster selectors for
CPU sets, and sizes with K/M/G suffixes or percentages for cgroup limits (the kernel files
take bytes, never percentages).
"""

from __future__ import annotations

import re

from agent.discovery.model import Topology
from agent.kernel.parsers import format_cpulist, parse_cpulist

CORE_TYPES = ("big", "mid", "little")
HOUSEKEEPING = "housekeeping"  # the plan's housekeeping CPUs (rt.housekeeping_cpus)
MAX_BYTES = 2**63  # the kernel's page-counter limit, far above any device
SIZE_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?$", re.IGNORECASE)
_PERCENT = re.compile(r"^(\d+(?:\.\d+)?)\s*%$")


def is_cpu_selector(value: object) -> bool:
    if not isinstance(value, str):
        return False
    if value in ("all", HOUSEKEEPING) or value.startswith("cluster:"):
        return value in ("all", HOUSEKEEPING) or value.removeprefix("cluster:") in CORE_TYPES
    try:
        parse_cpulist(value.removeprefix("cpus:"))  # bounded: ids above MAX_CPU_ID refused
    except ValueError:
        return False
    return True


def default_housekeeping(topology: Topology) -> list[int]:
    """The CPUs kept for the kernel's own work when a profile names none: the lowest-capacity
    cores among the online CPUs that isolcpus left to the kernel, or the first of them where
    every core is alike (CPU 0 on a uniform SoC).  Empty only when no CPU is known online."""
    online = set(topology.cpu.online) - set(topology.cpu.isolated) or set(topology.cpu.online)
    ranked = {cpu: CORE_TYPES.index(cluster.core_type) for cluster in topology.cpu.clusters
              if cluster.core_type in CORE_TYPES for cpu in cluster.cpus if cpu in online}
    if len(ranked) == len(online) and len(set(ranked.values())) > 1:
        lowest = max(ranked.values())
        return sorted(cpu for cpu, rank in ranked.items() if rank == lowest)
    return sorted(online)[:1]


def resolve_cpus(selector: str, topology: Topology,
                 housekeeping: list[int] | None = None) -> list[int]:
    """``cluster:big`` / ``cpus:4-7`` / ``4-7`` / ``all`` / ``housekeeping`` -> CPU ids;
    absent CPUs are errors.

    On a board whose cores are all alike, ``cluster:big`` and ``cluster:little`` name every
    CPU, so a profile written for big.LITTLE still applies.  ``housekeeping`` is the plan's
    housekeeping set (``default_housekeeping`` when none is given).
    """
    present = sorted(c for cluster in topology.cpu.clusters for c in cluster.cpus)
    if selector == "all":
        return present
    if selector == HOUSEKEEPING:
        cpus = default_housekeeping(topology) if housekeeping is None else housekeeping
        if not cpus:
            raise ValueError("housekeeping names no CPUs here (no online CPU is known)")
        return cpus
    if selector.startswith("cluster:"):
        kind = selector.removeprefix("cluster:")
        types = {c.core_type for c in topology.cpu.clusters}
        if types <= {"uniform", None}:
            return present
        cpus = sorted(c for cl in topology.cpu.clusters if cl.core_type == kind for c in cl.cpus)
        if not cpus:
            raise ValueError(f"{selector} names no CPUs here (core types: "
                             f"{', '.join(sorted(t for t in types if t))})")
        return cpus
    cpus = parse_cpulist(selector.removeprefix("cpus:"))
    absent = sorted(set(cpus) - set(present))
    if absent or not cpus:
        raise ValueError(f"{selector} names CPUs this device does not have: "
                         f"{format_cpulist(absent) or 'none given'} (present: "
                         f"{format_cpulist(present)})")
    return cpus


def resolve_frequency(value: int | str, available: list[int] | None, low: int | None,
                      high: int | None, unit: str) -> int:
    """``min``/``max``, an exact offered step, or ``~N`` snapped to the nearest step."""
    steps = sorted(available) if available else [v for v in (low, high) if v is not None]
    if not steps:
        raise ValueError("the device reports no frequency range")
    if value == "min":
        return steps[0]
    if value == "max":
        return steps[-1]
    if isinstance(value, str) and value.startswith("~"):
        target = int(value[1:])
        return min(steps, key=lambda step: (abs(step - target), step))
    wanted = int(value)
    if available and wanted not in available:
        raise ValueError(f"{wanted} is not offered (available {unit}: "
                         f"{' '.join(map(str, steps))}; use ~{wanted} for the nearest)")
    if not available and not (steps[0] <= wanted <= steps[-1]):
        raise ValueError(f"{wanted} is outside {steps[0]}..{steps[-1]} {unit}")
    return wanted


def is_size(value: object) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return value >= 0
    return isinstance(value, str) and (value == "max" or bool(_SIZE.match(value))
                                       or bool(_PERCENT.match(value)))


def resolve_size(value: int | str, of_bytes: int | None, page: int = 4096) -> str:
    """A cgroup limit as the kernel file takes it: bytes, or ``max``; a percentage is rounded
    down to whole ``page``-byte pages (agent.kernel.pages)."""
    if isinstance(value, int):
        return str(value)
    if value == "max":
        return "max"
    percent = _PERCENT.match(value)
    if percent:
        if float(percent.group(1)) > 100:
            raise ValueError(f"{value[:40]} is more than 100 %")
        if of_bytes is None:
            raise ValueError(f"{value}: the total to take a percentage of is unknown")
        return str(int(of_bytes * float(percent.group(1)) / 100) // page * page)
    size = _SIZE.match(value)
    if size is None:
        raise ValueError(f"{value[:40]!r} is not a size (bytes, K/M/G suffix, N% or max)")
    amount = float(size.group(1)) * SIZE_UNITS[size.group(2).upper()]
    if not amount < MAX_BYTES:
        raise ValueError(f"{value[:40]!r} is larger than any memory (use max for no limit)")
    return str(int(amount))
