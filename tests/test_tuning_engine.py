"""Plan -> apply -> verify -> rollback on copies of every fixture board."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
from cli_helpers import edge_agent
from tuning_helpers import (
    BOARDS,
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
from agent.tuning.journal import FILE_NAME

BOARD_PROFILES = {"jetson-agx-orin-jp6": "jetson-orin-latency",
                  "jetson-orin-nano-jp6": "jetson-orin-latency",
                  "jetson-xavier-nx-jp5-rt": "jetson-orin-latency",  # no tegra194 profile
                  "rk3588-vendor": "rk3588-latency", "rk3588-mainline": "rk3588-latency",
                  "x86-server-nvidia": "x86-latency", "x86-edge-npu": "x86-latency",
                  "bare-vm": "x86-latency", "rpi5-hailo": "latency"}  # no Pi profile


@pytest.mark.parametrize("board", BOARDS)
@pytest.mark.parametrize("profile", ["realtime", "powersave", "board"])
def test_apply_verify_rollback_is_byte_identical(board: str, profile: str,
                                                 tmp_path: Path) -> None:
    tree = copy_board(board, tmp_path)
    before = snapshot(tree)
    engine = engine_for(tree, tmp_path / "state")
    name = BOARD_PROFILES[board] if profile == "board" else profile
    plan = engine.plan(name, force=True)
    assert snapshot(tree) == before, "plan must not write"
    result = engine.apply(name, force=True)
    assert len(result.written) == len(plan.changes) - len(result.skipped)
    assert engine.verify() == []
    if plan.changes:
        assert snapshot(tree) != before
    assert engine.rollback()[0] == plan.profile
    assert snapshot(tree) == before
    assert not (tmp_path / "state" / FILE_NAME).exists()


def test_latency_on_rk3588_changes_the_right_files(tmp_path: Path) -> None:
    tree = copy_board("rk3588-vendor", tmp_path)
    engine = engine_for(tree, tmp_path / "state")
    engine.apply("rk3588-latency")
    cpufreq = tree / "sys/devices/system/cpu/cpufreq"
    assert (cpufreq / "policy4/scaling_governor").read_text() == "performance\n"
    assert (cpufreq / "policy4/scaling_min_freq").read_text() == "2400000\n"
    assert (cpufreq / "policy0/scaling_governor").read_text() == "schedutil\n"  # A55 untouched
    npu = tree / "sys/devices/platform/fdab0000.npu/devfreq/fdab0000.npu/min_freq"
    assert npu.read_text() == "1000000000\n"
    assert (tree / "proc/sys/vm/swappiness").read_text() == "10\n"
    assert (tree / "proc/irq/61/smp_affinity_list").read_text() == "0-3\n"
    # cpu-sleep (exit latency 220 us) kept off the A76 inference cores by PM QoS, not disabled
    cpu = tree / "sys/devices/system/cpu"
    assert (cpu / "cpu5/power/pm_qos_resume_latency_us").read_text() == "100\n"
    assert (cpu / "cpu0/power/pm_qos_resume_latency_us").read_text() == "0\n"  # an A55
    assert (cpu / "cpu5/cpuidle/state1/disable").read_text() == "0\n"
    journal = json.loads((tmp_path / "state" / FILE_NAME).read_text())
    assert journal["status"] == "applied"
    assert journal["runtime"]["inference"] == {"policy": "fifo", "priority": 80,
                                               "cpus": [4, 5, 6, 7]}
    # THP: the kernel command line said never; the profile does not override it
    assert (tree / "sys/kernel/mm/transparent_hugepage/enabled").read_text() == \
        "always madvise [never]\n"


def test_switching_profiles_keeps_true_originals(tmp_path: Path) -> None:
    tree = copy_board("x86-edge-npu", tmp_path)
    before = snapshot(tree)
    engine = engine_for(tree, tmp_path / "state")
    engine.apply("realtime", force=True)
    engine.apply("powersave", force=True)  # leaves IRQs, RT runtime and idle states alone
    swappiness = tree / "proc/sys/vm/swappiness"
    assert swappiness.read_text() == "60\n"
    assert (tree / "proc/sys/kernel/sched_rt_runtime_us").read_text() == "-1\n"  # original
    governor = tree / "sys/devices/system/cpu/cpufreq/policy0/scaling_governor"
    assert governor.read_text() == "powersave\n"
    assert engine.verify() == []
    engine.apply("x86-latency")
    engine.rollback()
    assert snapshot(tree) == before


def test_switch_restores_settings_the_new_profile_leaves_alone(tmp_path: Path) -> None:
    tree = copy_board("rk3588-mainline", tmp_path)
    before = snapshot(tree)
    engine = engine_for(tree, tmp_path / "state")
    engine.apply("rk3588-latency")
    engine.apply("balanced")
    policy4 = tree / "sys/devices/system/cpu/cpufreq/policy4"
    assert (policy4 / "scaling_governor").read_text() == "schedutil\n"
    assert engine.verify() == []
    engine.rollback()
    assert snapshot(tree) == before


class RefusingRoot(Root):
    """A fixture root where one kernel file refuses writes, as the kernel may (EINVAL/EIO)."""

    def __init__(self, base: Path, refuse: str, code: int) -> None:
        super().__init__(base)
        self.refuse, self.code = refuse, code

    def write_text(self, path: str, value: str) -> None:
        if path == self.refuse:
            raise OSError(self.code, "refused by the kernel", path)
        super().write_text(path, value)


def test_failed_write_undoes_earlier_writes(tmp_path: Path) -> None:
    tree = copy_board("rk3588-vendor", tmp_path)
    before = snapshot(tree)
    refused = "/sys/devices/system/cpu/cpufreq/policy6/scaling_min_freq"
    engine = engine_for(tree, tmp_path / "state", root=RefusingRoot(tree, refused, errno.EINVAL))
    with pytest.raises(TuningError, match=r"policy6/scaling_min_freq.*rolled back"):
        engine.apply("rk3588-latency")
    assert snapshot(tree) == before
    assert not (tmp_path / "state" / FILE_NAME).exists()


def test_a_failed_switch_leaves_the_old_profile_applied_and_its_originals(
        tmp_path: Path) -> None:
    tree = copy_board("rk3588-vendor", tmp_path)
    original = snapshot(tree)
    profiles = tmp_path / "profiles"
    write_profile(profiles, "a", "thp: {enabled: never}\nsysctl: {vm.swappiness: 10}\n")
    write_profile(profiles, "b", "thp: {enabled: madvise}\nsysctl: {vm.swappiness: 20}\n")
    engine_for(tree, tmp_path / "state", [profiles]).apply("a")
    applied_a = snapshot(tree)
    refusing = engine_for(tree, tmp_path / "state", [profiles], root=RefusingRoot(
        tree, "/proc/sys/vm/swappiness", errno.EINVAL))
    with pytest.raises(TuningError, match=r"swappiness.*rolled back"):
        refusing.apply("b")  # thp is written first, then swappiness is refused
    assert snapshot(tree) == applied_a  # thp back to a's never, not to the original
    engine = engine_for(tree, tmp_path / "state", [profiles])
    state = engine.journal.load()
    assert state is not None and state.profile == "a"
    assert engine.verify() == []
    assert engine.rollback()[0] == "a"
    assert snapshot(tree) == original


def test_managed_irq_eio_is_reported_not_fatal(tmp_path: Path) -> None:
    tree = copy_board("x86-server-nvidia", tmp_path)
    before = snapshot(tree)
    engine = engine_for(tree, tmp_path / "state",
                        root=RefusingRoot(tree, "/proc/irq/40/smp_affinity_list", errno.EIO))
    profiles = tmp_path / "profiles"
    write_profile(profiles, "irqs", "rt: {irq_affinity: {'nvme*': cpus:0-3}}\n")
    engine.store.dirs = [profiles]
    result = engine.apply("irqs")
    # 40 refused here; 41 and 90 (NVMe I/O queues) as the kernel refuses them
    assert [s.split(":")[0] for s in result.skipped] == [
        f"/proc/irq/{irq}/smp_affinity_list" for irq in (40, 41, 90)]
    assert result.skipped[0].endswith(": managed IRQ (kernel-managed affinity, e.g. "
                                      "NVMe/multiqueue queues): the kernel refuses affinity "
                                      "changes (EIO); isolcpus=managed_irq,... moves them at boot")
    assert engine.verify() == []
    engine.rollback()
    assert snapshot(tree) == before


def test_journal_from_another_boot_is_not_replayed(tmp_path: Path) -> None:
    tree = copy_board("rk3588-vendor", tmp_path)
    engine = engine_for(tree, tmp_path / "state")
    engine.apply("rk3588-latency")
    (tree / "proc/sys/kernel/random/boot_id").write_text("00000000-0000-4000-8000-0000000000aa\n")
    profile, notes = engine.rollback()
    assert profile is None
    assert "is from another boot" in notes[0]
    assert (tree / "proc/sys/vm/swappiness").read_text() == "10\n"  # not written back
    assert not (tmp_path / "state" / FILE_NAME).exists()


def test_verify_reports_drift(tmp_path: Path) -> None:
    tree = copy_board("rk3588-vendor", tmp_path)
    engine = engine_for(tree, tmp_path / "state")
    engine.apply("rk3588-latency")
    (tree / "proc/sys/vm/swappiness").write_text("30\n")  # a co-owner changed it
    ((change, actual),) = engine.verify()
    assert (change.path, change.desired, actual) == ("/proc/sys/vm/swappiness", "10", "30")


def test_profile_for_another_board_is_refused_unless_forced(tmp_path: Path,
                                                            shared_board: SharedBoard) -> None:
    tree = shared_board("rk3588-vendor")
    engine = plan_engine(tree, tmp_path / "state")
    with pytest.raises(ProfileError, match=r"jetson-orin\.yaml: match: .*use --force"):
        engine.plan("jetson-orin")
    assert engine.plan("auto").profile == "rk3588"


@pytest.mark.parametrize(("text", "key", "message"), [
    ("dvfs: {cpu: {'cluster:big': {max_khz: 2300000}}}", "dvfs.cpu.cluster:big.max_khz",
     "2300000 is not offered"),
    ("dvfs: {cpu: {'cluster:little': {governor: turbo}}}", "dvfs.cpu.cluster:little.governor",
     "'turbo' is not available"),
    ("rt: {irq_affinity: {'eth*': 'cpus:8-9'}}", "rt.irq_affinity.eth*",
     "names CPUs this device does not have: 8-9"),
    ("block: {'nvme*': {scheduler: deadline}}", "block.nvme*.scheduler",
     "'deadline' is not offered by nvme0n1"),
    ("cgroup: {path: ../etc, memory_max: 1G}", "cgroup.path", "without '..'"),
    ("rt: {inference: {policy: fifo, priority: 0}}", "rt.inference.priority",
     "does not suit policy fifo"),
    ("dvfs: {gpu: {min_hz: 2000000000, max_hz: 1000000000}}", "dvfs.gpu.min_hz",
     "is not offered"),
])
def test_plan_time_errors_name_key_and_allowed(tmp_path: Path, text: str, key: str,
                                               message: str, shared_board: SharedBoard) -> None:
    tree = shared_board("rk3588-vendor")
    profiles = tmp_path / "profiles"
    path = write_profile(profiles, "bad", text)
    engine = plan_engine(tree, tmp_path / "state", [profiles])
    with pytest.raises(ProfileError) as error:
        engine.plan("bad")
    assert str(error.value).startswith(f"{path}: {key}: ")
    assert message in str(error.value)


def test_symbolic_values_resolve_against_the_hardware(tmp_path: Path,
                                                      shared_board: SharedBoard) -> None:
    tree = shared_board("rk3588-vendor")
    profiles = tmp_path / "profiles"
    write_profile(profiles, "symbols", """
dvfs:
  cpu:
    cluster:little: {max_khz: "~1500000"}
    cpus:6-7: {min_khz: min, max_khz: max}
cgroup: {memory_max: 25%, memory_high: 90%, cpus: cluster:big, cpu_max: "80000 100000"}
""")
    engine = plan_engine(tree, tmp_path / "state", [profiles])
    changes = {c.path: c.desired for c in engine.plan("symbols").changes}
    assert changes["/sys/devices/system/cpu/cpufreq/policy0/scaling_max_freq"] == "1416000"
    # a systemd board: the limits are edge_agent.slice's unit properties, in their own form
    total = 16474476544
    memory_max = total * 25 // 100 // 4096 * 4096
    assert changes["systemd:edge_agent.slice/MemoryMax"] == str(memory_max)
    assert changes["systemd:edge_agent.slice/MemoryHigh"] == str(
        memory_max * 90 // 100 // 4096 * 4096)
    assert changes["systemd:edge_agent.slice/AllowedCPUs"] == "4-7"
    assert changes["systemd:edge_agent.slice/CPUQuota"] == "80%"
    assert not [p for p in changes if p.startswith("/sys/fs/cgroup")]  # systemd's tree


def test_frequency_limits_never_cross(tmp_path: Path, shared_board: SharedBoard) -> None:
    """Raising min above the current max writes max first; rollback undoes in reverse."""
    tree = shared_board("jetson-agx-orin-jp6")
    profiles = tmp_path / "profiles"
    write_profile(profiles, "pinned", "dvfs: {cpu: {all: {min_khz: max, max_khz: max}}}\n")
    engine = plan_engine(tree, tmp_path / "state", [profiles])
    paths = [c.path.rsplit("/", 2)[1:] for c in engine.plan("pinned").changes]
    assert paths[:2] == [["policy0", "scaling_max_freq"], ["policy0", "scaling_min_freq"]]
    assert ["policy8", "scaling_max_freq"] not in paths  # offline cluster skipped


def test_state_dir_defaults_below_the_fixture_root(tmp_path: Path) -> None:
    """The profile commands, called in this process (tests/cli_helpers.py)."""
    tree = copy_board("rk3588-vendor", tmp_path)
    applied = edge_agent("profile", "apply", "rk3588-latency", "--root", tree)
    assert applied.returncode == 0, applied.stderr
    assert (tree / "var/lib/edge-agent" / FILE_NAME).exists()
    status = edge_agent("profile", "status", "--root", tree, "--json")
    assert json.loads(status.stdout)["applied"]["profile"] == "rk3588-latency"
    verify = edge_agent("profile", "verify", "--root", tree)
    assert verify.returncode == 0
    (tree / "proc/sys/vm/swappiness").write_text("33\n")
    drifted = edge_agent("profile", "verify", "--root", tree)
    assert drifted.returncode == 1 and "/proc/sys/vm/swappiness" in drifted.stdout
    bad = edge_agent("profile", "plan", "nope", "--root", tree)
    assert bad.returncode == 2 and "no profile named 'nope'" in bad.stderr
