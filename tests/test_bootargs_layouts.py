"""Kernel arguments beyond Armbian and extlinux: GRUB's /etc/default/grub (then update-grub,
as TuneD's bootloader plugin does), the Raspberry Pi's cmdline.txt, and u-boot-update's
U_BOOT_PARAMETERS (Radxa), which regenerates extlinux.conf and would drop arguments edited
there.  Each installs and removes byte for byte, on copies of the fixture boards."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_overlays import RADXA_EXTLINUX
from tuning_helpers import copy_board, engine_for, snapshot, write_profile

from agent.kernel.fsroot import Root
from agent.overlays.bootfs import BootFiles
from agent.overlays.errors import InstallRefused
from agent.overlays.layouts import Layout, detect
from agent.tuning.errors import ProfileError

GRUB = """\
# If you change this file, run 'update-grub' afterwards to update
# /boot/grub/grub.cfg.

GRUB_DEFAULT=0
GRUB_TIMEOUT=5
GRUB_DISTRIBUTOR=`lsb_release -i -s 2> /dev/null || echo Debian`
GRUB_CMDLINE_LINUX_DEFAULT="quiet splash"
GRUB_CMDLINE_LINUX=""
"""
PI_CMDLINE = ("console=serial0,115200 console=tty1 root=PARTUUID=8a438930-02 rootfstype=ext4 "
              "fsck.repair=yes rootwait cfg80211.ieee80211_regdom=GB\n")
UBOOT_LITERAL = ('U_BOOT_PARAMETERS="root=UUID=2f1e3d4c rw console=ttyFIQ0,1500000n8 quiet"\n'
                 'U_BOOT_FDT_OVERLAYS_DIR="/boot/dtbo/"\n')
UBOOT_FROM_FILE = ('U_BOOT_PARAMETERS="$(cat /etc/kernel/cmdline)"\n'
                   'U_BOOT_FDT_OVERLAYS_DIR="/boot/dtbo/"\n')
KERNEL_CMDLINE = "rootwait rw console=ttyS2,1500000 console=tty1 cgroup_enable=cpuset"

# layout -> (board, files, the layout's kind, the file the arguments go to)
LAYOUTS: dict[str, tuple[str, dict[str, str], str, str]] = {
    "grub": ("x86-server-nvidia", {"etc/default/grub": GRUB}, "grub", "/etc/default/grub"),
    "raspi": ("bare-vm", {"boot/firmware/cmdline.txt": PI_CMDLINE, "boot/firmware/config.txt":
                          "dtparam=audio=on\n"}, "raspi", "/boot/firmware/cmdline.txt"),
    "u-boot-update": ("rk3588-vendor", {"boot/extlinux/extlinux.conf": RADXA_EXTLINUX,
                                        "etc/default/u-boot": UBOOT_LITERAL},
                      "u-boot-update", "/etc/default/u-boot"),
    "u-boot-update-cmdline": ("rk3588-vendor", {"boot/extlinux/extlinux.conf": RADXA_EXTLINUX,
                                                "etc/default/u-boot": UBOOT_FROM_FILE,
                                                "etc/kernel/cmdline": KERNEL_CMDLINE},
                              "u-boot-update", "/etc/kernel/cmdline"),
}


def board(layout: str, tmp_path: Path, **changed: str) -> Path:
    name, files, _, _ = LAYOUTS[layout]
    tree = copy_board(name, tmp_path)
    for path, text in {**files, **changed}.items():
        (tree / path).parent.mkdir(parents=True, exist_ok=True)
        (tree / path).write_text(text)
    return tree


def found(tree: Path) -> Layout:
    root = Root(tree)
    return detect(root, BootFiles(root), overlays=False)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_arguments_set_and_taken_out_byte_for_byte(layout: str, tmp_path: Path) -> None:
    tree = board(layout, tmp_path)
    _, _, kind, config = LAYOUTS[layout]
    where = found(tree)
    assert (where.kind, where.config) == (kind, config)
    original = (tree / config.lstrip("/")).read_text()
    text = where.set_argument(original, "nohz_full", "nohz_full=2-3")
    text = where.set_argument(text, "isolcpus", "isolcpus=domain,2-3")
    assert where.argument(text, "nohz_full") == "nohz_full=2-3"
    assert where.set_argument(text, "nohz_full", "nohz_full=1-3").count("nohz_full") == 1
    for name in ("nohz_full", "isolcpus"):
        text = where.set_argument(text, name, "")
    assert text == original


def test_grub_edits_the_default_line_only(tmp_path: Path) -> None:
    where = found(board("grub", tmp_path))
    text = where.set_argument(GRUB, "nohz_full", "nohz_full=2-3")
    assert text == GRUB.replace('"quiet splash"', '"quiet splash nohz_full=2-3"')
    assert where.follow_up == ("update-grub",)


@pytest.mark.parametrize(("snippet", "refused"), [
    ('GRUB_CMDLINE_LINUX_DEFAULT="console=tty1 console=ttyS0"\n', True),  # cloud images
    ('GRUB_CMDLINE_LINUX_DEFAULT="$GRUB_CMDLINE_LINUX_DEFAULT mitigations=off"\n', False),
    ('GRUB_TIMEOUT=0\n', False)])
def test_a_grub_d_snippet_that_sets_the_line_itself_is_refused(
        snippet: str, refused: bool, tmp_path: Path) -> None:
    tree = board("grub", tmp_path, **{"etc/default/grub.d/50-cloudimg-settings.cfg": snippet})
    if not refused:
        assert found(tree).kind == "grub"
        return
    with pytest.raises(InstallRefused, match=r"/etc/default/grub\.d/50-cloudimg-settings\.cfg "
                       r"sets GRUB_CMDLINE_LINUX_DEFAULT, and update-grub reads it after "
                       r"/etc/default/grub"):
        found(tree)


def test_a_value_the_shell_would_expand_is_refused_naming_file_and_variable(
        tmp_path: Path) -> None:
    tree = board("u-boot-update", tmp_path,
                 **{"etc/default/u-boot": 'U_BOOT_PARAMETERS="$ROOT quiet"\n'})
    with pytest.raises(InstallRefused, match=r'/etc/default/u-boot: U_BOOT_PARAMETERS="\$ROOT '
                       r'quiet" is not a literal value'):
        found(tree).argument('U_BOOT_PARAMETERS="$ROOT quiet"\n', "nohz_full")


PROFILE = "cmdline: {nohz_full: cpus:1, rcu_nocbs: cpus:1}\n"


@pytest.mark.parametrize(("layout", "command"), [
    ("grub", "update-grub"), ("u-boot-update", "u-boot-update"),
    ("u-boot-update-cmdline", "u-boot-update"), ("raspi", None)])
def test_apply_writes_the_layouts_file_runs_its_follow_up_and_rolls_back(
        layout: str, command: str | None, tmp_path: Path) -> None:
    tree = board(layout, tmp_path)
    config = LAYOUTS[layout][3]
    before = snapshot(tree)
    write_profile(tmp_path / "profiles", "args", PROFILE)
    cli = engine_for(tree, tmp_path / "state", [tmp_path / "profiles"], persistent=True)
    plan = cli.plan("args")
    assert {c.note for c in plan.changes} == {f"{config}: takes effect after reboot"}
    result = cli.apply("args")
    assert "nohz_full=1 rcu_nocbs=1" in (tree / config.lstrip("/")).read_text()
    if layout.startswith("u-boot-update"):  # regenerated from there: the copy is not made
        assert (tree / "boot/extlinux/extlinux.conf").read_text() == RADXA_EXTLINUX
    assert [n for n in result.notes if "not run below a fixture root" in n] == (
        [f"not run below a fixture root: {command}"] if command else [])
    assert cli.verify() == []
    _, notes = cli.rollback()
    assert snapshot(tree) == before
    assert [n for n in notes if "not run below" in n] == (
        [f"not run below a fixture root: {command}"] if command else [])


def test_a_refused_layout_is_a_profile_error_naming_why(tmp_path: Path) -> None:
    tree = board("grub", tmp_path, **{"etc/default/grub.d/50-cloudimg-settings.cfg":
                                      'GRUB_CMDLINE_LINUX_DEFAULT="console=tty1"\n'})
    write_profile(tmp_path / "profiles", "args", PROFILE)
    with pytest.raises(ProfileError, match=r"cmdline: no boot config edge-agent can edit: "
                       r"/etc/default/grub\.d/50-cloudimg-settings\.cfg sets"):
        engine_for(tree, tmp_path / "state", [tmp_path / "profiles"]).plan("args")
