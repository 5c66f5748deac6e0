"""Network throughput and error counters from /proc/net/dev, loopback left out.

Interfaces are taken from each sample, not from discovery: they come and go (USB gadgets,
container veths), and one seen for the first time has no rates yet.
"""

from __future__ import annotations

import time
from typing import Any

from agent.kernel.counters import NetCounters, parse_net_dev
from agent.kernel.reader import SysReader
from agent.telemetry.collectors.base import Clock, Interval, rate


class NetCollector:
    key = "net"

    def __init__(self, reader: SysReader, clock: Clock = time.monotonic) -> None:
        self._reader = reader
        self._interval = Interval(clock)
        self._previous: dict[str, NetCounters] = {}

    def collect(self) -> list[dict[str, Any]]:
        seconds = self._interval.elapsed()
        interfaces = self._reader.parsed("/proc/net/dev", parse_net_dev) or {}
        previous, self._previous = self._previous, interfaces
        rows: list[dict[str, Any]] = []
        for name, now in interfaces.items():
            if name == "lo":
                continue
            before = previous.get(name)
            rows.append({
                "name": name,
                "rx_bytes_per_s": rate(before.rx_bytes if before else None, now.rx_bytes,
                                       seconds),
                "tx_bytes_per_s": rate(before.tx_bytes if before else None, now.tx_bytes,
                                       seconds),
                "rx_errors": now.rx_errors, "tx_errors": now.tx_errors})
        return rows
