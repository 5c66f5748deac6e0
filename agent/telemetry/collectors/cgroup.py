"""The agent's own cgroup: memory use, limits and how often they were hit.

The cgroup is read from /proc/self/cgroup on every sample, since tuning may move the agent
into another cgroup while it runs; an explicit path overrides it.  Only a unified (v2)
hierarchy has these files: on v1 and hybrid systems every value is None.  With the data
plane's cgroup (where its limits are: the systemd slice or its leaf) the same figures for it
are under ``data_plane``; its ``events`` count every data-plane process since boot.
"""

from __future__ import annotations

from typing import Any

from agent.discovery.kernel import CGROUP
from agent.discovery.model import Topology
from agent.kernel.counters import parse_cgroup_limit, parse_cgroup_path
from agent.kernel.parsers import parse_memory_events
from agent.kernel.reader import SysReader

EVENTS = ("low", "high", "max", "oom", "oom_kill")


class CgroupCollector:
    key = "cgroup"

    def __init__(self, reader: SysReader, topology: Topology, path: str | None = None,
                 data_plane: str | None = None) -> None:
        """``path`` is relative to the cgroup root, as /proc/self/cgroup writes it
        (``/system.slice/edge-agent.service``); ``data_plane`` is a directory below
        /sys/fs/cgroup."""
        self._reader = reader
        self._v2 = topology.kernel.cgroup_mode == "v2"
        self._path = "/" + path.strip("/") if path is not None else None
        self._data_plane = data_plane

    def collect(self) -> dict[str, Any]:
        path = self._path or self._reader.parsed("/proc/self/cgroup", parse_cgroup_path)
        values = self._figures(path)
        if self._data_plane is not None:
            values["data_plane"] = self._figures(self._data_plane.removeprefix(CGROUP) or "/")
        return values

    def _figures(self, path: str | None) -> dict[str, Any]:
        values: dict[str, Any] = {
            "path": path, "memory_current_bytes": None, "memory_max_bytes": None,
            "memory_high_bytes": None, "events": dict.fromkeys(EVENTS)}
        if path is None or not self._v2:
            return values
        directory = CGROUP + path.rstrip("/")
        values["memory_current_bytes"] = self._reader.integer(f"{directory}/memory.current")
        values["memory_max_bytes"] = self._reader.parsed(f"{directory}/memory.max",
                                                         parse_cgroup_limit)
        values["memory_high_bytes"] = self._reader.parsed(f"{directory}/memory.high",
                                                          parse_cgroup_limit)
        events = self._reader.parsed(f"{directory}/memory.events", parse_memory_events) or {}
        values["events"] = {name: events.get(name) for name in EVENTS}
        return values
