"""Power rails discovery found (INA3221, INA2xx, regulators), re-read every sample.

The files of each rail are located once: the hwmon directory by chip and sensor name as
discovery names them, the INA3221 channel by its label.  Units follow the chips: bus mV,
mA, µW for INA2xx ``power1_input``; INA3221 power is mV * mA, as discovery computes it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from agent.discovery.model import PowerRail, Topology
from agent.discovery.power import HWMON, INA2XX_CHIPS, INA3221_CHANNELS, REGULATORS
from agent.kernel.reader import SysReader
from agent.telemetry.collectors.base import resolved, rounded

# A module's input rail: where a board has one, its other rails are parts of it (Orin NX/Nano's
# VDD_IN beside VDD_CPU_GPU_CV and VDD_SOC), and adding them would count their power twice
INPUT_RAILS = ("VDD_IN", "POM_5V_IN")


class RailFiles(NamedTuple):
    name: str
    voltage: str | None
    voltage_per_mv: int  # raw units per mV: 1 for hwmon mV, 1000 for regulator µV
    current: str | None  # mA
    power: str | None  # µW; None: mV * mA when both are known


def hwmon_dirs(reader: SysReader) -> dict[tuple[str, str], str]:
    """(chip name, sensor) -> hwmon directory; the sensor is the device's name (``1-0040``),
    or the hwmon entry when it has no device."""
    found = {}
    for entry in reader.listdir(HWMON):
        hwmon = resolved(reader, f"{HWMON}/{entry}")
        device = reader.realpath(f"{hwmon}/device")
        sensor = os.path.basename(device) if device else entry
        found[(reader.text(f"{hwmon}/name") or "", sensor)] = hwmon
    return found


def rail_files(reader: SysReader, rail: PowerRail, hwmons: dict[tuple[str, str], str]
               ) -> RailFiles:
    if rail.source == "regulator":
        return RailFiles(rail.name, f"{REGULATORS}/{rail.sensor}/microvolts", 1000, None, None)
    hwmon = hwmons.get((rail.source, rail.sensor or ""))
    if hwmon is not None and rail.source == "ina3221":
        for channel in INA3221_CHANNELS:
            if reader.text(f"{hwmon}/in{channel}_label") == rail.name:
                return RailFiles(rail.name, f"{hwmon}/in{channel}_input", 1,
                                 f"{hwmon}/curr{channel}_input", None)
    if hwmon is not None and rail.source in INA2XX_CHIPS:
        return RailFiles(rail.name, f"{hwmon}/in1_input", 1, f"{hwmon}/curr1_input",
                         f"{hwmon}/power1_input")
    return RailFiles(rail.name, None, 1, None, None)


class PowerCollector:
    key = "power"

    def __init__(self, reader: SysReader, topology: Topology) -> None:
        self._reader = reader
        hwmons = hwmon_dirs(reader) if topology.power_rails else {}
        self._rails = [rail_files(reader, rail, hwmons) for rail in topology.power_rails]

    def _read(self, path: str | None) -> int | None:
        return self._reader.integer(path) if path is not None else None

    def collect(self) -> list[dict[str, Any]]:
        rails = []
        for rail in self._rails:
            raw_voltage, current = self._read(rail.voltage), self._read(rail.current)
            voltage = raw_voltage / rail.voltage_per_mv if raw_voltage is not None else None
            microwatts = self._read(rail.power)
            if microwatts is not None:
                power: float | None = microwatts / 1000
            elif rail.power is None and voltage is not None and current is not None:
                power = voltage * current / 1000
            else:
                power = None
            rails.append({"name": rail.name, "voltage_mv": rounded(voltage),
                          "current_ma": rounded(current), "power_mw": rounded(power)})
        return rails


def summed_rails(names: Sequence[str]) -> list[str]:
    """The rails whose power is the device's: the input rail where the board has one, else
    every rail (the sum is then approximate: AGX Orin's rails do not cover the module)."""
    return [name for name in INPUT_RAILS if name in names][:1] or list(names)


def total_mw(rails: Sequence[Mapping[str, Any]]) -> float | None:
    """The device's power from what ``PowerCollector.collect`` reported (summed_rails' rule):
    None when none of those rails has power (regulators only; an input rail unread)."""
    counted = summed_rails([rail["name"] for rail in rails])
    powers = [rail["power_mw"] for rail in rails
              if rail["name"] in counted and rail["power_mw"] is not None]
    return rounded(sum(powers)) if powers else None
