"""The device's figures over a window, for the QoS controller: CPU utilisation, each cpufreq
policy's current frequency, whether the device is throttling, and its hottest temperature.

Built on the telemetry collectors (CpuCollector's /proc/stat deltas and cpufreq reads,
ThermalCollector's zones), so the controller and telemetry read the same files the same
way.  Throttling is what the kernel shows of it: a thermal zone past one of its passive, hot
or critical trip points (the points where the thermal governor caps clocks or the kernel
acts; ``active`` trips only start fans), or a policy whose ``scaling_max_freq`` is below its
expected maximum (a thermal cooling device's, a power mode's or anyone else's cap: cpufreq
shows the lowest max request).  The expected maximum is the hardware's unless the caller
knows a lower one it set on purpose (the profile's ``max_khz``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from agent.discovery.cpu import CPU
from agent.discovery.model import Topology
from agent.discovery.thermal import THERMAL
from agent.kernel.reader import SysReader
from agent.telemetry.collectors.cpu import CpuCollector
from agent.telemetry.collectors.thermal import ThermalCollector

THROTTLING_TRIPS = ("passive", "hot", "critical")  # Documentation/driver-api/thermal/sysfs-api


@dataclass(frozen=True)
class DeviceFigures:
    util_pct: float | None  # busy share of every online CPU over the window (None: first)
    cur_khz: dict[str, int | None]  # cpufreq policy -> scaling_cur_freq
    max_clipped_khz: dict[str, int]  # policy -> scaling_max_freq, where below its expected max
    trips_passed: list[str]  # "cpu-thermal trip 0 (passive, 85.0 °C) at 86.5 °C"
    hottest_c: float | None

    @property
    def throttled(self) -> bool:
        return bool(self.trips_passed or self.max_clipped_khz)


@dataclass(frozen=True)
class Trip:
    zone: str
    index: int
    type: str
    temp_c: float


def read_trips(reader: SysReader, zone: str) -> list[Trip]:
    """A zone's throttling trip points.  A trip at or below 0 °C is unset (x86_pkg_temp's
    writable notification trips read 0 until someone sets them), not one always passed."""
    trips = []
    for name in reader.listdir(f"{THERMAL}/{zone}"):
        match = re.fullmatch(r"trip_point_(\d+)_type", name)
        if match is None:
            continue
        kind = reader.text(f"{THERMAL}/{zone}/{name}")
        millic = reader.integer(f"{THERMAL}/{zone}/trip_point_{match[1]}_temp")
        if kind in THROTTLING_TRIPS and millic is not None and millic > 0:
            trips.append(Trip(zone, int(match[1]), kind, millic / 1000))
    return sorted(trips, key=lambda t: t.index)


class DeviceWindow:
    """Figures over the window since the previous :meth:`figures` call (the first one has no
    utilisation).  ``expected_max_khz``: policy -> the maximum the caller set on purpose."""

    def __init__(self, reader: SysReader, topology: Topology,
                 expected_max_khz: Mapping[str, int] | None = None) -> None:
        self._reader = reader
        self._cpu = CpuCollector(reader, topology)
        self._thermal = ThermalCollector(reader, topology)
        self._policies = {c.policy: (c.max_khz, c.online_cpus) for c in topology.cpu.clusters
                          if c.policy}
        self.expected = dict(expected_max_khz or {})
        self._trips = {zone.zone: read_trips(reader, zone.zone) for zone in topology.thermal}
        self._types = {zone.zone: zone.type for zone in topology.thermal}

    def figures(self) -> DeviceFigures:
        cpu = self._cpu.collect()
        temps = {z["zone"]: z["temp_c"] for z in self._thermal.collect()}
        known = [t for t in temps.values() if t is not None]
        return DeviceFigures(
            util_pct=cpu["util_pct"],
            cur_khz={policy: self._khz(policy, "scaling_cur_freq") for policy, (_, online)
                     in self._policies.items() if online},
            max_clipped_khz=self._clipped(),
            trips_passed=self._passed(temps),
            hottest_c=max(known) if known else None)

    def _khz(self, policy: str, name: str) -> int | None:
        return self._reader.integer(f"{CPU}/cpufreq/{policy}/{name}")

    def _clipped(self) -> dict[str, int]:
        clipped = {}
        for policy, (hardware_max, online) in self._policies.items():
            expected = self.expected.get(policy, hardware_max)
            now = self._khz(policy, "scaling_max_freq") if online else None
            if now is not None and expected is not None and now < expected:
                clipped[policy] = now
        return clipped

    def _passed(self, temps: Mapping[str, float | None]) -> list[str]:
        passed = []
        for zone, trips in self._trips.items():
            temp = temps.get(zone)
            for trip in trips:
                if temp is not None and temp >= trip.temp_c:
                    passed.append(f"{self._types[zone]} trip {trip.index} ({trip.type}, "
                                  f"{trip.temp_c:g} °C) at {temp:g} °C")
        return passed
