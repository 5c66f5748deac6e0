"""Power rails (INA3221, INA2xx, regulators) and fans from hwmon.

Units as https://docs.kernel.org/hwmon/sysfs-interface.html gives them (mV, mA, µW), except
the INA3221 shunt channels, which are µV (https://docs.kernel.org/hwmon/ina3221.html).
"""

from __future__ import annotations

import os
import re

from agent.discovery.model import Fan, PowerRail
from agent.kernel.reader import SysReader

HWMON = "/sys/class/hwmon"
REGULATORS = "/sys/class/regulator"
INA3221_CHANNELS = (1, 2, 3)  # in4-6 are shunt µV, in7/curr4 the summation channel
INA2XX_CHIPS = {"ina209", "ina219", "ina220", "ina226", "ina230", "ina231", "ina237",
                "ina238", "ina260", "ina780", "sq52206"}
_NOT_CONNECTED = re.compile(r"(^|[^A-Z])NC([^A-Z]|$)")


def _sensor_name(reader: SysReader, hwmon: str) -> str:
    device = reader.realpath(f"{hwmon}/device")
    return os.path.basename(device) if device else os.path.basename(hwmon)


def _ina3221(reader: SysReader, hwmon: str) -> list[PowerRail]:
    rails = []
    for channel in INA3221_CHANNELS:
        label = reader.text(f"{hwmon}/in{channel}_label")
        if not label or _NOT_CONNECTED.search(label):
            continue
        millivolts = reader.integer(f"{hwmon}/in{channel}_input")
        milliamps = reader.integer(f"{hwmon}/curr{channel}_input")
        power = millivolts * milliamps / 1000 if millivolts is not None and \
            milliamps is not None else None
        rails.append(PowerRail(name=label, voltage_mv=millivolts, current_ma=milliamps,
                               power_mw=power, source="ina3221",
                               sensor=_sensor_name(reader, hwmon)))
    return rails


def _ina2xx(reader: SysReader, hwmon: str, chip: str) -> PowerRail:
    sensor = _sensor_name(reader, hwmon)
    microwatts = reader.integer(f"{hwmon}/power1_input")
    return PowerRail(name=reader.text(f"{hwmon}/in1_label") or f"{chip}-{sensor}",
                     voltage_mv=reader.integer(f"{hwmon}/in1_input"),  # in1 is the bus
                     current_ma=reader.integer(f"{hwmon}/curr1_input"),
                     power_mw=microwatts / 1000 if microwatts is not None else None,
                     source=chip, sensor=sensor)


def _regulators(reader: SysReader) -> list[PowerRail]:
    """RK3588 boards have no current sense; core regulator voltages are the best there is."""
    rails = []
    for entry in reader.listdir(REGULATORS):
        base = f"{REGULATORS}/{entry}"
        name = reader.text(f"{base}/name")
        if not name or not name.startswith("vdd") or not reader.exists(f"{base}/microvolts"):
            continue
        microvolts = reader.integer(f"{base}/microvolts")
        rails.append(PowerRail(name=name, voltage_mv=microvolts / 1000 if microvolts else None,
                               current_ma=None, power_mw=None, source="regulator",
                               sensor=entry))
    return rails


def discover_power(reader: SysReader) -> tuple[list[PowerRail], list[Fan]]:
    rails: list[PowerRail] = []
    fans: list[Fan] = []
    for entry in reader.listdir(HWMON):
        hwmon = f"{HWMON}/{entry}"
        chip = reader.text(f"{hwmon}/name") or ""
        if chip == "ina3221":
            rails += _ina3221(reader, hwmon)
        elif chip in INA2XX_CHIPS:
            rails.append(_ina2xx(reader, hwmon, chip))
        has_pwm = reader.exists(f"{hwmon}/pwm1")
        tach = next((f"{hwmon}/{f}" for f in ("fan1_input", "rpm")
                     if reader.exists(f"{hwmon}/{f}")), None)
        if has_pwm or tach:
            fans.append(Fan(name=chip or entry, sensor=entry,
                            pwm=reader.integer(f"{hwmon}/pwm1") if has_pwm else None,
                            pwm_enable=reader.integer(f"{hwmon}/pwm1_enable")
                            if reader.exists(f"{hwmon}/pwm1_enable") else None,
                            rpm=reader.integer(tach) if tach else None))
    return rails + _regulators(reader), fans
