"""pwm-fan's ``pwm1`` as a journaled setting (Kind ``fan``) whose rollback hands the fan back.

A fixed duty written by ``jetson_clocks.fan`` is taken from whoever drove the fan before:
nvfancontrol (L4T's daemon, which rewrites ``pwm1`` every polling interval) or the kernel's
thermal governor (pwm-fan registers a ``pwm-fan`` cooling device whose states index the DT
``cooling-levels``).  Writing the snapshot PWM back on rollback would leave the fan fixed at
whatever it happened to spin at, so rollback hands control back instead
(docs/kernel-facts/jetson-fan-and-boot.md):

- nvfancontrol.service enabled: ``systemctl restart nvfancontrol.service`` (it starts it when
  the operator stopped it for the fixed fan, and it re-asserts its profile's duty); ``pwm1``
  itself is not written.
- else a ``pwm-fan`` cooling device and ``cooling-levels``: drivers/hwmon/pwm-fan.c files a
  ``pwm1`` write as the cooling state its duty falls in (pwm_fan_update_state), and the
  thermal core calls set_cur_state only when a governor's target changes.  So when ``pwm1``
  still holds the fixed duty the governor's target is the state recorded before apply, and
  its level is written back; when it holds another duty the governor has already taken the
  fan back and nothing is written.
- else nobody drives the fan: the original duty is written back.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from agent.kernel.fsroot import Root
from agent.kernel.reader import SysReader
from agent.tuning.nvpmodel_mode import run_command

logger = logging.getLogger(__name__)

COMPARE = "fan"
HANDBACK = "handback:"  # restore value: hand the fan back; the original duty follows
THERMAL = "/sys/class/thermal"
FAN_UNITS = ("/etc/systemd/system/nvfancontrol.service", "/lib/systemd/system/nvfancontrol."
             "service", "/usr/lib/systemd/system/nvfancontrol.service")
FAN_ENABLED = "/etc/systemd/system/multi-user.target.wants/nvfancontrol.service"
RESTART = ["systemctl", "restart", "nvfancontrol.service"]

Runner = Callable[[list[str]], tuple[int, str]]


def cooling_levels(root: Root, pwm1: str) -> list[int]:
    """The DT ``cooling-levels`` of the fan that owns ``pwm1`` (big-endian u32 cells)."""
    node = f"{os.path.dirname(pwm1)}/device/of_node/cooling-levels"
    try:
        data = root.read_bytes(node)
    except OSError:
        return []
    return [int.from_bytes(data[i:i + 4], "big") for i in range(0, len(data) - 3, 4)]


def cooling_state(root: Root) -> int | None:
    """``cur_state`` of the one ``pwm-fan`` cooling device; None without one (or with
    several, which cannot be told apart: the device has no parent link)."""
    reader = SysReader(root)
    states = [reader.integer(f"{THERMAL}/{d}/cur_state") for d in reader.listdir(THERMAL)
              if d.startswith("cooling_device")
              and (reader.text(f"{THERMAL}/{d}/type") or "").strip() == "pwm-fan"]
    return states[0] if len(states) == 1 else None


def handback(original: str, desired: str, state: int | None) -> str:
    """The restore value: what rollback needs to hand the fan back."""
    return f"{HANDBACK}{original}:{desired}:{'' if state is None else state}"


def nvfancontrol(root: Root) -> tuple[str, str] | None:
    """(state, file) when nvfancontrol.service is enabled or installed; None when neither."""
    if root.exists(FAN_ENABLED):
        return "enabled", FAN_ENABLED
    units = [u for u in FAN_UNITS if root.exists(u)]
    return ("installed", units[0]) if units else None


class FanKind:
    """``pwm1`` read and written as a number; a ``HANDBACK`` value hands the fan back."""

    persistent = False
    kernel_file = True  # a sysfs attribute below the allowlist, checked at plan time

    def __init__(self, runner: Runner | None = None) -> None:
        self.runner = runner  # None: systemctl on the real root, nothing below a fixture

    def read(self, root: Root, path: str) -> str | None:
        try:
            return root.read_text(path).strip()
        except FileNotFoundError:
            return None

    def write(self, root: Root, path: str, value: str) -> None:
        if not value.startswith(HANDBACK):
            root.write_text(path, value)
            return
        original, desired, state = value.removeprefix(HANDBACK).split(":")
        found = nvfancontrol(root)
        if found is not None and found[0] == "enabled":
            self._restart(root)
            return
        levels = cooling_levels(root, path)
        if not levels or not state.isdigit():
            root.write_text(path, original)  # nobody drives this fan: its old duty
        elif self.read(root, path) == desired:  # the governor has not moved since apply
            root.write_text(path, str(levels[min(int(state), len(levels) - 1)]))

    def _restart(self, root: Root) -> None:
        runner = self.runner or (run_command if root.is_host else None)
        if runner is None:
            logger.info("not run below a fixture root: %s", " ".join(RESTART))
            return
        status, output = runner(list(RESTART))
        if status != 0:
            raise OSError(f"{' '.join(RESTART)}: exit {status}: {output[:200]}")
