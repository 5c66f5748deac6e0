"""cpuidle through PM QoS: per-CPU resume latency on the inference cores, and the service's
/dev/cpu_dma_latency hold, planned, applied, verified and rolled back byte-exact."""

from __future__ import annotations

import errno
import struct
from pathlib import Path

import pytest
from tuning_helpers import (
    BOARDS,
    FIXTURES,
    REPO_PROFILES,
    copy_board,
    engine_for,
    snapshot,
    write_profile,
)

from agent.discovery import discover
from agent.kernel.attributes import emulate_attribute_write
from agent.kernel.fsroot import Root
from agent.kernel.pm_qos import DMA_LATENCY, LatencyHold, resume_latency_value
from agent.service.tuning import Tuning
from agent.tuning.engine import Engine

LATENCY = "power/pm_qos_resume_latency_us"
DEFAULT = struct.pack("=i", 2_000_000_000)  # PM_QOS_CPU_LATENCY_DEFAULT_VALUE


@pytest.mark.parametrize(("written", "reads"), [
    ("0", b"0\n"),  # 0 is "no constraint", shown as 0
    ("n/a", b"n/a\n"),  # no latency tolerated
    ("100", b"100\n"), ("0x10", b"16\n"), ("010", b"8\n"),  # kstrtos32 with base 0
    ("2147483646", b"2147483646\n")])
def test_resume_latency_reads_back_as_the_kernel_shows_it(written: str, reads: bytes) -> None:
    path = f"/sys/devices/system/cpu/cpu0/{LATENCY}"
    assert emulate_attribute_write(b"0\n", written, path) == reads


@pytest.mark.parametrize("written", ["-1", "2147483647", "abc", "", "1_0", "0o7"])
def test_resume_latency_refuses_what_the_kernel_refuses(written: str) -> None:
    with pytest.raises(OSError) as error:
        emulate_attribute_write(b"0\n", written, f"/sys/devices/system/cpu/cpu3/{LATENCY}")
    assert error.value.errno == errno.EINVAL


def test_a_bound_of_zero_is_written_as_na() -> None:
    assert (resume_latency_value(0), resume_latency_value(120)) == ("n/a", "120")
    with pytest.raises(ValueError):
        resume_latency_value(-1)


@pytest.mark.parametrize("board", BOARDS)
def test_every_cpu_has_an_unconstrained_resume_latency(board: str) -> None:
    cpu = FIXTURES / board / "sys/devices/system/cpu"
    present = Root(FIXTURES / board).read_text("/sys/devices/system/cpu/present").strip()
    files = sorted(cpu.glob(f"cpu[0-9]*/{LATENCY}"))
    assert files and all(f.read_text() == "0\n" for f in files)
    assert len(files) == int(present.split("-")[-1]) + 1
    assert (FIXTURES / board / "dev/cpu_dma_latency").read_bytes() == DEFAULT


def _engine(board: str, tmp_path: Path, text: str | None = None) -> tuple[Path, Engine]:
    tree = copy_board(board, tmp_path)
    profiles = tmp_path / "profiles"
    write_profile(profiles, "idle", text or "cpuidle: {disable_deeper_than_us: 100}\n")
    return tree, engine_for(tree, tmp_path / "state", [REPO_PROFILES, profiles])


def _latencies(tree: Path) -> dict[int, str]:
    cpu = tree / "sys/devices/system/cpu"
    return {int(f.parts[-3][3:]): f.read_text().strip() for f in cpu.glob(f"cpu[0-9]*/{LATENCY}")}


def test_latency_profile_bounds_only_the_inference_cores(tmp_path: Path) -> None:
    tree, engine = _engine("rk3588-vendor", tmp_path)
    before = snapshot(tree)
    plan = engine.plan("rk3588-latency")
    changes = [c for c in plan.changes if c.tuner == "cpuidle"]
    assert [c.path for c in changes] == [
        f"/sys/devices/system/cpu/cpu{n}/{LATENCY}" for n in (4, 5, 6, 7)]
    assert changes[0].note == ("cpu-sleep avoided (exit latency > 100 us) on the inference "
                               "cores 4-7 (rt.inference.cpus)")
    assert not any(c.path.endswith("/disable") for c in plan.changes)
    engine.apply("rk3588-latency")
    assert _latencies(tree) == {0: "0", 1: "0", 2: "0", 3: "0", 4: "100", 5: "100", 6: "100",
                                7: "100"}
    assert engine.verify() == []
    engine.rollback()
    assert snapshot(tree) == before


def test_without_rt_inference_every_online_cpu_is_bounded(tmp_path: Path) -> None:
    tree, engine = _engine("jetson-agx-orin-jp6", tmp_path)
    before = snapshot(tree)
    plan = engine.plan("idle")
    assert [c.path.split("/")[5] for c in plan.changes] == [f"cpu{n}" for n in range(8)]
    assert plan.changes[0].note == ("c7 avoided (exit latency > 100 us) on every online CPU, "
                                    "0-7 (no rt.inference.cpus)")
    engine.apply("idle")
    assert set(_latencies(tree).values()) == {"100", "0"}  # cpu8-11 are offline: untouched
    assert _latencies(tree)[9] == "0"
    assert engine.verify() == []
    engine.rollback()
    assert snapshot(tree) == before


def test_x86_keeps_c1(tmp_path: Path) -> None:
    _tree, engine = _engine("x86-edge-npu", tmp_path, "cpuidle: {disable_deeper_than_us: 0}\n")
    plan = engine.plan("idle")
    assert {c.desired for c in plan.changes} == {"1"}  # C1's exit latency, not POLL only
    assert "cpuidle.disable_deeper_than_us: 0 us raised to 1 us, the exit latency of C1_ACPI " \
        "(x86: below it only POLL is left, idle=poll behaviour; TuneD keeps C1)" in plan.warnings


def test_state_zero_is_never_forbidden(tmp_path: Path) -> None:
    _tree, engine = _engine("rk3588-mainline", tmp_path,
                            "cpuidle: {disable_deeper_than_us: 0}\n")
    plan = engine.plan("idle")
    assert {c.desired for c in plan.changes} == {"1"}
    assert any("raised to 1 us, the exit latency of WFI, state 0" in w for w in plan.warnings)


def test_zero_us_is_written_as_na_and_restored_as_zero(tmp_path: Path) -> None:
    tree = copy_board("rk3588-vendor", tmp_path)
    for state0 in (tree / "sys/devices/system/cpu").glob("cpu*/cpuidle/state0/latency"):
        state0.write_text("0\n")  # a WFI state with no exit latency: 0 us is a real bound
    before = snapshot(tree)
    profiles = tmp_path / "profiles"
    write_profile(profiles, "idle", "cpuidle: {disable_deeper_than_us: 0}\n")
    engine = engine_for(tree, tmp_path / "state", [profiles])
    plan = engine.plan("idle")
    assert {c.desired for c in plan.changes} == {"n/a"}
    assert not any("raised" in w for w in plan.warnings)
    engine.apply("idle")
    assert set(_latencies(tree).values()) == {"n/a"}
    assert engine.verify() == []
    engine.rollback()
    assert snapshot(tree) == before


def test_switch_to_a_profile_without_cpuidle_restores_the_latencies(tmp_path: Path) -> None:
    tree, engine = _engine("rk3588-mainline", tmp_path)
    before = snapshot(tree)
    engine.apply("rk3588-latency")
    engine.apply("balanced")
    assert set(_latencies(tree).values()) == {"0"}
    assert engine.verify() == []
    engine.rollback()
    assert snapshot(tree) == before


# -- /dev/cpu_dma_latency -------------------------------------------------------------------


def test_a_hold_writes_an_s32_and_release_drops_it(tmp_path: Path) -> None:
    tree = copy_board("bare-vm", tmp_path)
    hold = LatencyHold(Root(tree), 20)
    assert (tree / "dev/cpu_dma_latency").read_bytes() == struct.pack("=i", 20)
    assert hold.held
    tighter = LatencyHold(Root(tree), 5)  # the device reads the lowest request
    assert (tree / "dev/cpu_dma_latency").read_bytes() == struct.pack("=i", 5)
    tighter.release()
    assert (tree / "dev/cpu_dma_latency").read_bytes() == struct.pack("=i", 20)
    hold.release()
    hold.release()  # idempotent
    assert not hold.held
    assert (tree / "dev/cpu_dma_latency").read_bytes() == DEFAULT


def test_a_missing_device_raises(tmp_path: Path) -> None:
    tree = copy_board("bare-vm", tmp_path)
    (tree / "dev/cpu_dma_latency").unlink()
    with pytest.raises(FileNotFoundError):
        LatencyHold(Root(tree), 20)


def test_plan_puts_the_hold_in_runtime_and_says_who_holds_it(tmp_path: Path) -> None:
    tree, engine = _engine("x86-server-nvidia", tmp_path, "cpuidle: {dma_latency_us: 0}\n")
    before = snapshot(tree)
    plan = engine.plan("idle")
    assert plan.runtime == {"dma_latency_us": 1}  # C1 kept
    assert plan.changes == []
    assert any(w.startswith("cpuidle.dma_latency_us: 1 us system-wide: the service "
                            "(edge-agent run) holds /dev/cpu_dma_latency") for w in plan.warnings)
    engine.apply("idle")  # the engine (and the CLI) hold nothing
    assert snapshot(tree) == before


def test_plan_warns_when_the_device_is_missing(tmp_path: Path) -> None:
    tree, engine = _engine("bare-vm", tmp_path, "cpuidle: {dma_latency_us: 50}\n")
    (tree / "dev/cpu_dma_latency").unlink()
    plan = engine.plan("idle")
    assert plan.runtime == {}
    assert "cpuidle.dma_latency_us: skipped: /dev/cpu_dma_latency does not exist (a kernel " \
        "without CONFIG_CPU_IDLE); nothing holds the CPU latency" in plan.warnings


def _service(tmp_path: Path, board: str = "rk3588-vendor") -> tuple[Path, Tuning]:
    tree = copy_board(board, tmp_path)
    root = Root(tree)
    profiles = tmp_path / "profiles"
    write_profile(profiles, "held", "include: [rk3588-latency]\ncpuidle: {dma_latency_us: 50}\n")
    write_profile(profiles, "tighter", "cpuidle: {dma_latency_us: 10}\n")
    tuning = Tuning(root, discover(root), tmp_path / "state", "held", True,
                    lambda kind, **fields: None)
    tuning.engine.store.dirs = [REPO_PROFILES, profiles]
    return tree, tuning


def _device(tree: Path) -> int:
    value: int = struct.unpack("=i", (tree / DMA_LATENCY.lstrip("/")).read_bytes())[0]
    return value


def test_the_service_holds_while_applied_and_releases_on_rollback(tmp_path: Path) -> None:
    tree, tuning = _service(tmp_path)
    before = snapshot(tree)
    tuning.start()
    assert tuning.error is None and tuning.applied
    assert _device(tree) == 50
    assert tuning.metrics()["dma_latency_us"] == 50
    assert tuning.drift == 0
    tuning.rollback()
    assert _device(tree) == 2_000_000_000
    assert tuning.metrics()["dma_latency_us"] is None
    assert snapshot(tree) == before


def test_the_service_moves_the_hold_on_switch_and_drops_it_for_a_profile_without(
        tmp_path: Path) -> None:
    tree, tuning = _service(tmp_path)
    before = snapshot(tree)
    tuning.start()
    tuning.switch("tighter")
    assert _device(tree) == 10
    tuning.switch("balanced")  # asks for no hold
    assert _device(tree) == 2_000_000_000
    assert tuning.metrics()["dma_latency_us"] is None
    tuning.rollback()
    assert snapshot(tree) == before


def test_the_service_releases_on_stop(tmp_path: Path) -> None:
    class Ending:
        rollback = False

    tree, tuning = _service(tmp_path)
    tuning.start()
    tuning.stop(Ending())  # type: ignore[arg-type]
    assert _device(tree) == 2_000_000_000
    assert tuning.applied  # the sysfs settings stay, as asked; the hold dies with the process


def test_a_device_that_cannot_be_held_is_a_clear_warning(tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture
                                                         ) -> None:
    tree, tuning = _service(tmp_path)
    device = tree / "dev/cpu_dma_latency"
    device.unlink()
    device.mkdir()  # exists, so the plan keeps the hold, but it cannot be opened for writing
    tuning.start()
    assert tuning.applied and tuning.error is None  # the rest of the profile stands
    assert tuning.hold_warning is not None
    assert tuning.hold_warning.startswith("cpuidle.dma_latency_us: /dev/cpu_dma_latency cannot "
                                          "be held (Is a directory)")
    assert tuning.hold_warning in caplog.text


def _without_pm_qos(tmp_path: Path, board: str, disable_files: bool = True) -> Path:
    """A board whose kernel has no per-CPU PM QoS file (CONFIG_PM off): and, unless
    ``disable_files``, no cpuidle ``stateK/disable`` either."""
    tree = copy_board(board, tmp_path)
    for path in tree.glob(f"sys/devices/system/cpu/cpu*/{LATENCY}"):
        path.unlink()
    if not disable_files:
        for path in tree.glob("sys/devices/system/cpu/cpu*/cpuidle/state*/disable"):
            path.unlink()
    return tree


def test_without_pm_qos_the_deeper_states_are_disabled_per_cpu(tmp_path: Path) -> None:
    """latency on the vendor RK3588 without CONFIG_PM: the big cores' state1 (cpu-sleep,
    above 100 us) is disabled on cpu4-7 only, verified, and rolled back byte-exact."""
    tree = _without_pm_qos(tmp_path, "rk3588-vendor")
    before = snapshot(tree)
    engine = engine_for(tree, tmp_path / "state")
    plan = engine.plan("latency")
    cpuidle = {c.path: (c.current, c.desired) for c in plan.changes if c.tuner == "cpuidle"}
    assert cpuidle == {f"/sys/devices/system/cpu/cpu{cpu}/cpuidle/state1/disable": ("0", "1")
                       for cpu in (4, 5, 6, 7)}
    assert any("CPUs 4-7 have no power/pm_qos_resume_latency_us" in w for w in plan.warnings)
    assert "dma_latency_us" not in plan.runtime
    engine.apply("latency")
    assert (tree / "sys/devices/system/cpu/cpu4/cpuidle/state1/disable").read_text() == "1\n"
    assert (tree / "sys/devices/system/cpu/cpu0/cpuidle/state1/disable").read_text() == "0\n"
    assert engine.verify() == []
    engine.rollback()
    assert snapshot(tree) == before


def test_without_pm_qos_or_disable_files_the_service_holds_dma_latency(tmp_path: Path) -> None:
    tree = _without_pm_qos(tmp_path, "x86-edge-npu", disable_files=False)
    plan = engine_for(tree, tmp_path / "state").plan("latency", force=True)
    assert [c for c in plan.changes if c.tuner == "cpuidle"] == []
    assert plan.runtime["dma_latency_us"] == 100
    assert any(w.startswith("cpuidle.disable_deeper_than_us: CPUs 1-11 have neither "
                            "power/pm_qos_resume_latency_us nor cpuidle stateK/disable: the "
                            f"service holds {DMA_LATENCY} at 100 us") for w in plan.warnings)
