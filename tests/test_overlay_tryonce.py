"""An overlay that undervolts installs only through a try-once boot: on U-Boot extlinux a
FALLBACK to the previous entry plus U-Boot's armed boot count, refused (naming what is
missing) where the board has none, unless --no-fallback.  U-Boot itself is modelled from its
source (include/bootcount.h, boot/pxe_utils.c) to show the board comes back on the old tree."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_overlays import armbian, radxa, snapshot

from agent.cli import main
from agent.kernel.fsroot import Root
from agent.overlays import build, installer, tryonce
from agent.overlays.errors import InstallRefused
from agent.overlays.table import load_table

NAME = "rk3588-vendor-npu-capped"
CONFIG = "boot/extlinux/extlinux.conf"


class UBootEnv:
    """fw_printenv/fw_setenv over a dict, as the runner the try-once code calls."""

    def __init__(self, **env: str) -> None:
        self.env = dict(env)
        self.calls: list[list[str]] = []

    def __call__(self, argv: list[str]) -> tuple[int, str]:
        self.calls.append(argv)
        if argv[:2] == ["fw_printenv", "-n"]:
            return (0, self.env[argv[2]]) if argv[2] in self.env else (1, "")
        self.env[argv[1]] = argv[2]
        return 0, ""


def configured() -> UBootEnv:
    return UBootEnv(bootlimit="1", altbootcmd=tryonce.ALTBOOTCMD)


def board_with_env(tmp_path: Path) -> Path:
    root = radxa(tmp_path)
    (root / "etc/fw_env.config").write_text("/dev/mmcblk0 0x3f8000 0x8000\n")
    return root


def uboot_boots(extlinux: str, env: UBootEnv) -> str:
    """The label U-Boot boots: bootcount_inc() (counted only while upgrade_available=1),
    then altbootcmd once bootcount > bootlimit, whose 'bootmeth set extlinux fallback 1'
    makes the pxe parser take FALLBACK instead of DEFAULT."""
    if env.env.get("upgrade_available") == "1":
        env.env["bootcount"] = str(int(env.env.get("bootcount", "0")) + 1)
    count, limit = int(env.env.get("bootcount", "0")), int(env.env.get("bootlimit", "0"))
    keyword = "fallback" if limit and count > limit and "fallback 1" in env.env.get(
        "altbootcmd", "") else "default"
    found = re.search(rf"^{keyword} (\S+)$", extlinux, re.MULTILINE | re.IGNORECASE)
    assert found is not None
    return found.group(1)


def test_extlinux_install_arms_a_fallback_to_the_previous_entry(tmp_path: Path) -> None:
    root = board_with_env(tmp_path)
    before = snapshot(root)
    env = configured()
    outcome = installer.install(Root(root), build.from_entry(NAME), runner=env)
    text = (root / CONFIG).read_text()
    assert "default edge-agent\nfallback l0\n" in text
    assert env.calls[-2:] == [["fw_setenv", "upgrade_available", "1"],
                              ["fw_setenv", "bootcount", "0"]]
    assert any(w.startswith("try-once boot armed") and w.endswith(tryonce.CONFIRM)
               for w in outcome.warnings)
    assert any(w.startswith("/etc/default/u-boot: u-boot-update (a kernel update runs it) "
                            "rewrites /boot/extlinux/extlinux.conf without the fallback")
               for w in outcome.warnings)
    assert uboot_boots(text, env) == "edge-agent"  # the first boot tries the new tree
    assert uboot_boots(text, env) == "l0"  # it did not come up (watchdog): the old one
    installer.remove(Root(root), NAME, runner=env)
    assert snapshot(root) == before
    assert env.env["upgrade_available"] == "0"


def test_confirm_stops_the_count_after_a_good_boot(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = board_with_env(tmp_path)
    env = configured()
    installer.install(Root(root), build.from_entry(NAME), runner=env)
    text = (root / CONFIG).read_text()
    assert uboot_boots(text, env) == "edge-agent"
    assert main(["overlay", "confirm", "--root", str(root)]) == 0  # below a fixture: no-op
    assert "try-once boot count stopped" in capsys.readouterr().out
    tryonce.TryOnce(Root(root), env).disarm()  # what confirm runs on the board
    assert (env.env["upgrade_available"], env.env["bootcount"]) == ("0", "0")
    assert [uboot_boots(text, env) for _ in range(3)] == ["edge-agent"] * 3


@pytest.mark.parametrize(("env", "fw_config", "missing"), [
    (configured(), False, "/etc/fw_env.config does not exist here"),
    (UBootEnv(), True, "U-Boot's environment lacks the fallback"),
    (UBootEnv(bootlimit="1", altbootcmd="run distro_bootcmd"), True,
     "lacks the fallback .*fw_setenv bootlimit 1; fw_setenv altbootcmd 'bootmeth set extlinux "
     "fallback 1; bootflow scan -lb'")])
def test_without_a_usable_boot_count_the_install_is_refused(
        env: UBootEnv, fw_config: bool, missing: str, tmp_path: Path) -> None:
    root = board_with_env(tmp_path) if fw_config else radxa(tmp_path)
    before = snapshot(root)
    with pytest.raises(InstallRefused, match=rf"{NAME} undervolts \(&npu_opp_table 800 MHz, "
                       rf"&npu_opp_table 900 MHz\).*{missing}"):
        installer.install(Root(root), build.from_entry(NAME), runner=env)
    assert snapshot(root) == before
    assert not [c for c in env.calls if c[0] == "fw_setenv"]


def test_armbian_has_no_try_once_boot_so_an_undervolt_needs_no_fallback(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = armbian(tmp_path)
    before = snapshot(root)
    name = "rk3588-mainline-gpu-capped"
    assert main(["overlay", "install", name, "--root", str(root)]) == 1
    assert ("the armbian layout has no try-once boot edge-agent can arm: its boot.scr always "
            "reads armbianEnv.txt") in capsys.readouterr().err
    assert snapshot(root) == before
    assert main(["overlay", "install", name, "--root", str(root), "--no-fallback"]) == 0
    assert "installed without a try-once boot (--no-fallback)" in capsys.readouterr().err


def test_a_cap_at_stock_voltages_needs_no_try_once_boot(tmp_path: Path) -> None:
    """Only a voltage below stock asks for it: switching points off and keeping stock
    voltages installs as before, on any layout."""
    (tmp_path / "cap.yaml").write_text("opps:\n  - {hz: 1000000000, disabled: true}\n"
                                       "  - {hz: 900000000, microvolt: 800000}\n")
    table = load_table(tmp_path / "cap.yaml", "rk3588", "mainline", "gpu")
    root = armbian(tmp_path / "board")
    outcome = installer.install(Root(root), build.from_table(table, "gpu-cap"))
    assert outcome.result == installer.REBOOT
    assert not any("try-once" in w for w in outcome.warnings)
