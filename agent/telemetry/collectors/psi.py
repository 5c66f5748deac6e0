"""Pressure stall information: the share of wall time tasks waited on CPU, memory or I/O.

The files are absent when the kernel has CONFIG_PSI off or ``psi=0`` (the RK3588 vendor
kernel): every value is then None.
"""

from __future__ import annotations

from typing import Any

from agent.kernel.parsers import parse_psi
from agent.kernel.reader import SysReader

# (metric key, resource file, line) in the order telemetry reports them
FIELDS = (("cpu_some_avg10", "cpu", "some"), ("memory_some_avg10", "memory", "some"),
          ("memory_full_avg10", "memory", "full"), ("io_some_avg10", "io", "some"),
          ("io_full_avg10", "io", "full"))


class PsiCollector:
    key = "psi"

    def __init__(self, reader: SysReader) -> None:
        self._reader = reader

    def collect(self) -> dict[str, Any]:
        pressure = {resource: self._reader.parsed(f"/proc/pressure/{resource}", parse_psi)
                    for resource in ("cpu", "memory", "io")}
        values = {}
        for key, resource, line in FIELDS:
            lines = pressure[resource] or {}
            values[key] = lines.get(line, {}).get("avg10")
        return values
