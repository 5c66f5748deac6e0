"""Plan-time conflicts (issue 31 item 9): two keys that resolve to the same file or the same
limits with contradicting values, a cgroup cpuset without the inference CPUs, and vm.*
values outside their documented ranges, refused naming both keys; nothing is written."""

from __future__ import annotations

from pathlib import Path

import pytest
from tuning_helpers import REPO_PROFILES, SharedBoard, plan_engine, write_profile

from agent.tuning.errors import ProfileError

UNIFORM = "jetson-orin-nano-jp6"  # six alike A78AE cores: cluster:big is cluster:little
POLICY0 = "/sys/devices/system/cpu/cpufreq/policy0"


def _refused(shared_board: SharedBoard, tmp_path: Path, text: str, board: str = UNIFORM) -> str:
    profiles = tmp_path / "profiles"
    path = write_profile(profiles, "t", text)
    with pytest.raises(ProfileError) as error:
        plan_engine(shared_board(board), tmp_path / "state", [profiles, REPO_PROFILES]).plan(
            "t", force=True)
    message = str(error.value)
    assert message.startswith(f"{path}: ")
    return message


def test_a_floor_above_another_keys_ceiling_is_refused(tmp_path: Path,
                                                      shared_board: SharedBoard) -> None:
    """The pair that pinned every core at 115 MHz: on a uniform SoC both keys name policy0."""
    message = _refused(shared_board, tmp_path, "dvfs:\n  cpu:\n"
                       "    cluster:big: {min_khz: max}\n    cluster:little: {max_khz: min}\n")
    assert f"dvfs.cpu.cluster:big raises the floor of {POLICY0} to 1728000, above the ceiling " \
        "115200 that dvfs.cpu.cluster:little sets there" in message


def test_the_same_pair_plans_on_a_big_little_soc(tmp_path: Path,
                                                 shared_board: SharedBoard) -> None:
    profiles = tmp_path / "profiles"
    write_profile(profiles, "t", "dvfs:\n  cpu:\n"
                  "    cluster:big: {min_khz: max}\n    cluster:little: {max_khz: min}\n")
    plan = plan_engine(shared_board("rk3588-vendor"), tmp_path / "state",
                       [profiles]).plan("t", force=True)
    assert {c.path.rsplit("/", 2)[1] for c in plan.changes} == {"policy0", "policy4", "policy6"}


def test_one_file_with_two_values_names_both_keys(tmp_path: Path,
                                                  shared_board: SharedBoard) -> None:
    message = _refused(shared_board, tmp_path, "dvfs:\n  cpu:\n"
                       "    cluster:big: {governor: performance}\n"
                       "    cluster:little: {governor: powersave}\n")
    assert f"{POLICY0}/scaling_governor is set twice with contradicting values: " \
        "dvfs.cpu.cluster:big asks for 'performance', dvfs.cpu.cluster:little for " \
        "'powersave'" in message


def test_one_file_with_the_same_value_is_planned_once(tmp_path: Path,
                                                      shared_board: SharedBoard) -> None:
    profiles = tmp_path / "profiles"
    write_profile(profiles, "t", "dvfs:\n  cpu:\n    cluster:big: {governor: performance}\n"
                  "    cluster:little: {governor: performance}\n")
    plan = plan_engine(shared_board(UNIFORM), tmp_path / "state", [profiles]).plan("t")
    paths = [c.path for c in plan.changes]
    assert len(paths) == len(set(paths)) and f"{POLICY0}/scaling_governor" in paths
    assert {c.key for c in plan.changes} == {"dvfs.cpu.cluster:big"}


def test_a_cgroup_cpuset_without_the_inference_cpus_is_refused(
        tmp_path: Path, shared_board: SharedBoard) -> None:
    message = _refused(shared_board, tmp_path, "include: [latency]\ncgroup: {cpus: cpus:0-1}\n",
                       board="rk3588-vendor")
    assert "cgroup.cpus: cpus:0-1 (0-1) leaves out CPUs 4-7 that rt.inference.cpus (4-7) " \
        "runs inference on" in message


@pytest.mark.parametrize(("setting", "expected"), [
    ("vm.min_free_kbytes: 9000000", "sysctl.vm.min_free_kbytes: 9000000 is out of range; "
     "allowed: 128..390114 kB (5 % of this device's memory"),
    ("vm.min_free_kbytes: 64", "allowed: 128..390114 kB"),
    ("vm.swappiness: 300", "sysctl.vm.swappiness: 300 is out of range; allowed: 0..200"),
    ("vm.dirty_ratio: 101", "sysctl.vm.dirty_ratio: 101 is out of range; allowed: 0..100"),
    ("vm.dirty_bytes: 4096", "allowed: 8192.. (at least two pages"),
    ("vm.dirty_ratio: 10, vm.dirty_bytes: 100000000", "sysctl.vm.dirty_bytes: "
     "sysctl.vm.dirty_ratio and sysctl.vm.dirty_bytes are counterparts"),
    ("vm.drop_caches: 3", "drop_caches is an action, not a setting"),
])
def test_vm_sysctls_keep_their_documented_ranges(setting: str, expected: str, tmp_path: Path,
                                                 shared_board: SharedBoard) -> None:
    assert expected in _refused(shared_board, tmp_path, f"sysctl: {{{setting}}}\n")


def test_a_vm_value_inside_its_range_plans(tmp_path: Path, shared_board: SharedBoard) -> None:
    profiles = tmp_path / "profiles"
    write_profile(profiles, "t", "sysctl: {vm.min_free_kbytes: 65536, vm.swappiness: 150}\n")
    plan = plan_engine(shared_board(UNIFORM), tmp_path / "state", [profiles]).plan("t")
    assert {c.key: c.desired for c in plan.changes} == {"sysctl.vm.min_free_kbytes": "65536",
                                                       "sysctl.vm.swappiness": "150"}
