"""Thermal zones, identified by ``type``, never by index (indices and spellings change
between boards and releases); a powered-down zone reads null.
"""

from __future__ import annotations

import errno
import re

from agent.discovery.model import ThermalZone
from agent.kernel.reader import SysReader

THERMAL = "/sys/class/thermal"
POWERED_DOWN_MC = -256000  # Jetson reports -256 °C for a rail-gated domain
# Errors some sensors return while their domain is off: a state, not a fault.
POWERED_DOWN_ERRNOS = (errno.EINVAL, errno.ENODATA, errno.EAGAIN)


def normalise_zone_type(zone_type: str) -> str:
    """``CPU-therm`` / ``cpu-thermal`` / ``Tboard_tegra`` -> ``cpu`` / ``cpu`` / ``tboard``."""
    return re.sub(r"(-therm(al)?|_tegra)$", "", zone_type.strip()).lower()


def discover_thermal(reader: SysReader) -> list[ThermalZone]:
    zones = []
    names = [n for n in reader.listdir(THERMAL) if re.fullmatch(r"thermal_zone\d+", n)]
    for zone in sorted(names, key=lambda n: int(n.removeprefix("thermal_zone"))):
        zone_type = reader.text(f"{THERMAL}/{zone}/type")
        if zone_type is None:
            continue
        name = normalise_zone_type(zone_type)
        if name.startswith("pmic"):
            continue  # PMIC die sensors are not a workload temperature
        millic = reader.integer(f"{THERMAL}/{zone}/temp", tolerate=POWERED_DOWN_ERRNOS)
        temp_c = None if millic is None or millic <= POWERED_DOWN_MC else millic / 1000
        zones.append(ThermalZone(zone=zone, type=zone_type, name=name, temp_c=temp_c))
    return zones
