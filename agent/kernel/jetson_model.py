"""Jetson attributes whose writes the kernel checks, for fixture roots.

Below a fixture root these files are plain files; a write goes through here so a plan,
apply and rollback is judged as on a device:

- BPMP debugfs clock ``rate`` (drivers/firmware/tegra/bpmp-debugfs.c hands the request to
  the BPMP firmware): a rate outside ``min_rate``..``max_rate`` is refused with EINVAL
  **(unverified: the firmware may clamp instead; either way the file never reads above
  max_rate)**; ``mrq_rate_locked`` takes 0 or 1.
- pwm-fan ``pwm1`` (drivers/hwmon/pwm-fan.c ``pwm_store``): above 255 is EINVAL; the duty
  written is filed as the cooling state whose level range holds it (pwm_fan_update_state),
  which the ``pwm-fan`` cooling device's ``cur_state`` then reads.
- nvgpu ``railgate_enable``: an unsigned integer, nonzero enables gating (reads back 1).
"""

from __future__ import annotations

import errno
import re
from pathlib import Path

_RATE = re.compile(r"/bpmp/debug/clk/[^/]+/rate$")
_LOCK = re.compile(r"/bpmp/debug/clk/[^/]+/mrq_rate_locked$")
_PWM = re.compile(r"/hwmon/hwmon\d+/pwm\d$")
_RAILGATE = re.compile(r"/railgate_enable$")
PATTERNS = (_RATE, _LOCK, _PWM, _RAILGATE)


def handles(logical: str) -> bool:
    return any(p.search(logical) for p in PATTERNS)


def _unsigned(value: str, path: str) -> int:
    text = value.strip()
    if not text.isdigit():
        raise OSError(errno.EINVAL, f"{path}: {value!r} is not an unsigned integer")
    return int(text)


def write(target: Path, logical: str, value: str) -> None:
    """Write ``value`` to the fixture file ``target`` as the kernel would accept it."""
    number = _unsigned(value, logical)
    if _RATE.search(logical):
        low = int((target.parent / "min_rate").read_text())
        high = int((target.parent / "max_rate").read_text())
        if not low <= number <= high:
            raise OSError(errno.EINVAL, f"{logical}: {number} is outside {low}..{high}")
    elif _LOCK.search(logical) and number > 1:
        raise OSError(errno.EINVAL, f"{logical}: only 0 and 1")
    elif _PWM.search(logical) and number > 255:
        raise OSError(errno.EINVAL, f"{logical}: PWM duty above 255")
    elif _RAILGATE.search(logical):
        number = int(number != 0)
    with open(target, "r+b") as handle:  # an existing attribute: never created here
        handle.write(f"{number}\n".encode())
        handle.truncate()
    if _PWM.search(logical) and str(target).endswith(logical):
        _update_state(Path(str(target)[:-len(logical)]), target, number)


def _update_state(base: Path, pwm1: Path, duty: int) -> None:
    """pwm_fan_update_state: the first state i whose next level is above the duty."""
    try:
        data = (pwm1.parent / "device/of_node/cooling-levels").read_bytes()
    except OSError:
        return
    levels = [int.from_bytes(data[i:i + 4], "big") for i in range(0, len(data) - 3, 4)]
    state = next((i for i in range(len(levels) - 1) if duty < levels[i + 1]),
                 len(levels) - 1)
    for device in (base / "sys/class/thermal").glob("cooling_device*"):
        if (device / "type").read_text().strip() == "pwm-fan":
            (device / "cur_state").write_text(f"{state}\n")
