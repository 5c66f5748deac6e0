"""RK3588 DMC/rknpu/ASPM, sysctl beyond vm.*, governor fallbacks, EPP/boost/no_turbo, clamped
DVFS minimums and Armbian's boot services: plan, apply, verify, rollback on fixture copies."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
from tuning_helpers import (
    REPO_PROFILES,
    SharedBoard,
    copy_board,
    engine_for,
    plan_engine,
    snapshot,
    write_profile,
)

from agent.kernel.fsroot import Root
from agent.tuning.engine import TuningError
from agent.tuning.errors import ProfileError

CPUFREQ = "sys/devices/system/cpu/cpufreq"


def _round_trip(tmp_path: Path, board: str, text: str) -> tuple[Path, dict[str, str]]:
    """Apply a profile on a copy, check verify, roll back byte-exact; returns the writes."""
    tree = copy_board(board, tmp_path)
    before = snapshot(tree)
    profiles = tmp_path / "profiles"
    write_profile(profiles, "t", text)
    engine = engine_for(tree, tmp_path / "state", [profiles, REPO_PROFILES])
    result = engine.apply("t", force=True)
    written = {c.path: (tree / c.path.lstrip("/")).read_text() for c in result.written}
    assert engine.verify() == []
    engine.rollback()
    assert snapshot(tree) == before
    return tree, written


def _plan_error(shared_board: SharedBoard, tmp_path: Path, board: str, text: str) -> str:
    tree = shared_board(board)
    profiles = tmp_path / "profiles"
    path = write_profile(profiles, "bad", text)
    with pytest.raises(ProfileError) as error:
        plan_engine(tree, tmp_path / "state", [profiles]).plan("bad", force=True)
    message = str(error.value)
    assert message.startswith(f"{path}: ")
    return message


def test_rk3588_latency_on_the_vendor_kernel(tmp_path: Path) -> None:
    _, written = _round_trip(tmp_path, "rk3588-vendor", "include: [rk3588-latency]\n")
    assert written["/sys/class/devfreq/dmc/governor"] == "performance\n"
    assert written["/sys/kernel/debug/rknpu/delayms"] == "600000\n"
    assert written["/sys/module/pcie_aspm/parameters/policy"] == \
        "default [performance] powersave powersupersave \n"


def test_rk3588_latency_on_mainline_skips_what_it_lacks(tmp_path: Path,
                                                        shared_board: SharedBoard) -> None:
    tree = shared_board("rk3588-mainline")
    engine = plan_engine(tree, tmp_path / "state")
    plan = engine.plan("rk3588-latency")
    text = "\n".join(plan.warnings)
    assert "dvfs.dmc: skipped: this device has no dmc devfreq node" in text
    # no vendor debugfs: the delay goes to each rocket core's runtime PM autosuspend delay
    # (a kernel without them: tests/test_rknpu_power.py)
    assert "rknpu.power_off_delay_ms" not in text
    assert [c.path for c in plan.changes if c.key == "rknpu.power_off_delay_ms"] == [
        f"/sys/devices/platform/{unit}.npu/power/autosuspend_delay_ms"
        for unit in ("fdab0000", "fdac0000", "fdad0000")]
    assert any(c.key == "pcie.aspm_policy" for c in plan.changes)  # mainline has ASPM


def test_an_explicit_dmc_setting_is_an_error_on_mainline(tmp_path: Path,
                                                         shared_board: SharedBoard) -> None:
    message = _plan_error(shared_board, tmp_path,
                          "rk3588-mainline", "dvfs: {dmc: {governor: performance}}\n")
    assert "dvfs.dmc: this device has no dmc devfreq node" in message
    assert "list dvfs under optional" in message


def test_rknpu_power_hold_round_trips(tmp_path: Path) -> None:
    _, written = _round_trip(tmp_path, "rk3588-vendor", "rknpu: {power: on}\n")
    assert written == {"/sys/kernel/debug/rknpu/power": "on\n"}


def test_rknpu_delayms_refuses_a_non_number_like_the_driver(tmp_path: Path) -> None:
    root = Root(copy_board("rk3588-vendor", tmp_path))
    with pytest.raises(OSError) as error:
        root.write_text("/sys/kernel/debug/rknpu/delayms", "soon")
    assert error.value.errno == errno.EFAULT


def test_aspm_disabled_on_the_command_line(tmp_path: Path, shared_board: SharedBoard) -> None:
    """x86-server-nvidia boots with pcie_aspm=off: the kernel answers EPERM."""
    message = _plan_error(shared_board, tmp_path,
                          "x86-server-nvidia", "pcie: {aspm_policy: performance}\n")
    assert "pcie.aspm_policy: ASPM is disabled by pcie_aspm=off" in message
    assert "allowed: default, performance, powersave, powersupersave" in message
    root = Root(copy_board("x86-server-nvidia", tmp_path / "again"))
    with pytest.raises(OSError) as error:
        root.write_text("/sys/module/pcie_aspm/parameters/policy", "performance")
    assert error.value.errno == errno.EPERM


def test_aspm_policy_rejects_unknown_words(tmp_path: Path, shared_board: SharedBoard) -> None:
    message = _plan_error(shared_board, tmp_path, "rk3588-vendor", "pcie: {aspm_policy: fast}\n")
    assert "pcie.aspm_policy" in message and "powersupersave" in message


@pytest.mark.parametrize("board", ["x86-server-nvidia", "x86-edge-npu"])
def test_sysctl_beyond_vm_round_trips(board: str, tmp_path: Path) -> None:
    _, written = _round_trip(tmp_path, board, """
sysctl:
  kernel.timer_migration: 0
  kernel.nmi_watchdog: 0
  net.core.busy_poll: 50
  net.core.busy_read: 50
""")
    assert written["/proc/sys/kernel/timer_migration"] == "0\n"
    assert written["/proc/sys/net/core/busy_read"] == "50\n"


def test_sysctl_a_kernel_lacks_names_the_config(tmp_path: Path, shared_board: SharedBoard) -> None:
    message = _plan_error(shared_board, tmp_path,
                          "rk3588-vendor", "sysctl: {kernel.numa_balancing: 0}\n")
    assert "sysctl.kernel.numa_balancing" in message and "CONFIG_NUMA_BALANCING" in message
    assert "allowed: 0..1" in message


@pytest.mark.parametrize("text, words", [
    ("sysctl: {kernel.timer_migration: 2}\n", "allowed: 0..1"),
    ("sysctl: {kernel.panic: 1}\n", "kernel.timer_migration"),
])
def test_sysctl_refusals_name_the_allowed(text: str, words: str, tmp_path: Path,
                                          shared_board: SharedBoard) -> None:
    assert words in _plan_error(shared_board, tmp_path, "x86-edge-npu", text)


def test_governor_fallbacks_pick_the_first_offered(tmp_path: Path) -> None:
    _tree, written = _round_trip(tmp_path, "x86-edge-npu",
                                "dvfs: {cpu: {all: {governor: schedutil|performance}}}\n")
    assert written[f"/{CPUFREQ}/policy0/scaling_governor"] == "performance\n"  # intel_pstate
    _, written = _round_trip(tmp_path / "rk", "rk3588-vendor",
                             "dvfs: {dmc: {governor: turbo|performance}}\n")
    assert written["/sys/class/devfreq/dmc/governor"] == "performance\n"


def test_no_governor_offered_lists_all(tmp_path: Path, shared_board: SharedBoard) -> None:
    message = _plan_error(shared_board, tmp_path,
                          "x86-edge-npu", "dvfs: {cpu: {all: {governor: a|b}}}\n")
    assert "none of a, b is not available" not in message
    assert "none of a, b" in message and "available: performance, powersave" in message


def test_epp_round_trips_under_powersave(tmp_path: Path) -> None:
    _, written = _round_trip(tmp_path, "x86-edge-npu",
                             "dvfs: {cpu: {all: {epp: performance}}}\n")
    assert written[f"/{CPUFREQ}/policy0/energy_performance_preference"] == "performance\n"


def test_epp_and_performance_governor_order_survives_ebusy(tmp_path: Path) -> None:
    """EPP first, then the governor; rollback in reverse restores EPP under powersave."""
    _tree, written = _round_trip(tmp_path, "x86-edge-npu", """
dvfs: {cpu: {all: {governor: performance, epp: performance}}}
""")
    assert written[f"/{CPUFREQ}/policy0/scaling_governor"] == "performance\n"


def test_epp_other_than_performance_under_performance_is_refused(
        tmp_path: Path, shared_board: SharedBoard) -> None:
    message = _plan_error(shared_board, tmp_path, "x86-edge-npu", """
dvfs: {cpu: {all: {governor: performance, epp: balance_power}}}
""")
    assert "epp: balance_power under the performance governor" in message
    assert "EBUSY" in message


def test_the_fixture_refuses_epp_under_performance_with_ebusy(tmp_path: Path) -> None:
    tree = copy_board("x86-edge-npu", tmp_path)
    root = Root(tree)
    policy = "/sys/devices/system/cpu/cpufreq/policy0"
    root.write_text(f"{policy}/scaling_governor", "performance")
    with pytest.raises(OSError) as error:
        root.write_text(f"{policy}/energy_performance_preference", "power")
    assert error.value.errno == errno.EBUSY


def test_epp_needs_an_active_pstate_driver(tmp_path: Path, shared_board: SharedBoard) -> None:
    message = _plan_error(shared_board, tmp_path,
                          "x86-server-nvidia", "dvfs: {cpu: {all: {epp: power}}}\n")
    assert "scaling_driver acpi-cpufreq" in message and "intel_pstate" in message


def test_boost_and_no_turbo(tmp_path: Path, shared_board: SharedBoard) -> None:
    _, written = _round_trip(tmp_path, "x86-server-nvidia", "dvfs: {boost: 0}\n")
    assert written == {"/sys/devices/system/cpu/cpufreq/boost": "0\n"}
    _, written = _round_trip(tmp_path / "npu", "x86-edge-npu", "dvfs: {no_turbo: 1}\n")
    assert written == {"/sys/devices/system/cpu/intel_pstate/no_turbo": "1\n"}
    message = _plan_error(shared_board, tmp_path / "bad", "x86-edge-npu", "dvfs: {boost: 1}\n")
    assert "dvfs.boost" in message and "use dvfs.no_turbo" in message


def test_a_min_above_the_current_max_is_clamped(tmp_path: Path) -> None:
    """A thermal/power-mode cap on max: min = max is clamped, never written min > max."""
    tree = copy_board("rk3588-vendor", tmp_path)
    capped = tree / CPUFREQ / "policy4/scaling_max_freq"
    capped.write_text("2016000\n")
    profiles = tmp_path / "profiles"
    write_profile(profiles, "pin", "dvfs: {cpu: {cpus:4-5: {min_khz: max}}}\n")
    engine = engine_for(tree, tmp_path / "state", [profiles])
    plan = engine.plan("pin")
    mins = [c for c in plan.changes if c.path.endswith("policy4/scaling_min_freq")]
    assert [c.desired for c in mins] == ["2016000"]
    assert not [c for c in plan.changes if c.path.endswith("policy4/scaling_max_freq")]
    assert any("clamped to 2016000" in w for w in plan.warnings)
    before = snapshot(tree)
    engine.apply("pin")
    assert engine.verify() == []
    engine.rollback()
    assert snapshot(tree) == before


def test_armbian_services_are_named_in_the_plan(tmp_path: Path,
                                                shared_board: SharedBoard) -> None:
    tree = shared_board("rk3588-vendor")
    profiles = tmp_path / "profiles"
    write_profile(profiles, "t", """
dvfs: {cpu: {all: {governor: performance}}}
block: {"nvme*": {scheduler: mq-deadline}}
sysctl: {vm.page-cluster: 0}
rt: {irq_affinity: {"*npu*": housekeeping}}
""")
    plan = plan_engine(tree, tmp_path / "state", [profiles]).plan("t")
    text = "\n".join(plan.warnings)
    assert "rt.irq_affinity" not in text  # the script distributes no IRQs on rockchip-rk3588
    assert "cpufrequtils (/etc/default/cpufrequtils: GOVERNOR=schedutil" in text
    assert "armbian-hardware-optimize.service (Armbian, BOARDFAMILY=rockchip-rk3588) " \
        "rewrites block.nvme*.scheduler" in text
    assert "armbian-zram-config.service (Armbian) sets vm.page-cluster=0" in text


def test_a_masked_armbian_service_is_not_named(tmp_path: Path) -> None:
    tree = copy_board("rk3588-vendor", tmp_path)
    (tree / "etc/systemd/system/armbian-hardware-optimize.service").symlink_to("/dev/null")
    (tree / "etc/default/cpufrequtils").write_text("ENABLE=false\n")
    profiles = tmp_path / "profiles"
    write_profile(profiles, "t", "block: {'nvme*': {scheduler: mq-deadline}}\n"
                  "dvfs: {cpu: {all: {governor: performance}}}\n")
    plan = engine_for(tree, tmp_path / "state", [profiles]).plan("t")
    assert not [w for w in plan.warnings if "armbian" in w or "cpufrequtils" in w]


def test_a_failed_epp_write_rolls_back_the_rest(tmp_path: Path) -> None:
    """A governor someone switched to performance after planning: EBUSY, all undone."""
    tree = copy_board("x86-edge-npu", tmp_path)
    before = snapshot(tree)
    profiles = tmp_path / "profiles"
    write_profile(profiles, "t", "sysctl: {kernel.timer_migration: 0}\n"
                  "dvfs: {cpu: {all: {epp: power}}}\n")
    engine = engine_for(tree, tmp_path / "state", [profiles])
    engine.plan("t")
    original = engine.plan

    def plan_then_race(name: str, force: bool = False, baseline=None):  # type: ignore[no-untyped-def]
        result = original(name, force, baseline)
        (tree / CPUFREQ / "policy3/scaling_governor").write_text("performance\n")
        return result

    engine.plan = plan_then_race  # type: ignore[method-assign]
    with pytest.raises(TuningError) as error:
        engine.apply("t")
    assert "energy_performance_preference" in str(error.value)
    (tree / CPUFREQ / "policy3/scaling_governor").write_text("powersave\n")
    assert snapshot(tree) == before
