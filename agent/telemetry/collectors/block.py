"""Disk throughput and utilisation from /proc/diskstats, for the disks discovery listed.

Sectors in diskstats are always 512 bytes; utilisation is the share of the interval the
device had I/O in flight (``io_ticks``), as iostat's %util.
"""

from __future__ import annotations

import time
from typing import Any

from agent.discovery.block import SECTOR_BYTES
from agent.discovery.model import Topology
from agent.kernel.counters import DiskCounters, parse_diskstats
from agent.kernel.reader import SysReader
from agent.telemetry.collectors.base import Clock, Interval, percent, rate


class BlockCollector:
    key = "block"

    def __init__(self, reader: SysReader, topology: Topology,
                 clock: Clock = time.monotonic) -> None:
        self._reader = reader
        self._interval = Interval(clock)
        self._disks = [device.name for device in topology.block]
        self._previous: dict[str, DiskCounters] = {}

    def collect(self) -> list[dict[str, Any]]:
        seconds = self._interval.elapsed()
        stats = self._reader.parsed("/proc/diskstats", parse_diskstats) or {}
        previous, self._previous = self._previous, stats
        rows: list[dict[str, Any]] = []
        for name in self._disks:
            now, before = stats.get(name), previous.get(name)
            if now is None or before is None or seconds is None:
                rows.append({"name": name, "read_bytes_per_s": None,
                             "write_bytes_per_s": None, "util_pct": None})
                continue
            busy_ms = now.io_ticks_ms - before.io_ticks_ms
            rows.append({
                "name": name,
                "read_bytes_per_s": rate(before.read_sectors, now.read_sectors, seconds,
                                         SECTOR_BYTES),
                "write_bytes_per_s": rate(before.write_sectors, now.write_sectors, seconds,
                                          SECTOR_BYTES),
                "util_pct": percent(busy_ms, seconds * 1000) if busy_ms >= 0 else None})
        return rows
