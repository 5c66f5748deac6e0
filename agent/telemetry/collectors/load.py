"""Load averages and thread counts from /proc/loadavg."""

from __future__ import annotations

from typing import Any

from agent.kernel.counters import parse_loadavg
from agent.kernel.reader import SysReader


class LoadCollector:
    key = "load"

    def __init__(self, reader: SysReader) -> None:
        self._reader = reader

    def collect(self) -> dict[str, Any]:
        load = self._reader.parsed("/proc/loadavg", parse_loadavg)
        if load is None:
            return dict.fromkeys(("avg1", "avg5", "avg15", "running", "total"))
        return load._asdict()
