"""Fan speed and PWM duty (0-255) from the hwmon devices discovery found.

File names: https://docs.kernel.org/hwmon/sysfs-interface.html; Tegra kernels expose the
tachometer as ``rpm``.
"""

from __future__ import annotations

from typing import Any

from agent.discovery.model import Topology
from agent.discovery.power import HWMON
from agent.kernel.reader import SysReader
from agent.telemetry.collectors.base import resolved

TACHOMETER_FILES = ("fan1_input", "rpm")  # standard hwmon, then the Tegra tachometer


class FanCollector:
    key = "fans"

    def __init__(self, reader: SysReader, topology: Topology) -> None:
        self._reader = reader
        self._fans: list[tuple[str, str | None, str | None]] = []
        for fan in topology.fans:
            hwmon = resolved(reader, f"{HWMON}/{fan.sensor}")
            tach = next((f"{hwmon}/{name}" for name in TACHOMETER_FILES
                         if reader.exists(f"{hwmon}/{name}")), None)
            pwm = f"{hwmon}/pwm1" if reader.exists(f"{hwmon}/pwm1") else None
            self._fans.append((fan.name, tach, pwm))

    def collect(self) -> list[dict[str, Any]]:
        read = self._reader.integer
        return [{"name": name, "rpm": read(tach) if tach else None,
                 "pwm": read(pwm) if pwm else None} for name, tach, pwm in self._fans]
