"""A try-once boot for overlays that undervolt: a board whose new tree does not boot must come
back on the previous one (docs/kernel-facts/jetson-fan-and-boot.md).

U-Boot (common/autoboot.c, include/bootcount.h): built with CONFIG_BOOTCOUNT_LIMIT it counts
boots (with the env backend only while ``upgrade_available`` = 1) and, once ``bootcount`` >
``bootlimit``, runs ``altbootcmd`` instead of ``bootcmd``.  Its extlinux parser
(boot/pxe_utils.c) takes ``FALLBACK <label>``, booted instead of DEFAULT when the extlinux
bootmeth's fallback property is set (boot/bootmeth_extlinux.c), which ``altbootcmd`` does
with ``bootmeth set extlinux fallback 1``.  So on U-Boot extlinux the install adds
``fallback <the original label>`` and arms the count (``fw_setenv upgrade_available 1``,
``bootcount 0``); ``edge-agent overlay confirm``, after a good boot, disarms it.
``bootlimit`` and ``altbootcmd`` change what U-Boot does on every failed boot, so they are the
operator's to set: the refusal names the commands.

No try-once path edge-agent can arm: Armbian (its boot.scr always reads armbianEnv.txt and
there is no other script for ``altbootcmd`` to run) and Jetson (UEFI L4TLauncher reads
TIMEOUT, DEFAULT, MENU TITLE, LABEL, MENU LABEL, LINUX, INITRD, FDT, APPEND and OVERLAYS, no
FALLBACK; a failed extlinux boot falls back to the A/B kernel partition, not the previous
entry).  There an undervolting overlay is refused unless ``--no-fallback`` accepts it (the
original entry stays in the extlinux menu for the console).
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable

from agent.kernel.fsroot import Root
from agent.overlays.check import Overlay
from agent.overlays.errors import InstallRefused
from agent.overlays.socs import MHZ
from agent.overlays.stock import reference, stock_voltage

FW_CONFIG = "/etc/fw_env.config"  # where fw_printenv/fw_setenv find U-Boot's environment
ALTBOOTCMD = "bootmeth set extlinux fallback 1; bootflow scan -lb"
CONFIRM = "sudo edge-agent overlay confirm"

# argv -> (exit status, output); injected by tests (nothing is run below a fixture root)
Runner = Callable[[list[str]], tuple[int, str]]


def _run(argv: list[str]) -> tuple[int, str]:
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        return 127, str(error)
    return done.returncode, done.stdout.strip() or done.stderr.strip()


def undervolted(overlay: Overlay) -> list[str]:
    """Each operating point (or bin) whose min voltage is below its stock one."""
    found = []
    for table in overlay.tables:
        for opp in table.opps:
            point = reference(table.target, table.flavour, opp.hz)
            if opp.microvolt is None or point is None:
                continue
            cells = [(None, opp.microvolt[1]), *((b, t[1]) for b, t in opp.bins)]
            if any(uv < stock_voltage(table.target, table.flavour, point, b) for b, uv in cells):
                found.append(f"&{table.target.label} {opp.hz // MHZ} MHz")
    return found


class TryOnce:
    """U-Boot's boot count through fw_printenv/fw_setenv."""

    def __init__(self, root: Root, runner: Runner | None = None) -> None:
        self.root = root
        self.runner = runner or (_run if root.is_host else None)

    def check(self, name: str, points: list[str]) -> None:
        """Refuse unless U-Boot's environment is reachable and counts boots into the
        fallback: bootlimit set, altbootcmd enabling the extlinux fallback."""
        why = f"{name} undervolts ({', '.join(points)}), so it installs only through a " \
            "try-once boot"
        if not self.root.exists(FW_CONFIG) or self.runner is None:
            raise InstallRefused(f"{why}, and {FW_CONFIG} does not exist here: fw_setenv "
                                 "cannot arm U-Boot's boot count (install libubootenv-tool "
                                 "and configure it), or accept a board that may not boot "
                                 "with --no-fallback")
        limit = self.runner(["fw_printenv", "-n", "bootlimit"])
        alt = self.runner(["fw_printenv", "-n", "altbootcmd"])
        if limit[0] != 0 or not limit[1].strip().isdigit() or int(limit[1]) < 1 or \
                alt[0] != 0 or "fallback 1" not in alt[1]:
            raise InstallRefused(f"{why}: U-Boot's environment lacks the fallback (needs "
                                 "U-Boot built with CONFIG_BOOTCOUNT_LIMIT and "
                                 "CONFIG_BOOTCOUNT_ENV); set it once with: fw_setenv "
                                 f"bootlimit 1; fw_setenv altbootcmd '{ALTBOOTCMD}' (or "
                                 "--no-fallback)")

    def arm(self) -> list[str]:
        """Count boots from now on; the notes say what to run once the board runs well."""
        self._set("upgrade_available", "1")
        self._set("bootcount", "0")
        return [f"try-once boot armed: if the new tree does not boot, U-Boot boots the "
                f"previous entry after bootlimit tries; once it runs well: {CONFIRM}"]

    def disarm(self) -> None:
        self._set("upgrade_available", "0")
        self._set("bootcount", "0")

    def _set(self, name: str, value: str) -> None:
        if self.runner is None:
            return
        status, output = self.runner(["fw_setenv", name, value])
        if status != 0:
            raise InstallRefused(f"fw_setenv {name} {value}: exit {status}: {output[:200]}")
