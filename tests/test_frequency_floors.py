"""A frequency floor is the user's QoS request: rollback of a min at the hardware's lowest
step writes 0 (the request's default, no floor), never the old floor as a new request; a
floor someone had set above it is put back as it was."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
from tuning_helpers import copy_board, engine_for, snapshot, write_profile

from agent.kernel.fsroot import Root

POLICY4 = "/sys/devices/system/cpu/cpufreq/policy4"
NPU = "/sys/class/devfreq/fdab0000.npu"
PROFILE = "dvfs: {cpu: {cluster:big: {min_khz: max}}, npu: {min_hz: max}}\n"


def test_the_fixture_kernel_shows_the_effective_floor(tmp_path: Path) -> None:
    tree = copy_board("rk3588-vendor", tmp_path)
    root = Root(tree)
    root.write_text(f"{POLICY4}/scaling_min_freq", "0")  # the request's default: no floor
    assert root.read_text(f"{POLICY4}/scaling_min_freq") == "408000\n"  # cpuinfo_min_freq
    root.write_text(f"{NPU}/min_freq", "0")
    assert root.read_text(f"{NPU}/min_freq") == "300000000\n"  # the lowest OPP
    with pytest.raises(OSError) as caught:
        root.write_text(f"{POLICY4}/scaling_min_freq", "-5")
    assert caught.value.errno == errno.EINVAL


def test_a_floor_at_the_hardware_minimum_is_removed_not_refiled(tmp_path: Path) -> None:
    tree = copy_board("rk3588-vendor", tmp_path)
    write_profile(tmp_path / "profiles", "floor", PROFILE)
    engine = engine_for(tree, tmp_path / "state", [tmp_path / "profiles"])
    before = snapshot(tree)
    plan = engine.plan("floor")
    floors = {c.path: (c.current, c.restore_value) for c in plan.changes
              if c.path.endswith("min_freq")}
    assert floors == {f"{POLICY4}/scaling_min_freq": ("408000", "0"),
                      "/sys/devices/system/cpu/cpufreq/policy6/scaling_min_freq": ("408000", "0"),
                      f"{NPU}/min_freq": ("300000000", "0")}
    engine.apply("floor")
    assert engine.verify() == []
    engine.rollback()
    assert snapshot(tree) == before


def test_a_floor_someone_set_is_put_back(tmp_path: Path) -> None:
    tree = copy_board("rk3588-vendor", tmp_path)
    Root(tree).write_text(f"{POLICY4}/scaling_min_freq", "1200000")  # an admin's floor
    write_profile(tmp_path / "profiles", "floor", PROFILE)
    engine = engine_for(tree, tmp_path / "state", [tmp_path / "profiles"])
    [change] = [c for c in engine.plan("floor").changes if c.path.startswith(POLICY4)
                and c.path.endswith("scaling_min_freq")]
    assert (change.current, change.restore_value) == ("1200000", "1200000")
    engine.apply("floor")
    engine.rollback()
    assert (tree / POLICY4.lstrip("/") / "scaling_min_freq").read_text() == "1200000\n"
