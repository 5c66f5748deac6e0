"""cgroup v2 limits on the data plane: a fixture root with cgroup v2's rules (no systemd, a
container's delegated subtree) and a systemd boundary that behaves like systemctl."""

from __future__ import annotations

import errno
import shutil
import sys
from pathlib import Path

import pytest
from tuning_helpers import copy_board, engine_for, snapshot, write_profile

from agent.discovery import discover
from agent.kernel.fsroot import Root, WriteRefused
from agent.service.dataplane import Supervisor
from agent.service.memory_events import MemoryEventsWatch
from agent.tuning.engine import Engine, TuningError
from agent.tuning.errors import ProfileError
from agent.tuning.journal import Journal
from agent.tuning.placement import CgroupfsPlacement, SystemdPlacement, detect
from agent.tuning.profiles import ProfileStore
from agent.tuning.units import SLICE, UnitError, Units, normalise, quota_percent
from agent.tuning.units_model import DropInUnits

CG = "/sys/fs/cgroup"


def container_tree(tmp_path: Path) -> Path:
    """A board seen from inside a container: its cgroup namespace root is the agent's
    delegated subtree, not the real root (it has cgroup.type), and holds two processes."""
    tree = copy_board("rk3588-mainline", tmp_path)
    cgroup = tree / "sys/fs/cgroup"
    shutil.rmtree(cgroup)
    cgroup.mkdir()
    files = {"cgroup.controllers": "cpuset cpu io memory pids", "cgroup.subtree_control": "",
             "cgroup.procs": "1\n42", "cgroup.type": "domain", "cgroup.threads": "1\n42",
             "cpuset.cpus.effective": "0-7", "cpuset.mems.effective": "0",
             "memory.events": "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0"}
    for name, text in files.items():
        (cgroup / name).write_text(text + "\n")
    (tree / "proc/self/cgroup").write_text("0::/\n")
    return tree


# -- the fixture root keeps cgroup v2's rules ------------------------------------------------

def test_controller_files_appear_only_once_enabled_in_the_parent(tmp_path: Path) -> None:
    root = Root(container_tree(tmp_path))
    root.mkdir(f"{CG}/a")
    assert root.read_text(f"{CG}/a/cgroup.controllers") == ""
    assert not root.exists(f"{CG}/a/memory.max")
    with pytest.raises(FileNotFoundError):
        root.write_text(f"{CG}/a/memory.max", "1G")
    # the namespace root holds processes: no-internal-process rule
    with pytest.raises(OSError) as busy:
        root.write_text(f"{CG}/cgroup.subtree_control", "+memory")
    assert busy.value.errno == errno.EBUSY
    for pid in ("1", "42"):
        root.write_text(f"{CG}/a/cgroup.procs", pid)
    assert root.read_text(f"{CG}/cgroup.procs") == ""
    root.write_text(f"{CG}/cgroup.subtree_control", "+memory +cpu")
    assert root.read_text(f"{CG}/a/memory.max") == "max\n"  # appeared, with the default
    root.mkdir(f"{CG}/b")
    assert root.read_text(f"{CG}/b/cpu.max") == "max 100000\n"
    with pytest.raises(OSError) as busy:  # a cgroup that delegates takes no process
        root.write_text(f"{CG}/cgroup.procs", "1")
    assert busy.value.errno == errno.EBUSY
    with pytest.raises(OSError) as missing:
        root.write_text(f"{CG}/cgroup.subtree_control", "+rdma")
    assert missing.value.errno == errno.ENOENT
    for bad in ("3G", "-1"):
        with pytest.raises(OSError) as invalid:
            root.write_text(f"{CG}/b/memory.max", bad)
        assert invalid.value.errno == errno.EINVAL
    root.write_text(f"{CG}/b/memory.max", "1000000")
    assert root.read_text(f"{CG}/b/memory.max") == "999424\n"  # whole pages
    with pytest.raises(OSError) as busy:
        root.rmdir(f"{CG}/a")
    assert busy.value.errno == errno.EBUSY
    root.rmdir(f"{CG}/b")
    assert not root.exists(f"{CG}/b")


# -- without systemd: the agent's delegated subtree -------------------------------------------

PROFILE = "cgroup: {memory_max: 1G, memory_high: 90%, cpus: '4-7', cpu_max: '50000 100000'}\n"


def container_engine(tmp_path: Path, text: str = PROFILE) -> tuple[Engine, Path]:
    tree = container_tree(tmp_path)
    write_profile(tmp_path / "profiles", "limits", text)
    return engine_for(tree, tmp_path / "state", [tmp_path / "profiles"]), tree


def test_container_plan_reads_nothing_the_controller_has_not_created(tmp_path: Path) -> None:
    engine, tree = container_engine(tmp_path)
    before = snapshot(tree)
    assert isinstance(engine.placement, CgroupfsPlacement)
    changes = {c.path: (c.current, c.desired) for c in engine.plan("limits").changes}
    leaf = f"{CG}/inference"
    assert changes == {f"{leaf}/memory.max": ("max", "1073741824"),
                       f"{leaf}/memory.high": ("max", "966365184"),
                       f"{leaf}/cpuset.cpus": ("", "4-7"),
                       f"{leaf}/cpu.max": ("max 100000", "50000 100000")}
    assert snapshot(tree) == before  # the plan is pure: no leaf was made to read it


def test_container_apply_moves_processes_to_a_leaf_first_and_rolls_back(
        tmp_path: Path) -> None:
    engine, _tree = container_engine(tmp_path)
    root = engine.root
    engine.apply("limits")
    # the processes left the subtree's root before controllers were enabled there
    assert root.read_text(f"{CG}/cgroup.procs") == ""
    assert set(root.read_text(f"{CG}/edge-agent/cgroup.procs").split()) >= {"1", "42"}
    assert set(root.read_text(f"{CG}/cgroup.subtree_control").split()) == {
        "cpu", "cpuset", "memory"}
    assert root.read_text(f"{CG}/inference/memory.max") == "1073741824\n"
    assert root.read_text(f"{CG}/inference/cpu.max") == "50000 100000\n"
    assert engine.verify() == []
    engine.placement.adopt(4242)  # the data plane's child moves into its leaf
    assert root.read_text(f"{CG}/inference/cgroup.procs") == "4242\n"
    engine.rollback()
    assert root.read_text(f"{CG}/inference/memory.max") == "max\n"
    assert root.read_text(f"{CG}/inference/cpu.max") == "max 100000\n"
    assert root.read_text(f"{CG}/inference/cpuset.cpus") == ""


def test_container_refuses_writes_outside_its_subtree(tmp_path: Path) -> None:
    engine, _tree = container_engine(tmp_path)
    placement = engine.placement
    assert isinstance(placement, CgroupfsPlacement)
    placement.subtree = f"{CG}/inference"  # as if delegated only this far down
    with pytest.raises(WriteRefused, match="outside the agent's cgroup subtree"):
        placement.check(f"{CG}/cgroup.subtree_control")
    with pytest.raises(WriteRefused):
        placement.check(f"{CG}/inference/../cgroup.procs")


def test_container_usage_is_checked_once_the_memory_controller_exists(tmp_path: Path) -> None:
    engine, tree = container_engine(tmp_path, "cgroup: {memory_max: 16M}\n")
    engine.placement.prepare()
    (tree / "sys/fs/cgroup/inference/memory.current").write_text("536870912\n")
    with pytest.raises(ProfileError, match="below the data plane's current usage"):
        engine.plan("limits")


def test_a_controller_the_container_does_not_delegate_names_the_key(tmp_path: Path) -> None:
    engine, tree = container_engine(tmp_path, "cgroup: {cpus: '4-7'}\n")
    (tree / "sys/fs/cgroup/cgroup.controllers").write_text("memory pids\n")
    with pytest.raises(ProfileError) as error:
        engine.plan("limits")
    assert error.value.key == "cgroup.cpus"
    assert "cpuset controller" in str(error.value)


# -- under systemd: unit properties through the boundary ---------------------------------------

class FakeSystemctl(DropInUnits):
    """systemctl as the drop-in model answers it, and a data plane that uses memory."""

    def __init__(self, root: Root, memory_current: str = "[not set]") -> None:
        super().__init__(root)
        self.memory_current = memory_current

    def _shown(self, unit: str, shown: str) -> str:
        return self.memory_current if shown == "MemoryCurrent" else super()._shown(unit, shown)

    def set_calls(self) -> list[list[str]]:
        return [c for c in self.calls if c[1] == "set-property"]


def systemd_engine(tmp_path: Path, text: str = PROFILE,
                   memory_current: str = "[not set]") -> tuple[Engine, FakeSystemctl]:
    tree = copy_board("rk3588-vendor", tmp_path)
    root = Root(tree)
    topology = discover(root)
    units = FakeSystemctl(root, memory_current)
    write_profile(tmp_path / "profiles", "limits", text)
    engine = Engine(root, topology, Journal(tmp_path / "state"),
                    ProfileStore(root, dirs=[tmp_path / "profiles"]), detect(root, topology, units))
    return engine, units


def test_systemd_limits_are_runtime_slice_properties_restored_exactly(tmp_path: Path) -> None:
    engine, units = systemd_engine(tmp_path)
    units.set_runtime(SLICE, "MemoryMax", "8G")  # an earlier value: restored, not reset
    units.calls.clear()
    tree_before = snapshot(engine.root.base / "sys")
    engine.apply("limits")
    assert units.set_calls() == [
        ["systemctl", "set-property", "--runtime", "--", SLICE, "MemoryMax=1073741824"],
        ["systemctl", "set-property", "--runtime", "--", SLICE, "MemoryHigh=966365184"],
        ["systemctl", "set-property", "--runtime", "--", SLICE, "CPUQuota=50%"],
        ["systemctl", "set-property", "--runtime", "--", SLICE, "AllowedCPUs=4-7"]]
    assert units.show(SLICE, ["CPUQuota"]) == {"CPUQuota": "50%"}
    assert engine.verify() == []
    assert snapshot(engine.root.base / "sys") == tree_before  # nothing in the unit's cgroup
    engine.rollback()
    assert units.show(SLICE, ["MemoryMax", "MemoryHigh", "AllowedCPUs", "CPUQuota"]) == {
        "MemoryMax": "8589934592", "MemoryHigh": "infinity", "AllowedCPUs": "",
        "CPUQuota": ""}
    assert units.set_calls()[-1] == ["systemctl", "set-property", "--runtime", "--", SLICE,
                                     "MemoryMax=8589934592"]
    # the drop-in that was there stays (with its value); those the profile added are gone
    assert sorted(p.name for p in (engine.root.base / "run/systemd/system.control"
                                   / f"{SLICE}.d").iterdir()) == ["50-MemoryMax.conf"]


def test_rollback_leaves_no_runtime_drop_in_behind(tmp_path: Path) -> None:
    """systemctl set-property --runtime writes /run/systemd/system.control/<unit>.d/50-*.conf;
    writing the original back would leave each one holding it, so rollback removes those
    the profile created (and reloads systemd once per file)."""
    engine, units = systemd_engine(tmp_path)
    before = snapshot(engine.root.base)
    engine.apply("limits")
    assert len(list((engine.root.base / "run/systemd/system.control" / f"{SLICE}.d")
                    .iterdir())) == 4
    assert engine.verify() == []
    engine.rollback()
    assert snapshot(engine.root.base) == before
    assert units.calls.count(["systemctl", "daemon-reload"]) == 4
    assert units.show(SLICE, ["MemoryMax", "AllowedCPUs"]) == {"MemoryMax": "infinity",
                                                              "AllowedCPUs": ""}


def test_systemd_drift_is_seen_by_verify(tmp_path: Path) -> None:
    engine, units = systemd_engine(tmp_path)
    engine.apply("limits")
    units.set_runtime(SLICE, "AllowedCPUs", "0-7")
    drift = engine.verify()
    assert [(c.path, actual) for c, actual in drift] == [
        (f"systemd:{SLICE}/AllowedCPUs", "0-7")]


def test_a_refused_property_leaves_nothing_half_applied(tmp_path: Path) -> None:
    engine, units = systemd_engine(tmp_path)
    real = units.run

    def refuse_quota(argv: list[str]) -> str:
        if argv[-1].startswith("CPUQuota="):
            raise UnitError(errno.EIO, "Failed to set unit properties: Access denied")
        return real(argv)

    units.run = refuse_quota  # type: ignore[method-assign]
    with pytest.raises(TuningError, match="every earlier write was rolled back"):
        engine.apply("limits")
    assert units.show(SLICE, ["MemoryMax", "AllowedCPUs"]) == {"MemoryMax": "infinity",
                                                              "AllowedCPUs": ""}
    assert not engine.journal.exists()


def test_systemd_usage_and_quota_errors_name_the_key(tmp_path: Path) -> None:
    engine, _units = systemd_engine(tmp_path, "cgroup: {memory_max: 64M}\n", "536870912")
    with pytest.raises(ProfileError) as error:
        engine.plan("limits")
    assert error.value.key == "cgroup.memory_max" and "current usage" in str(error.value)
    engine, _units = systemd_engine(tmp_path / "b", "cgroup: {cpu_max: '33333 100000'}\n")
    with pytest.raises(ProfileError) as error:
        engine.plan("limits")
    assert error.value.key == "cgroup.cpu_max" and "two decimals" in str(error.value)
    for bad in ("0 0", "500 100000", "50000 10"):  # the kernel's bounds, at plan time
        engine, _units = systemd_engine(tmp_path / bad.replace(" ", "-"),
                                        f"cgroup: {{cpu_max: '{bad}'}}\n")
        with pytest.raises(ProfileError) as error:
            engine.plan("limits")
        assert error.value.key == "cgroup.cpu_max"


def test_only_the_agents_own_units_are_changed(tmp_path: Path) -> None:
    units = DropInUnits(Root(copy_board("rk3588-vendor", tmp_path)))
    for unit in ("system.slice", "edge-agent.service", "sshd.service", "edge-agent-x.slice"):
        with pytest.raises(UnitError, match="not one of the agent's own units"):
            units.set_runtime(unit, "MemoryMax", "1G")
    with pytest.raises(UnitError, match="Failed to parse MemoryMax"):
        units.set_runtime(SLICE, "MemoryMax", "lots")
    assert units.calls == [["systemctl", "set-property", "--runtime", "--", SLICE,
                            "MemoryMax=lots"]]


def test_a_journal_from_another_boot_is_not_replayed_onto_systemd(tmp_path: Path) -> None:
    """Runtime properties live in /run: a reboot drops them, and so does the journal."""
    engine, units = systemd_engine(tmp_path)
    engine.apply("limits")
    shutil.rmtree(engine.root.base / "run/systemd/system.control")  # the reboot
    (engine.root.base / "proc/sys/kernel/random/boot_id").write_text("another-boot\n")
    units.calls.clear()
    profile, notes = engine.rollback()
    assert profile is None and "another boot" in notes[0]
    assert units.set_calls() == []


@pytest.mark.parametrize(("name", "shown", "value"), [
    ("CPUQuota", "800ms", "80%"), ("CPUQuota", "1.500s", "150%"), ("CPUQuota", "2s", "200%"),
    ("CPUQuota", "infinity", ""), ("CPUQuota", "1min 30s", "9000%"),
    ("CPUWeight", "[not set]", ""), ("CPUWeight", "18446744073709551615", ""),
    ("CPUWeight", "100", "100"), ("MemoryMax", "infinity", "infinity"),
    ("MemoryHigh", "1073741824", "1073741824"), ("AllowedCPUs", "4 5 6 7", "4-7"),
    ("AllowedCPUs", "", ""),
])
def test_systemctl_show_values_in_set_property_form(name: str, shown: str, value: str) -> None:
    assert normalise(name, shown) == value


def test_a_bad_time_span_is_refused() -> None:
    with pytest.raises(ValueError):
        quota_percent("80 percent")


# -- the data plane goes there ----------------------------------------------------------------

class NoRun(Units):
    def run(self, argv: list[str]) -> str:
        raise AssertionError(f"unexpected {argv}")


def test_under_systemd_the_data_plane_is_a_scope_in_the_slice(tmp_path: Path) -> None:
    root = Root(copy_board("rk3588-vendor", tmp_path))
    placement = SystemdPlacement(root, NoRun())
    command = placement.command([sys.executable, "-m", "agent", "serve"], 3)
    assert command[:7] == ["systemd-run", "--scope", "--quiet", "--collect",
                           "--no-ask-password", command[5], f"--slice={SLICE}"]
    assert command[5].startswith("--unit=edge-agent-serve-") and command[5].endswith("-3.scope")
    assert command[-5:] == ["--", sys.executable, "-m", "agent", "serve"]  # no shell
    # below a fixture root there is no systemd to start it through: it runs as it is
    model = SystemdPlacement(root, DropInUnits(root))
    assert model.command(["serve"], 1) == ["serve"]


def test_the_supervisor_spawns_through_the_placement_and_reports_failures(
        tmp_path: Path) -> None:
    from agent.config import load_config

    adopted: list[int] = []

    class Recording(CgroupfsPlacement):
        def command(self, argv: list[str], serial: int) -> list[str]:
            return [sys.executable, "-c", "import time; time.sleep(30)"]

        def adopt(self, pid: int) -> None:
            adopted.append(pid)
            raise PermissionError(errno.EACCES, "cgroup.procs: permission denied")

    tree = container_tree(tmp_path)
    placement = Recording(Root(tree), f"{CG}")
    supervisor = Supervisor(load_config(None), tmp_path / "state", lambda *a, **k: None,
                            wait_ready_s=0.1, placement=placement)
    supervisor.launch()
    supervisor.wait_ready()
    try:
        assert supervisor.process is not None
        assert adopted == [supervisor.process.pid]
        assert any("not in its cgroup" in p for p in supervisor.problems())
        assert supervisor.status()["placement"]["mode"] == "cgroupfs"
    finally:
        supervisor.stop()


def test_memory_events_become_agent_events(tmp_path: Path) -> None:
    tree = container_tree(tmp_path)
    placement = detect(Root(tree), discover(Root(tree)))
    placement.prepare()
    events: list[tuple[str, dict[str, object]]] = []
    watch = MemoryEventsWatch(placement, lambda kind, **f: events.append((kind, f)))
    assert watch.check() == []
    (tree / "sys/fs/cgroup/inference/memory.events").write_text(
        "low 0\nhigh 7\nmax 1\noom 1\noom_kill 1\n")
    assert watch.check() == ["data_plane_memory_high", "data_plane_memory_max",
                             "data_plane_oom", "data_plane_oom_kill"]
    assert events[-1] == ("data_plane_oom_kill", {"cgroup": f"{CG}/inference",
                                                  "counter": "oom_kill", "before": 0,
                                                  "after": 1})
    assert watch.check() == []  # no rise, no event


def test_the_thp_controller_watches_the_data_planes_memory_events(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import agent.service.tuning as service_tuning

    seen: dict[str, object] = {}

    class Recording:
        def __init__(self, *args: object, cgroup_dir: str | None = None) -> None:
            seen["cgroup_dir"] = cgroup_dir

        def run(self, stop: object) -> None:
            return None

    monkeypatch.setattr(service_tuning, "ThpDynamicController", Recording)
    tree = container_tree(tmp_path)
    root = Root(tree)
    topology = discover(root)
    tuning = service_tuning.Tuning(root, topology, tmp_path / "state", None, False,
                                   lambda *a, **k: None, detect(root, topology))
    tuning.runtime = {"thp_dynamic": {"disable_above_psi_some_avg10": 20}}
    tuning._start_thp_controller()
    assert seen["cgroup_dir"] == f"{CG}/inference"
