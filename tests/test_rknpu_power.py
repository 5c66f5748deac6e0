"""Keeping the RK3588 NPU powered: the vendor driver's hold is taken whatever its ``power``
file reads (it reads on while a job or the idle delay holds power) and is verified by the
device's runtime PM status; on mainline the rocket cores' runtime PM is held instead."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import pytest
from tuning_helpers import REPO_PROFILES, copy_board, engine_for, snapshot, write_profile

from agent.kernel.fsroot import Root

POWER = "sys/kernel/debug/rknpu/power"
STATUS = "sys/devices/platform/fdab0000.npu/power/runtime_status"
CORES = ("fdab0000", "fdac0000", "fdad0000")


def vendor(tmp_path: Path, power: str, status: str, profile: str = "rknpu: {power: on}\n"):  # type: ignore[no-untyped-def]
    tree = copy_board("rk3588-vendor", tmp_path)
    (tree / POWER).write_text(f"{power}\n")
    (tree / STATUS).parent.mkdir(exist_ok=True)
    (tree / STATUS).write_text(f"{status}\n")
    write_profile(tmp_path / "profiles", "npu", profile)
    return tree, engine_for(tree, tmp_path / "state", [tmp_path / "profiles"])


def test_the_hold_is_taken_although_the_file_reads_on(tmp_path: Path) -> None:
    """A job (or the 3 s idle delay) holds power: the file reads on; without a hold of our
    own the NPU powers off once that ends."""
    tree, engine = vendor(tmp_path, "on", "active")
    [change] = engine.plan("npu").changes
    assert (change.path, change.current, change.desired, change.restore_value) == (
        f"/{POWER}", "on", "on", "off")
    engine.apply("npu")
    assert engine.verify() == []
    engine.rollback()
    assert (tree / POWER).read_text() == "off\n"  # our hold dropped (never "on" again)


def test_a_round_trip_from_off_is_byte_exact(tmp_path: Path) -> None:
    tree, engine = vendor(tmp_path, "off", "suspended")
    before = snapshot(tree)
    engine.apply("npu")
    assert ((tree / POWER).read_text(), (tree / STATUS).read_text()) == ("on\n", "active\n")
    assert engine.verify() == []
    engine.rollback()
    assert snapshot(tree) == before


def test_verify_checks_the_hold_not_the_word(tmp_path: Path) -> None:
    tree, engine = vendor(tmp_path, "off", "suspended")
    engine.apply("npu")
    (tree / STATUS).write_text("suspended\n")  # the word says on, the device is off
    [(change, actual)] = engine.verify()
    assert change.path == f"/{POWER}" and actual == "on, but runtime_status suspended"


def test_off_while_a_job_holds_power_plans_nothing(tmp_path: Path) -> None:
    _tree, engine = vendor(tmp_path, "on", "active", "rknpu: {power: off}\n")
    plan = engine.plan("npu")
    assert plan.changes == []
    assert any(w.startswith("rknpu.power: off: nothing planned") for w in plan.warnings)


def rocket(tmp_path: Path) -> Path:
    """The committed mainline tree: each rocket core has its runtime PM files (control auto,
    autosuspend_delay_ms 50 from rocket_core_init, suspended while idle)."""
    return copy_board("rk3588-mainline", tmp_path)


def test_rocket_cores_without_runtime_pm_files_are_skipped(tmp_path: Path) -> None:
    """A kernel without CONFIG_PM has no power/ directory: the inherited keys are skipped."""
    tree = rocket(tmp_path)
    for unit in CORES:
        shutil.rmtree(tree / f"sys/devices/platform/{unit}.npu/power")
    write_profile(tmp_path / "profiles", "npu", "include: [rk3588-latency]\n")
    plan = engine_for(tree, tmp_path / "state", [REPO_PROFILES, tmp_path / "profiles"]).plan(
        "npu")
    assert not [c for c in plan.changes if c.tuner == "rknpu"]
    assert any(w.startswith("rknpu.power_off_delay_ms: skipped:") and
               "the core has no runtime PM attributes" in w for w in plan.warnings)


def test_rocket_cores_are_kept_resumed_with_a_long_autosuspend(tmp_path: Path) -> None:
    tree = rocket(tmp_path)
    write_profile(tmp_path / "profiles", "npu",
                  "rknpu: {power: on, power_off_delay_ms: 600000}\n")
    engine = engine_for(tree, tmp_path / "state", [tmp_path / "profiles"])
    before = snapshot(tree)
    plan = engine.plan("npu")
    assert [(c.path.split("/")[4], c.path.rsplit("/", 1)[1], c.current, c.desired)
            for c in plan.changes] == [
        (f"{unit}.npu", name, current, desired) for unit in CORES
        for name, current, desired in (("control", "auto", "on"),
                                       ("autosuspend_delay_ms", "50", "600000"))]
    engine.apply("npu")
    assert engine.verify() == []
    engine.rollback()
    assert snapshot(tree) == before


def test_rk3588_latency_on_mainline_sets_the_rocket_delay_and_the_gpu_floor(tmp_path: Path) -> None:
    engine = engine_for(rocket(tmp_path), tmp_path / "state")
    plan = engine.plan("rk3588-latency")
    assert [c.desired for c in plan.changes if c.key == "rknpu.power_off_delay_ms"] == [
        "600000"] * 3
    # and Panthor's floor at its top step, removed again by rollback (0: no floor)
    [gpu] = [c for c in plan.changes if c.key == "dvfs.gpu"]
    assert (gpu.path, gpu.desired, gpu.restore_value) == (
        "/sys/class/devfreq/fb000000.gpu/min_freq", "1000000000", "0")


def test_the_fixture_kernel_refuses_what_runtime_pm_refuses(tmp_path: Path) -> None:
    root = Root(rocket(tmp_path))
    for name, bad in (("control", "off"), ("autosuspend_delay_ms", "soon")):
        with pytest.raises(OSError) as caught:
            root.write_text(f"/sys/devices/platform/fdab0000.npu/power/{name}", bad)
        assert caught.value.errno == errno.EINVAL
