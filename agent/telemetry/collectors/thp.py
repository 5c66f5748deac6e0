"""Transparent huge pages: the current mode (the dynamic THP controller switches it) and the
``thp_*`` event counters of /proc/vmstat."""

from __future__ import annotations

from typing import Any

from agent.discovery.kernel import THP
from agent.kernel.counters import parse_thp_counters
from agent.kernel.parsers import parse_selection
from agent.kernel.reader import SysReader


class ThpCollector:
    key = "thp"

    def __init__(self, reader: SysReader) -> None:
        self._reader = reader

    def _selected(self, name: str) -> str | None:
        selection = self._reader.parsed(f"{THP}/{name}", parse_selection)
        return selection[0] if selection else None

    def collect(self) -> dict[str, Any]:
        return {"enabled": self._selected("enabled"), "defrag": self._selected("defrag"),
                "counters": self._reader.parsed("/proc/vmstat", parse_thp_counters) or {}}
