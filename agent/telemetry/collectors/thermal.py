"""Thermal zone temperatures, for the zones discovery kept (PMIC dies are left out)."""

from __future__ import annotations

from typing import Any

from agent.discovery.model import Topology
from agent.discovery.thermal import POWERED_DOWN_ERRNOS, POWERED_DOWN_MC, THERMAL
from agent.kernel.reader import SysReader
from agent.telemetry.collectors.base import resolved


def millidegrees_to_c(millic: int | None) -> float | None:
    """m°C -> °C; None for a powered-down sensor (Jetson reports -256 °C, others an errno)."""
    return None if millic is None or millic <= POWERED_DOWN_MC else millic / 1000


class ThermalCollector:
    key = "thermal"

    def __init__(self, reader: SysReader, topology: Topology) -> None:
        self._reader = reader
        self._zones = [(zone.zone, zone.type, resolved(reader, f"{THERMAL}/{zone.zone}/temp"))
                       for zone in topology.thermal]

    def collect(self) -> list[dict[str, Any]]:
        return [{"zone": zone, "type": zone_type,
                 "temp_c": millidegrees_to_c(self._reader.integer(
                     temp, tolerate=POWERED_DOWN_ERRNOS))}
                for zone, zone_type, temp in self._zones]
