"""The safety rules of tuning: a housekeeping CPU in every RT plan, and knobs a kernel lacks.

Reasons, from the kernel's documentation:
- Documentation/scheduler/sched-rt-group.rst: RT throttling (sched_rt_runtime_us, 950000 of
  1000000 by default) exists so "a run-away realtime task will not lock up the machine"; -1
  turns it off, so only CPUs without RT threads still serve everything else.
- Documentation/core-api/irq/irq-affinity.rst: smp_affinity_list steers a device IRQ; on the
  housekeeping CPUs it does not preempt the RT inference threads.
- Documentation/admin-guide/mm/transhuge.rst: /sys/kernel/mm/transparent_hugepage exists only
  on kernels built with CONFIG_TRANSPARENT_HUGEPAGE.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from cli_helpers import edge_agent
from tuning_helpers import (
    BOARDS,
    FIXTURES,
    REPO_PROFILES,
    SharedBoard,
    copy_board,
    engine_for,
    plan_engine,
    snapshot,
)

from agent.kernel.irqs import MANAGED
from agent.tuning.errors import ProfileError
from agent.tuning.journal import FILE_NAME
from agent.tuning.plan import Plan

XAVIER = "jetson-xavier-nx-jp5-rt"
SHIPPED = sorted(p.stem for p in REPO_PROFILES.glob("*.yaml"))
THP = "/sys/kernel/mm/transparent_hugepage"


def plan_of(board: str, profile: str, tmp_path: Path, dirs: list[Path] | None = None) -> Plan:
    """A plan on the committed tree itself: planning writes nothing."""
    engine = engine_for(FIXTURES / board, tmp_path / "state", dirs and [*dirs, REPO_PROFILES])
    return engine.plan(profile, force=True)


@pytest.mark.parametrize("board", BOARDS)
@pytest.mark.parametrize("profile", SHIPPED)
def test_every_rt_plan_keeps_a_housekeeping_cpu(board: str, profile: str,
                                                tmp_path: Path) -> None:
    engine = engine_for(FIXTURES / board, tmp_path / "state")
    loaded = engine.store.load(profile)
    if not loaded.matches(engine.topology.board):
        pytest.skip(f"{profile} is for another board")
    plan = engine.plan(profile)
    inference = plan.runtime.get("inference", {})
    if "rt" not in loaded.settings:
        assert plan.cpus == {}
        return
    housekeeping = set(plan.cpus["housekeeping"])
    assert housekeeping, "an RT plan always keeps a housekeeping CPU"
    if inference.get("policy") in ("fifo", "rr"):
        assert set(inference["cpus"]) and not set(inference["cpus"]) & housekeeping
        assert plan.cpus["inference"] == inference["cpus"]
    if "irqs" in plan.cpus and profile == "realtime":
        assert set(plan.cpus["irqs"]) == housekeeping
    runtime = [c for c in plan.changes if c.path.endswith("sched_rt_runtime_us")]
    assert all(c.desired != "-1" for c in runtime) or housekeeping


# (housekeeping, inference, IRQs) as the plan prints them, per board class
RESOLVED = {
    # uniform; cpu8-11 offline, so not planned (test_rt_isolation: offline CPUs)
    ("jetson-agx-orin-jp6", "latency"): ("0", "1-7", None),
    ("jetson-agx-orin-jp6", "realtime"): ("0", "1-7", "0"),
    ("jetson-orin-nano-jp6", "realtime"): ("0", "1-5", "0"),
    (XAVIER, "latency"): ("0", "1-5", None),
    (XAVIER, "realtime"): ("0", "1-5", "0"),
    ("jetson-agx-orin-jp6", "jetson-orin-latency"): ("0", "1-7", None),
    ("jetson-agx-orin-jp6", "jetson-orin"): ("0", "0-7", None),  # SCHED_OTHER: every online CPU
    ("rk3588-vendor", "latency"): ("0-3", "4-7", None),  # big.LITTLE: the A55s keep house
    ("rk3588-vendor", "realtime"): ("0-3", "4-7", "0-3"),
    ("rk3588-mainline", "realtime"): ("0-3", "4-7", "0-3"),
    ("rk3588-vendor", "rk3588-latency"): ("0-3", "4-7", "0-3"),
    ("x86-server-nvidia", "latency"): ("0", "1-15", None),
    ("x86-server-nvidia", "realtime"): ("0", "1-15", "0"),
    ("x86-edge-npu", "latency"): ("0", "1-11", None),  # E-cores 12-15 are isolcpus
    ("x86-edge-npu", "realtime"): ("0", "1-11", "0"),
    ("bare-vm", "realtime"): ("0", "1", "0"),
}


@pytest.mark.parametrize(("board", "profile"), sorted(RESOLVED))
def test_resolved_cpu_sets(board: str, profile: str, tmp_path: Path) -> None:
    housekeeping, inference, irqs = RESOLVED[(board, profile)]
    cpus = plan_of(board, profile, tmp_path).to_dict()["cpus"]
    # realtime moves the unbound workqueues to the housekeeping CPUs (every tree has the
    # workqueue cpumask, as every kernel with sysfs workqueues does)
    assert cpus == {"housekeeping": housekeeping, "inference": inference,
                    **({"irqs": irqs} if irqs else {}),
                    **({"workqueue": housekeeping} if profile == "realtime" else {})}


def profile_dir(tmp_path: Path, name: str, text: str) -> list[Path]:
    directory = tmp_path / "profiles"
    directory.mkdir(exist_ok=True)
    (directory / f"{name}.yaml").write_text(text)
    return [directory]


def test_housekeeping_cpus_from_the_profile(tmp_path: Path) -> None:
    dirs = profile_dir(tmp_path, "hk", "include: [realtime]\nrt: {housekeeping_cpus: "
                       "cpus:0-1}\n")
    plan = plan_of("x86-server-nvidia", "hk", tmp_path, dirs)
    assert plan.to_dict()["cpus"] == {"housekeeping": "0-1", "inference": "2-15",
                                      "workqueue": "0-1", "irqs": "0-1"}
    irq = next(c for c in plan.changes if c.path.startswith("/proc/irq/"))
    assert irq.desired == "0-1"


@pytest.mark.parametrize(("text", "key", "words"), [
    ("rt: {housekeeping_cpus: all, inference: {policy: fifo, priority: 10}}",
     "rt.inference.cpus", "0-11, whose online CPUs are all housekeeping CPUs (0-7)"),
    ("rt: {housekeeping_cpus: cpus:8-11}", "rt.housekeeping_cpus",
     "8-11 holds no online CPU (online: 0-7)"),
    ("rt: {inference: {policy: rr, priority: 5, cpus: cpus:0}}", "rt.inference.cpus",
     "a rr thread needs an online CPU outside rt.housekeeping_cpus"),
])
def test_rt_threads_never_take_every_housekeeping_cpu(text: str, key: str, words: str,
                                                      tmp_path: Path) -> None:
    error = planning_error("jetson-agx-orin-jp6", text, tmp_path)
    assert error.key == key and words in error.message


def planning_error(board: str, text: str, tmp_path: Path) -> ProfileError:
    """The error of planning a profile ``text``, which names that profile's file."""
    dirs = profile_dir(tmp_path, "mine", text + "\n")
    with pytest.raises(ProfileError) as error:
        plan_of(board, "mine", tmp_path, dirs)
    assert error.value.file == str(dirs[0] / "mine.yaml")
    return error.value


def test_housekeeping_is_not_its_own_definition(tmp_path: Path) -> None:
    dirs = profile_dir(tmp_path, "loop", "rt: {housekeeping_cpus: housekeeping}\n")
    with pytest.raises(ProfileError, match=r"rt.housekeeping_cpus: 'housekeeping' is not "
                       "allowed: expected a CPU set other than housekeeping"):
        plan_of("bare-vm", "loop", tmp_path, dirs)


def test_no_rt_throttling_without_a_housekeeping_cpu(tmp_path: Path,
                                                    shared_board: SharedBoard) -> None:
    """Only when no CPU is known online: throttling stays on and the plan says why."""
    engine = plan_engine(shared_board("rk3588-vendor"), tmp_path / "state")  # 6.1
    cpu = dataclasses.replace(engine.topology.cpu, online=[])
    engine.topology = dataclasses.replace(engine.topology, cpu=cpu)
    dirs = profile_dir(tmp_path, "unsafe", "rt: {sched_rt_runtime_us: -1}\n")
    engine.store.dirs = [*dirs, REPO_PROFILES]
    plan = engine.plan("unsafe")
    assert plan.changes == []
    assert any(w.startswith("rt.sched_rt_runtime_us: -1 skipped, RT throttling stays on "
                            "(950000 of 1000000 us)") for w in plan.warnings)


def test_plan_prints_the_cpu_sets(tmp_path: Path) -> None:
    tree = copy_board("rk3588-vendor", tmp_path)
    base = ["profile", "plan", "realtime", "--root", str(tree), "--force"]
    done = edge_agent(*base)  # in this process (tests/cli_helpers.py)
    assert done.returncode == 0, done.stderr
    assert "  cpus     housekeeping 0-3, inference 4-7, workqueue 0-3, irqs 0-3\n" \
        in done.stdout
    as_json = edge_agent(*base, "--json")
    assert as_json.returncode == 0, as_json.stderr
    data = json.loads(as_json.stdout)
    assert data["cpus"] == {"housekeeping": "0-3", "inference": "4-7", "workqueue": "0-3",
                            "irqs": "0-3"}


# -- a kernel without THP ---------------------------------------------------------------


@pytest.mark.parametrize("profile", SHIPPED)
def test_every_shipped_profile_round_trips_on_an_rt_kernel_without_thp(
        profile: str, tmp_path: Path) -> None:
    tree = copy_board(XAVIER, tmp_path)
    assert not (tree / THP.lstrip("/")).exists()
    before = snapshot(tree)
    engine = engine_for(tree, tmp_path / "state")
    plan = engine.plan(profile, force=True)
    assert not [c for c in plan.changes if c.tuner == "thp"]
    assert "thp_dynamic" not in plan.runtime
    result = engine.apply(profile, force=True)
    # only the NVMe I/O queue's managed IRQ is refused (EIO), as the kernel refuses it
    nvme = "/proc/irq/301/smp_affinity_list"
    assert result.skipped == ([f"{nvme}: {MANAGED}"] if any(
        c.path == nvme for c in plan.changes) else [])
    assert len(result.written) == len(plan.changes) - len(result.skipped)
    assert engine.verify() == []
    assert engine.rollback()[0] == profile
    assert snapshot(tree) == before
    assert not (tmp_path / "state" / FILE_NAME).exists()


def test_inherited_thp_settings_are_skipped_with_a_warning(tmp_path: Path) -> None:
    plan = plan_of(XAVIER, "realtime", tmp_path)
    skipped = [w for w in plan.warnings if w.startswith("thp.")]
    assert [w.split(":")[0] for w in skipped] == ["thp.enabled", "thp.defrag",
                                                  "thp.khugepaged_defrag", "thp.dynamic"]
    assert f"{THP}/enabled does not exist on this device: this kernel is built without " \
        "transparent huge pages" in skipped[0]
    assert plan.to_dict()["cpus"] == {"housekeeping": "0", "inference": "1-5",
                                      "workqueue": "0", "irqs": "0"}
    runtime = [c for c in plan.changes if c.path.endswith("sched_rt_runtime_us")]
    assert runtime == []  # nothing is isolated: RT throttling stays on (test_rt_isolation)


@pytest.mark.parametrize(("text", "key", "allowed"), [
    ("thp: {enabled: never}", "thp.enabled", "allowed: always, madvise, never"),
    ("include: [balanced]\nthp: {defrag: defer}", "thp.defrag",
     "allowed: always, defer, defer+madvise, madvise, never"),
    ("thp: {dynamic: {disable_above_psi_some_avg10: 20}}", "thp.dynamic",
     "allowed: the dynamic controller on a kernel with THP only"),
])
def test_an_explicit_thp_setting_is_an_error_without_thp(text: str, key: str, allowed: str,
                                                         tmp_path: Path) -> None:
    error = planning_error(XAVIER, text, tmp_path)
    assert error.key == key
    assert allowed in error.message and "list thp under optional" in error.message


def test_optional_marks_a_setting_the_kernel_may_lack(tmp_path: Path) -> None:
    dirs = profile_dir(tmp_path, "mine", "optional: [thp.enabled]\nthp: {enabled: never}\n")
    plan = plan_of(XAVIER, "mine", tmp_path, dirs)
    assert plan.changes == [] and plan.warnings[0].startswith("thp.enabled: skipped: ")
    # on a kernel with THP the same profile applies it
    plan = plan_of("x86-server-nvidia", "mine", tmp_path / "x86", dirs)
    assert [(c.path, c.desired) for c in plan.changes] == [(f"{THP}/enabled", "never")]


def test_an_explicit_missing_knob_is_a_usage_error_without_traceback(tmp_path: Path) -> None:
    tree = copy_board(XAVIER, tmp_path)
    site = tree / "etc/edge-agent/profiles"
    site.mkdir(parents=True)
    (site / "nothp.yaml").write_text("thp: {enabled: never}\n")
    done = edge_agent("profile", "plan", "nothp", "--root", tree)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "/etc/edge-agent/profiles/nothp.yaml: thp.enabled: " \
        f"{THP}/enabled does not exist on this device" in done.stderr
