"""Memory and swap use from /proc/meminfo.

Each collector keeps only the lines it reports before handing them to discovery's meminfo
parser: parsing all ~55 lines would be the most expensive step of a whole sample.
"""

from __future__ import annotations

from typing import Any

from agent.kernel.parsers import parse_meminfo
from agent.kernel.reader import SysReader
from agent.telemetry.collectors.base import percent

MEMINFO = "/proc/meminfo"


def meminfo_fields(reader: SysReader, names: tuple[str, ...]) -> dict[str, int]:
    """The named /proc/meminfo fields in bytes; missing ones are absent from the result."""
    prefixes = tuple(f"{name}:" for name in names)
    return reader.parsed(MEMINFO, lambda text: parse_meminfo("\n".join(
        line for line in text.splitlines() if line.startswith(prefixes)))) or {}


class MemoryCollector:
    key = "memory"

    def __init__(self, reader: SysReader) -> None:
        self._reader = reader

    def collect(self) -> dict[str, Any]:
        meminfo = meminfo_fields(self._reader, ("MemTotal", "MemAvailable"))
        total, available = meminfo.get("MemTotal"), meminfo.get("MemAvailable")
        used_pct = percent(total - available, total) \
            if total is not None and available is not None else None
        return {"total_bytes": total, "available_bytes": available, "used_pct": used_pct}


class SwapCollector:
    key = "swap"

    def __init__(self, reader: SysReader) -> None:
        self._reader = reader

    def collect(self) -> dict[str, Any]:
        meminfo = meminfo_fields(self._reader, ("SwapTotal", "SwapFree"))
        total, free = meminfo.get("SwapTotal"), meminfo.get("SwapFree")
        return {"total_bytes": total,
                "used_bytes": total - free if total is not None and free is not None else None}
