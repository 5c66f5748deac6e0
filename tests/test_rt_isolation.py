"""The realtime profile against what the kernel does with it: the default IRQ mask and
``irqaffinity=`` beside it (docs/kernel-facts/rt-irqs.md)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from test_persistent_tuning import board
from tuning_helpers import REPO_PROFILES, copy_board, engine_for, snapshot, write_profile

from agent.discovery import discover
from agent.discovery.udev import HOTPLUG_ACTIONS, HOTPLUG_SUBSYSTEMS
from agent.kernel import irqs
from agent.kernel.fsroot import Root
from agent.kernel.parsers import format_cpulist
from agent.service.tuning import Tuning
from agent.tuning.engine import Engine
from agent.tuning.journal import Journal
from agent.tuning.profiles import ProfileStore
from agent.tuning.tuners import rt_throttle as throttle


def test_realtime_moves_the_default_irq_mask_to_housekeeping(tmp_path: Path) -> None:
    tree = copy_board("rk3588-vendor", tmp_path / "board")
    engine = engine_for(tree, tmp_path / "state", [REPO_PROFILES])
    before = snapshot(tree)
    plan = engine.plan("realtime")
    (change,) = [c for c in plan.changes if c.path == irqs.DEFAULT_AFFINITY]
    assert change.desired == "0-3"  # the little cores: housekeeping on a RK3588
    engine.apply("realtime")
    assert (tree / "proc/irq/default_smp_affinity").read_text() == "0f\n"
    assert engine.verify() == []
    engine.rollback()
    assert snapshot(tree) == before


def test_a_profile_with_kernel_arguments_gets_irqaffinity_too(tmp_path: Path) -> None:
    tree = board("jetson-extlinux", tmp_path)
    write_profile(tmp_path / "profiles", "rt-boot",
                  "include: [realtime]\ncmdline: {nohz_full: cpus:4-5}\n")
    engine = engine_for(tree, tmp_path / "state", [REPO_PROFILES, tmp_path / "profiles"])
    by_path = {c.path: c for c in engine.plan("rt-boot").changes}
    assert by_path["cmdline:irqaffinity"].desired == "irqaffinity=0"
    assert by_path[irqs.DEFAULT_AFFINITY].desired == "0"
    # without a cmdline section the boot config is left alone
    assert not [c for c in engine.plan("realtime").changes if c.tuner == "cmdline"]


# -- RT throttling: on unless the inference CPUs are isolated (docs/kernel-facts/rt-throttling.md)

RUNTIME = "/proc/sys/kernel/sched_rt_runtime_us"
WORKQUEUE = "sys/devices/virtual/workqueue/cpumask"
ISOLATED = """\
include: [realtime]
rt:
  housekeeping_cpus: cpus:0-3
  inference: {policy: fifo, priority: 80, cpus: cpus:12-15}
  unthrottled_reason: the inference CPUs are isolcpus/nohz_full and nothing else runs there
"""


def _isolated_x86(tmp_path: Path, kthreadd: str = "0-3", profile: str = ISOLATED) -> Path:
    """The N100-class board (isolcpus=nohz_full=12-15, 6.11: before the fair server) with the
    workqueue cpumask and kthreadd as the kernel shows them."""
    tree = copy_board("x86-edge-npu", tmp_path / "board")
    (tree / RUNTIME[1:]).write_text("950000\n")  # the kernel's default (the tree has -1)
    assert (tree / WORKQUEUE).read_text() == "0fff\n"  # isolcpus/nohz_full CPUs left out
    (tree / "proc/2").mkdir(parents=True)
    (tree / "proc/2/status").write_text(f"Name:\tkthreadd\nCpus_allowed_list:\t{kthreadd}\n")
    write_profile(tmp_path / "profiles", "isolated", profile)
    return tree


def _engine(tree: Path, tmp_path: Path):  # type: ignore[no-untyped-def]
    return engine_for(tree, tmp_path / "state", [REPO_PROFILES, tmp_path / "profiles"])


def test_throttling_stays_on_where_nothing_is_isolated(tmp_path: Path) -> None:
    """A kernel without the workqueue cpumask file (a tmp copy without it): rt.workqueue_cpus
    is skipped and the workqueues' CPUs are unknown, so they count against unthrottling."""
    tree = copy_board("jetson-xavier-nx-jp5-rt", tmp_path)  # 5.10 PREEMPT_RT: no fair server
    (tree / WORKQUEUE).unlink()
    plan = engine_for(tree, tmp_path / "state", [REPO_PROFILES]).plan("realtime", force=True)
    assert "rt.workqueue_cpus: skipped: /sys/devices/virtual/workqueue/cpumask does not " \
        "exist here" in plan.warnings
    assert not [c for c in plan.changes if c.path == RUNTIME]
    (warning,) = [w for w in plan.warnings if w.startswith("rt.sched_rt_runtime_us: -1")]
    assert warning.startswith("rt.sched_rt_runtime_us: -1 skipped, RT throttling stays on "
                              "(950000 of 1000000 us): the inference CPUs 1-5 are not "
                              "isolated")
    for missing in ("unbound workqueues run on unknown CPUs", "unbound kthreads (kthreadd",
                    "the profile gives no rt.unthrottled_reason"):
        assert missing in warning
    assert "rt.sched_rt_runtime_us: stalld is not installed: nothing rescues a starved " \
        "kworker on an inference CPU" in plan.warnings


def test_isolated_cpus_with_a_reason_turn_throttling_off_and_back(tmp_path: Path) -> None:
    tree = _isolated_x86(tmp_path)
    engine = _engine(tree, tmp_path)
    before = snapshot(tree)
    plan = engine.plan("isolated")
    by_path = {c.path: c for c in plan.changes}
    assert by_path[RUNTIME].desired == "-1"
    assert by_path[RUNTIME].note == "unthrottled: the inference CPUs are isolcpus/nohz_full " \
        "and nothing else runs there"
    assert by_path[f"/{WORKQUEUE}"].desired == "0-3"
    engine.apply("isolated")
    assert (tree / WORKQUEUE).read_text() == "000f\n"  # %*pb over nr_cpu_ids (16) bits
    assert (tree / RUNTIME[1:]).read_text() == "-1\n"
    assert engine.verify() == []
    engine.rollback()
    assert snapshot(tree) == before


def test_each_missing_condition_keeps_throttling_on(tmp_path: Path) -> None:
    unreasoned = "\n".join(line for line in ISOLATED.splitlines()
                           if "unthrottled_reason" not in line) + "\n"
    tree = _isolated_x86(tmp_path, kthreadd="0-15", profile=unreasoned)
    plan = _engine(tree, tmp_path).plan("isolated")
    assert not [c for c in plan.changes if c.path == RUNTIME]
    (warning,) = [w for w in plan.warnings if w.startswith("rt.sched_rt_runtime_us: -1")]
    assert "are not isolated" not in warning and "workqueues" not in warning
    assert "unbound kthreads (kthreadd, pid 2, and what it starts) run on 0-15" in warning
    assert warning.endswith("the profile gives no rt.unthrottled_reason")


def test_the_fair_server_kernel_skips_minus_one_and_names_a_stopped_server(
        tmp_path: Path) -> None:
    tree = copy_board("rk3588-mainline", tmp_path)  # 6.18: the fair server, no RT throttling
    for cpu, runtime in ((4, 0), (5, 50000000)):
        server = tree / f"sys/kernel/debug/sched/fair_server/cpu{cpu}"
        server.mkdir(parents=True)
        (server / "runtime").write_text(f"{runtime}\n")
        (server / "period").write_text("1000000000\n")
    plan = engine_for(tree, tmp_path / "state", [REPO_PROFILES]).plan("realtime", force=True)
    assert not [c for c in plan.changes if c.path == RUNTIME]
    assert any(w.startswith("rt.sched_rt_runtime_us: skipped: on 6.18.2 (6.12+) RT throttling "
                            "is the fair server") for w in plan.warnings)
    assert any(w.startswith("rt.sched_rt_runtime_us: the fair server of CPU 4 has runtime 0")
               for w in plan.warnings)


def test_stalld_is_named(tmp_path: Path) -> None:
    tree = copy_board("jetson-xavier-nx-jp5-rt", tmp_path)
    unit = tree / "usr/lib/systemd/system/stalld.service"
    unit.parent.mkdir(parents=True, exist_ok=True)
    unit.write_text("[Service]\nExecStart=/usr/bin/stalld\n")
    plan = engine_for(tree, tmp_path / "state", [REPO_PROFILES]).plan("realtime", force=True)
    assert "rt.sched_rt_runtime_us: stalld is installed (/usr/lib/systemd/system/stalld." \
        "service): it boosts threads starved for its threshold, so a starved kworker still " \
        "runs, late" in plan.warnings


def test_inference_above_the_irq_threads_of_its_gpu_is_warned_about(tmp_path: Path) -> None:
    tree = copy_board("jetson-xavier-nx-jp5-rt", tmp_path / "board")
    for name, priority in (("high", 80), ("low", 40)):
        write_profile(tmp_path / "profiles", name, f"rt: {{inference: {{policy: fifo, "
                      f"priority: {priority}, cpus: cluster:big}}}}\n")
    engine = _engine(tree, tmp_path)
    (warning,) = [w for w in engine.plan("high").warnings if w.startswith("rt.inference.prio")]
    assert warning.startswith("rt.inference.priority: 80 is not below the PREEMPT_RT IRQ "
                              "threads (SCHED_FIFO 50) of the devices inference waits on, and "
                              "irq/98-17000000.gv11b_stall, irq/99-17000000.gv11b_nonstall "
                              "may run on the inference CPUs 1-5")
    assert not [w for w in engine.plan("low").warnings if w.startswith("rt.inference.prio")]
    # realtime moves the GPU's IRQs to the housekeeping CPU: their threads follow them
    assert not [w for w in engine.plan("realtime").warnings
                if w.startswith("rt.inference.prio")]


# -- offline CPUs in the inference set ------------------------------------------------------


def _xavier_cpu5_offline(tmp_path: Path) -> Path:
    """The Xavier NX in a 4-core nvpmodel mode: cpu5 offline, as the kernel shows it."""
    tree = copy_board("jetson-xavier-nx-jp5-rt", tmp_path / "board")
    cpu = tree / "sys/devices/system/cpu"
    (cpu / "online").write_text("0-4\n")
    (cpu / "offline").write_text("5\n")
    (cpu / "cpu5/online").write_text("0\n")
    return tree


def test_offline_cpus_leave_the_inference_set(tmp_path: Path) -> None:
    tree = _xavier_cpu5_offline(tmp_path)
    engine = engine_for(tree, tmp_path / "state", [REPO_PROFILES])
    plan = engine.plan("realtime", force=True)
    assert plan.runtime["inference"]["cpus"] == [1, 2, 3, 4]
    assert plan.cpus["inference"] == [1, 2, 3, 4]
    assert "rt.inference.cpus: cluster:big includes the offline CPUs 5; the threads run on " \
        "1-4 (planned again when CPUs come online)" in plan.warnings
    assert not [c for c in plan.changes if "/cpu5/" in c.path]  # no PM QoS on an offline CPU
    before = snapshot(tree)
    engine.apply("realtime", force=True)
    assert engine.verify() == []
    engine.rollback()
    assert snapshot(tree) == before


def test_a_cpu_going_offline_replans_the_inference_set(tmp_path: Path) -> None:
    """nvpmodel or hot-plug takes cpu5: its offline uevent (subsystem cpu) leads the
    service to discover again and retarget, and the plan runs inference on 1-4."""
    tree = copy_board("jetson-xavier-nx-jp5-rt", tmp_path / "board")
    root = Root(tree)
    tuning = Tuning(root, discover(root), tmp_path / "state", "realtime", False,
                    lambda kind, **fields: None)
    tuning.retarget(discover(root))
    assert tuning.runtime["inference"]["cpus"] == [1, 2, 3, 4, 5]
    (tree / "sys/devices/system/cpu/online").write_text("0-4\n")
    (tree / "sys/devices/system/cpu/offline").write_text("5\n")
    (tree / "sys/devices/system/cpu/cpu5/online").write_text("0\n")
    tuning.retarget(discover(root))
    assert tuning.runtime["inference"]["cpus"] == [1, 2, 3, 4]
    assert "cpu" in HOTPLUG_SUBSYSTEMS and {"online", "offline"} <= HOTPLUG_ACTIONS


def test_throttling_already_off_outside_edge_agent_is_said_so(tmp_path: Path) -> None:
    tree = copy_board("x86-edge-npu", tmp_path)  # the tree has -1, inference is not isolated
    plan = engine_for(tree, tmp_path / "state", [REPO_PROFILES]).plan("realtime", force=True)
    assert not [c for c in plan.changes if c.path == RUNTIME]
    assert any(w.startswith("rt.sched_rt_runtime_us: -1 not planned, and RT throttling is "
                            "already off here (-1, set outside edge-agent) although: the "
                            "inference CPUs 1-11 are not isolated") for w in plan.warnings)


# -- unbound kernel threads -----------------------------------------------------------------

STATS = {  # pid: (comm, flags): /proc/PID/stat's ninth field
    2: ("kthreadd", 0x208040), 14: ("rcu_preempt", 0x208040),
    15: ("kworker/0:0-events", 0x4208060),  # PF_NO_SETAFFINITY: bound
    16: ("ksoftirqd/0", 0x4208040), 90: ("irq/45-c240000.i2c", 0x208040),
    700: ("python3 (x) y", 0x400100)}  # a user process; a comm with ")" and spaces


def test_movable_kthreads_are_kthreads_without_no_setaffinity(tmp_path: Path) -> None:
    for pid, (comm, flags) in STATS.items():
        (tmp_path / f"proc/{pid}").mkdir(parents=True)
        (tmp_path / f"proc/{pid}/stat").write_text(
            f"{pid} ({comm}) S 2 0 0 0 -1 {flags} 0 0 0 0 0 0 0 0 20 0 1 0 25\n")
    assert throttle.movable_kthreads(Root(tmp_path)) == [(2, "kthreadd"), (14, "rcu_preempt")]


def test_kthreads_move_to_housekeeping_on_the_real_root_only(tmp_path: Path) -> None:
    write_profile(tmp_path / "profiles", "kthreads", "rt: {kthreads: housekeeping}\n")
    board_tree = copy_board("rk3588-vendor", tmp_path / "board")
    fixture = _engine(board_tree, tmp_path).plan("kthreads")
    assert "rt.kthreads: kernel threads are moved on the real root only; skipped" in \
        fixture.warnings and fixture.changes == []
    root = Root("/")
    if len(os.sched_getaffinity(2) if Path("/proc/2").is_dir() else ()) < 2:
        pytest.skip("needs kthreadd visible and on more than one CPU")
    real = Engine(root, discover(root), Journal(tmp_path / "real"), ProfileStore(
        root, dirs=[tmp_path / "profiles", REPO_PROFILES])).plan("kthreads")
    housekeeping = format_cpulist(real.cpus["housekeeping"])
    assert real.cpus["kthreads"] == real.cpus["housekeeping"]
    assert "kthreadd" in [c.note for c in real.changes]
    assert all(c.key == "rt.kthreads" and c.compare == "sched"
               and c.desired.endswith(f":{housekeeping}") for c in real.changes)


def test_realtime_moves_the_unbound_workqueues_on_the_committed_tree(tmp_path: Path) -> None:
    tree = copy_board("jetson-xavier-nx-jp5-rt", tmp_path)
    engine = engine_for(tree, tmp_path / "state", [REPO_PROFILES])
    before = snapshot(tree)
    plan = engine.plan("realtime", force=True)
    [change] = [c for c in plan.changes if c.path == f"/{WORKQUEUE}"]
    assert (change.current, change.desired) == ("0-5", "0")
    assert not any(w.startswith("rt.workqueue_cpus") for w in plan.warnings)
    engine.apply("realtime", force=True)
    assert (tree / WORKQUEUE).read_text() == "01\n"
    engine.rollback()
    assert snapshot(tree) == before


def test_the_fixture_kernel_takes_a_workqueue_mask_as_workqueue_set_unbound_cpumask(
        tmp_path: Path) -> None:
    """Cut to the possible CPUs, EINVAL when none is left (offline ones are accepted),
    EOVERFLOW beyond nr_cpu_ids, read back as %*pb (kernel/workqueue.c)."""
    tree = copy_board("jetson-agx-orin-jp6", tmp_path)  # possible 0-11, online 0-7
    root = Root(tree)
    for bad, code in (("0", errno.EINVAL), ("zz", errno.EINVAL), ("1000", errno.EOVERFLOW)):
        with pytest.raises(OSError) as caught:
            root.write_text(f"/{WORKQUEUE}", bad)
        assert caught.value.errno == code
    assert (tree / WORKQUEUE).read_text() == "fff\n"
    root.write_text(f"/{WORKQUEUE}", "f00")  # cpu8-11: possible, offline
    assert (tree / WORKQUEUE).read_text() == "f00\n"
    root.write_text(f"/{WORKQUEUE}", "3")
    assert (tree / WORKQUEUE).read_text() == "003\n"
