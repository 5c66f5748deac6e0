"""jetson_clocks.fan: a floor while clocks are pinned, rollback that hands the fan back to the
kernel's thermal governor (or nvfancontrol) instead of a snapshot duty, and the Xavier's
``/sys/devices/pwm-fan`` path, on copies of the Jetson fixture boards."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tuning_helpers import copy_board, engine_for, snapshot, write_profile

from agent.kernel.allowlist import WRITABLE_PATTERNS
from agent.kernel.fsroot import Root
from agent.tuning.engine import Engine
from agent.tuning.errors import ProfileError

NANO_FAN = "/sys/devices/platform/pwm-fan/hwmon/hwmon2/pwm1"
XAVIER_FAN = "/sys/devices/pwm-fan/hwmon/hwmon1/pwm1"
PINNED = "jetson_clocks: {gpu: max, railgate: off, fan: 0}\n"


def engine(tmp_path: Path, board: str, profile: str,
           tree: Path | None = None) -> tuple[Path, Engine]:
    tree = tree or copy_board(board, tmp_path)
    write_profile(tmp_path / "profiles", "p", profile)
    return tree, engine_for(tree, tmp_path / "state", [tmp_path / "profiles"])


def with_cooling_device(tree: Path, state: int, levels: tuple[int, ...]) -> None:
    """The pwm-fan cooling device the driver registers when the DT has cooling-levels
    (drivers/hwmon/pwm-fan.c), in state ``state``, and those levels on the fan's node."""
    node = tree / "sys/firmware/devicetree/base/pwm-fan"
    (node / "cooling-levels").write_bytes(b"".join(v.to_bytes(4, "big") for v in levels))
    device = tree / "sys/devices/virtual/thermal/cooling_device0"
    device.mkdir(parents=True)
    (device / "type").write_text("pwm-fan\n")
    (device / "cur_state").write_text(f"{state}\n")
    (device / "max_state").write_text(f"{len(levels) - 1}\n")
    os.symlink("../../devices/virtual/thermal/cooling_device0",
               tree / "sys/class/thermal/cooling_device0")


def test_fan_below_the_floor_is_refused_while_clocks_are_pinned(tmp_path: Path) -> None:
    _, pinned = engine(tmp_path, "jetson-orin-nano-jp6", PINNED)
    with pytest.raises(ProfileError, match=r"jetson_clocks\.fan: 0 is below the fan floor "
                       r"128 \(50 % duty\) while the plan pins clocks "
                       r"\(jetson_clocks\.gpu\): .*allowed: max or 128\.\.255"):
        pinned.plan("p")
    write_profile(tmp_path / "profiles", "p", PINNED.replace("fan: 0", "fan: 128"))
    assert {c.path: c.desired for c in pinned.plan("p").changes}[NANO_FAN] == "128"
    write_profile(tmp_path / "profiles", "p", "jetson_clocks: {fan: 0}\n")  # nothing pinned
    assert {c.path: c.desired for c in pinned.plan("p").changes} == {NANO_FAN: "0"}


def test_a_dvfs_minimum_counts_as_pinned(tmp_path: Path) -> None:
    _, pinned = engine(tmp_path, "jetson-orin-nano-jp6",
                       "dvfs: {gpu: {min_hz: max}}\njetson_clocks: {fan: 60}\n")
    with pytest.raises(ProfileError,
                       match=r"60 is below the fan floor 128 .*pins clocks \(dvfs\.gpu\)"):
        pinned.plan("p")


def test_rollback_hands_the_fan_to_the_thermal_governor(tmp_path: Path) -> None:
    """Not the snapshot duty (120): the level of the cooling state in force (2 -> 170)."""
    tree = copy_board("jetson-orin-nano-jp6", tmp_path)
    with_cooling_device(tree, 2, (0, 90, 170, 255))
    _, tuned = engine(tmp_path, "", "jetson_clocks: {fan: max}\n", tree)
    before = snapshot(tree)
    change = tuned.plan("p").changes[0]
    assert (change.path, change.current, change.desired) == (NANO_FAN, "120", "255")
    tuned.apply("p")
    assert tuned.verify() == []
    assert (tree / NANO_FAN.lstrip("/")).read_text() == "255\n"
    tuned.rollback()
    assert (tree / NANO_FAN.lstrip("/")).read_text() == "170\n"  # the state before apply
    after = snapshot(tree)
    assert after.pop(NANO_FAN.lstrip("/")) != before.pop(NANO_FAN.lstrip("/"))
    assert after == before


def test_a_fan_the_governor_took_back_meanwhile_is_left_to_it(tmp_path: Path) -> None:
    """The pwm1 write filed the fan in the top state (pwm_fan_update_state); a governor whose
    target then changed set its own level (state 1 -> 90): rollback writes nothing."""
    tree = copy_board("jetson-orin-nano-jp6", tmp_path)
    with_cooling_device(tree, 2, (0, 90, 170, 255))
    _, tuned = engine(tmp_path, "", "jetson_clocks: {fan: max}\n", tree)
    tuned.apply("p")
    state = tree / "sys/devices/virtual/thermal/cooling_device0/cur_state"
    assert state.read_text() == "3\n"  # as the driver files a hand-written duty
    (tree / NANO_FAN.lstrip("/")).write_text("90\n")  # the governor's set_cur_state(1)
    state.write_text("1\n")
    tuned.rollback()
    assert (tree / NANO_FAN.lstrip("/")).read_text() == "90\n"
    assert state.read_text() == "1\n"


def test_without_anyone_driving_the_fan_rollback_writes_the_original(tmp_path: Path) -> None:
    tree, tuned = engine(tmp_path, "jetson-orin-nano-jp6", "jetson_clocks: {fan: 200}\n")
    before = snapshot(tree)
    tuned.apply("p")
    tuned.rollback()
    assert snapshot(tree) == before


def xavier_fan_at_the_top(tree: Path) -> None:
    """L4T's Xavier: the DT pwm-fan device directly below /sys/devices."""
    os.rename(tree / "sys/devices/platform/pwm-fan", tree / "sys/devices/pwm-fan")
    fan = tree / "sys/devices/pwm-fan"
    for link, target in (("of_node", "../../firmware/devicetree/base/pwm-fan"),
                         ("driver", "../../bus/platform/drivers/pwm-fan")):
        (fan / link).unlink()
        os.symlink(target, fan / link)
    (tree / "sys/class/hwmon/hwmon1").unlink()
    os.symlink("../../devices/pwm-fan/hwmon/hwmon1", tree / "sys/class/hwmon/hwmon1")


def test_xavier_fan_path_is_planned_applied_and_rolled_back(tmp_path: Path) -> None:
    tree = copy_board("jetson-xavier-nx-jp5-rt", tmp_path)
    xavier_fan_at_the_top(tree)
    _, tuned = engine(tmp_path, "", "jetson_clocks: {fan: 200}\n", tree)
    before = snapshot(tree)
    assert {c.path: c.desired for c in tuned.plan("p").changes} == {XAVIER_FAN: "200"}
    tuned.apply("p")
    assert (tree / XAVIER_FAN.lstrip("/")).read_text() == "200\n"
    tuned.rollback()
    assert snapshot(tree) == before


def test_a_write_outside_the_allowlist_is_a_profile_error_at_plan_time(tmp_path: Path) -> None:
    """Any change below a path the allowlist lacks (here: the Xavier fan, under the list as it
    was before) is named in a ProfileError by plan, not an apply failing at its first write."""
    tree = copy_board("jetson-xavier-nx-jp5-rt", tmp_path)
    xavier_fan_at_the_top(tree)
    write_profile(tmp_path / "profiles", "p", "jetson_clocks: {fan: 200}\n")
    narrow = Root(tree, [p for p in WRITABLE_PATTERNS if not p.startswith("/sys/devices/pwm")])
    tuned = engine_for(tree, tmp_path / "state", [tmp_path / "profiles"], root=narrow)
    with pytest.raises(ProfileError, match=r"p\.yaml: jetson_clocks\.fan: "
                       r"/sys/devices/pwm-fan/hwmon/hwmon1/pwm1: not a writable tuning path"):
        tuned.plan("p")


def test_a_tuners_own_allowlist_check_is_a_profile_error_too(tmp_path: Path) -> None:
    """block journals nr_requests itself when a scheduler switch resets it: under a list
    without it the plan names the section instead of failing with rc 1."""
    tree = copy_board("x86-server-nvidia", tmp_path)
    write_profile(tmp_path / "profiles", "p", "block: {'nvme*': {scheduler: kyber}}\n")
    narrow = Root(tree, [p for p in WRITABLE_PATTERNS if not p.endswith("/nr_requests")])
    tuned = engine_for(tree, tmp_path / "state", [tmp_path / "profiles"], root=narrow)
    with pytest.raises(ProfileError, match=r"p\.yaml: block: /sys/block/nvme0n1/queue/"
                       r"nr_requests: not a writable tuning path"):
        tuned.plan("p")
