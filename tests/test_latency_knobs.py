"""The latency knobs the QoS controller climbs (agent.tuning.latency_knobs): a ladder within
the applied profile's bounds, floors written through the tuning journal and read back,
rung 0 exactly the profile again, a crash rolled back by the profile's rollback, a refusal
that leaves nothing half-applied."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from tuning_helpers import copy_board, engine_for, snapshot, write_profile

from agent.discovery.model import IdleState
from agent.kernel.fsroot import Root
from agent.kernel.pm_qos import DMA_LATENCY
from agent.tuning import layer
from agent.tuning.engine import Engine
from agent.tuning.journal import Journal
from agent.tuning.latency_knobs import (
    KnobError,
    KnobStep,
    LatencyKnobs,
    floor_steps,
    hold_steps,
    profile_max_khz,
)
from agent.tuning.thp_dynamic import ThpDynamicController

RK = "rk3588-vendor"
POLICIES = "/sys/devices/system/cpu/cpufreq"
BIG = {"policy4": 2400000, "policy6": 2400000}
REPO = Path(__file__).resolve().parents[1]


def knobs(engine: Engine) -> LatencyKnobs:
    return LatencyKnobs(engine.root, engine.topology, engine.journal)


def floor(tree: Path, policy: str, name: str = "scaling_min_freq") -> str:
    return (tree / f"{POLICIES}/{policy}/{name}".lstrip("/")).read_text().strip()


def held_us(tree: Path) -> int:
    return int.from_bytes((tree / DMA_LATENCY.lstrip("/")).read_bytes(), sys.byteorder,
                          signed=True)


@pytest.fixture
def rk(tmp_path: Path) -> tuple[Path, Engine, dict[str, tuple[str, bytes]]]:
    """rk3588 with its profile applied (inference on the A76 clusters), and the pristine
    tree's snapshot."""
    tree = copy_board(RK, tmp_path)
    pristine = snapshot(tree)
    engine = engine_for(tree, tmp_path / "state")
    engine.apply("rk3588")
    return tree, engine, pristine


# -- the ladder ----------------------------------------------------------------------------

def test_floor_steps_from_the_offered_frequencies_or_the_hardware_range() -> None:
    offered = [408000, 600000, 816000, 1008000, 1200000, 1416000, 1608000, 1800000]
    assert floor_steps(408000, 1800000, offered, 408000, 1800000) == \
        [1008000, 1416000, 1800000]
    assert floor_steps(408000, 1416000, offered, 408000, 1800000) == \
        [816000, 1200000, 1416000]  # a cap: never above it
    assert floor_steps(1608000, 1800000, offered, 408000, 1800000) == [1800000]
    assert floor_steps(1800000, 1800000, offered, 408000, 1800000) == []
    assert floor_steps(400000, 4800000, None, 400000, 4800000) == \
        [1866666, 3333333, 4800000]  # intel_pstate lists no frequencies
    assert floor_steps(400000, 4800000, None, None, None) == []


def test_holds_keep_out_one_more_idle_state_each_never_below_state0_or_c1() -> None:
    arm = [IdleState("WFI", 1, 1, False), IdleState("cpu-sleep", 220, 500, False)]
    assert hold_steps(arm, None) == [1]
    x86 = [IdleState("POLL", 0, 0, False), IdleState("C1", 1, 1, False),
           IdleState("C2", 127, 300, False), IdleState("C3", 1048, 2000, False)]
    assert hold_steps(x86, None) == [127, 1]  # never 0: only POLL would be left
    assert hold_steps(x86, 1000) == [1]  # the profile keeps C3 out already
    assert hold_steps(x86, 127) == [1]
    assert hold_steps(x86, 1) == []
    assert hold_steps(arm[:1], None) == []


def test_the_ladder_of_the_rk3588_profile(rk: tuple[Path, Engine, dict]) -> None:
    _tree, engine, _ = rk
    assert knobs(engine).ladder() == [
        KnobStep(None, None),
        KnobStep({"policy4": 1200000, "policy6": 1200000}, None),
        KnobStep({"policy4": 1800000, "policy6": 1800000}, None),
        KnobStep(BIG, None),
        KnobStep(BIG, 1)]  # WFI only: cpu-sleep (220 us) kept out


def test_without_a_profile_the_bounds_are_the_hardware_s(tmp_path: Path) -> None:
    engine = engine_for(copy_board(RK, tmp_path), tmp_path / "state")
    ladder = knobs(engine).ladder()
    assert ladder[3] == KnobStep({"policy0": 1800000, **BIG}, None)
    assert [step.pm_qos_us for step in ladder] == [None, None, None, None, 1]


def test_a_profile_s_max_and_a_cap_bound_the_floors(tmp_path: Path) -> None:
    tree = copy_board(RK, tmp_path)
    write_profile(tmp_path / "profiles", "capped", "include: [rk3588]\n"
                  "dvfs: {cpu: {cluster:big: {min_khz: 816000, max_khz: 1800000}}}\n")
    engine = engine_for(tree, tmp_path / "state", [tmp_path / "profiles", REPO / "profiles"])
    engine.apply("capped")
    Root(tree).write_text(f"{POLICIES}/policy6/scaling_max_freq", "1416000")  # a site cap
    ladder = knobs(engine).ladder()
    assert [step.cpu_floor_khz for step in ladder[1:4]] == [
        {"policy4": 1200000, "policy6": 1008000},
        {"policy4": 1608000, "policy6": 1200000},
        {"policy4": 1800000, "policy6": 1416000}]  # above the profile's 816000, to each max
    assert profile_max_khz(engine.root, engine.journal) == \
        {"policy4": 1800000, "policy6": 1800000}


@pytest.mark.parametrize("profile", ["rk3588-latency", "powersave"])
def test_no_rungs_past_the_profile_s_own_choice(tmp_path: Path, profile: str) -> None:
    """rk3588-latency: performance governor (floors moot) and a resume latency bound that
    keeps cpu-sleep out already; powersave: least power chosen, no floor, no hold."""
    engine = engine_for(copy_board(RK, tmp_path), tmp_path / "state")
    engine.apply(profile)
    assert knobs(engine).ladder() == [KnobStep(None, None)]


def test_no_pm_qos_rungs_without_the_device(tmp_path: Path) -> None:
    tree = copy_board(RK, tmp_path)
    (tree / DMA_LATENCY.lstrip("/")).unlink()
    engine = engine_for(tree, tmp_path / "state")
    assert all(step.pm_qos_us is None for step in knobs(engine).ladder())


# -- apply and restore ---------------------------------------------------------------------

def test_apply_writes_the_floors_and_restore_returns_the_profile_exactly(
        rk: tuple[Path, Engine, dict]) -> None:
    tree, engine, pristine = rk
    applied, journal = snapshot(tree), engine.journal.load()
    latency = knobs(engine)
    latency.apply(2)
    assert (floor(tree, "policy4"), floor(tree, "policy6"), floor(tree, "policy0")) == \
        ("1800000", "1800000", "408000")
    assert latency.rung == 2 and engine.verify() == []  # journaled: no drift
    latency.apply(4)
    assert floor(tree, "policy4") == "2400000" and held_us(tree) == 1
    latency.apply(1)
    assert floor(tree, "policy6") == "1200000" and latency.hold_us is None
    assert held_us(tree) == 2000000000  # the fixture's default: the hold was released
    latency.restore()
    assert latency.rung == 0
    assert snapshot(tree) == applied
    assert engine.journal.load() == journal
    engine.rollback()
    assert snapshot(tree) == pristine


def test_rung_0_puts_back_the_profile_s_own_floor(tmp_path: Path) -> None:
    tree = copy_board(RK, tmp_path)
    pristine = snapshot(tree)
    write_profile(tmp_path / "profiles", "floored",
                  "include: [rk3588]\ndvfs: {cpu: {cluster:big: {min_khz: 1008000}}}\n")
    engine = engine_for(tree, tmp_path / "state", [tmp_path / "profiles", REPO / "profiles"])
    engine.apply("floored")
    latency = knobs(engine)
    assert latency.ladder()[1].cpu_floor_khz == {"policy4": 1608000, "policy6": 1608000}
    latency.apply(3)
    assert floor(tree, "policy4") == "2400000" and engine.verify() == []
    latency.apply(0)
    assert floor(tree, "policy4") == floor(tree, "policy6") == "1008000"
    assert engine.verify() == []
    latency.apply(3)
    engine.rollback()  # with the layer on: every original back
    assert snapshot(tree) == pristine


def test_without_a_profile_the_layer_keeps_its_own_journal(tmp_path: Path) -> None:
    tree = copy_board(RK, tmp_path)
    pristine = snapshot(tree)
    engine = engine_for(tree, tmp_path / "state")
    latency = knobs(engine)
    latency.apply(3)
    assert engine.journal.load().profile == layer.JOURNAL_PROFILE  # type: ignore[union-attr]
    assert floor(tree, "policy0") == "1800000"
    latency.restore()
    assert not engine.journal.exists() and snapshot(tree) == pristine


def test_a_cap_that_came_after_the_ladder_clips_the_floor(
        rk: tuple[Path, Engine, dict]) -> None:
    tree, engine, _ = rk
    latency = knobs(engine)
    Root(tree).write_text(f"{POLICIES}/policy4/scaling_max_freq", "1416000")  # thermal
    latency.apply(3)
    assert (floor(tree, "policy4"), floor(tree, "policy6")) == ("1416000", "2400000")


def test_a_rung_outside_the_ladder_is_refused(rk: tuple[Path, Engine, dict]) -> None:
    _tree, engine, _ = rk
    with pytest.raises(KnobError, match=r"rung 5: the ladder has rungs 0\.\.4"):
        knobs(engine).apply(5)


# -- crashes and refusals --------------------------------------------------------------------

CRASH = """
import os, sys
from agent.discovery import discover
from agent.kernel.fsroot import Root
from agent.tuning.journal import Journal
from agent.tuning.latency_knobs import LatencyKnobs

class Dying(Root):
    writes = 0
    def write_text(self, path, value):
        if self.writes == 1:
            os._exit(9)  # killed between two floor writes
        self.writes += 1
        super().write_text(path, value)

root = Dying(sys.argv[1])
LatencyKnobs(root, discover(root), Journal(sys.argv[2])).apply(3)
"""


def test_a_crash_between_two_floor_writes_is_rolled_back(
        rk: tuple[Path, Engine, dict]) -> None:
    tree, engine, pristine = rk
    applied = snapshot(tree)
    died = subprocess.run([sys.executable, "-c", CRASH, str(tree), str(engine.journal.dir)],
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert died.returncode == 9
    assert (floor(tree, "policy4"), floor(tree, "policy6")) == ("2400000", "408000")
    assert layer.under(engine.journal.load()) == {
        f"{POLICIES}/policy4/scaling_min_freq": None,
        f"{POLICIES}/policy6/scaling_min_freq": None}
    knobs(engine).restore()  # the restarted service: rung 0 is the profile again
    assert snapshot(tree) == applied
    subprocess.run([sys.executable, "-c", CRASH, str(tree), str(engine.journal.dir)],
                   env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    engine.rollback()  # `edge-agent profile rollback`
    assert snapshot(tree) == pristine


class Refusing(Root):
    """A kernel whose cpufreq driver refuses policy6's floor (EINVAL)."""

    def write_text(self, path: str, value: str) -> None:
        if path == f"{POLICIES}/policy6/scaling_min_freq" and value != "0":
            raise OSError(errno.EINVAL, "Invalid argument")
        super().write_text(path, value)


def test_a_refused_floor_leaves_the_rung_it_was_on(tmp_path: Path) -> None:
    tree = copy_board(RK, tmp_path)
    engine = engine_for(tree, tmp_path / "state")
    engine.apply("rk3588")
    refusing = Engine(Refusing(tree), engine.topology, engine.journal, engine.store)
    latency = knobs(refusing)
    before, journal = snapshot(tree), engine.journal.load()
    with pytest.raises(KnobError) as refused:
        latency.apply(4)
    assert str(refused.value).startswith(f"rung 4 not applied: {POLICIES}/policy6/"
                                         "scaling_min_freq: writing 2400000")
    assert "EINVAL" in str(refused.value)
    assert latency.rung == 0 and latency.hold_us is None
    assert snapshot(tree) == before  # policy4's floor put back, no hold left
    assert engine.journal.load() == journal


def test_einval_from_the_fixture_kernel_puts_back_the_step(
        rk: tuple[Path, Engine, dict]) -> None:
    tree, engine, _ = rk
    knobs(engine).apply(1)
    before, journal = snapshot(tree), engine.journal.load()
    targets = {layer.Layered(f"{POLICIES}/policy4/scaling_min_freq", "test"): "1800000",
               layer.Layered(f"{POLICIES}/policy6/scaling_min_freq", "test"): "max"}
    with pytest.raises(layer.LayerError) as refused:
        layer.set_layer(engine.root, engine.journal, targets)
    assert refused.value.errno == errno.EINVAL
    assert str(refused.value).startswith(f"{POLICIES}/policy6/scaling_min_freq: writing max")
    assert snapshot(tree) == before and engine.journal.load() == journal
    assert floor(tree, "policy4") == "1200000"


def test_a_profile_switch_takes_the_layer_off(rk: tuple[Path, Engine, dict]) -> None:
    """The engine's apply plans against the journal's originals and drops the layer."""
    tree, engine, pristine = rk
    knobs(engine).apply(3)
    engine.apply("rk3588")
    assert floor(tree, "policy4") == "408000" and layer.under(engine.journal.load()) == {}
    engine.rollback()
    assert snapshot(tree) == pristine


def test_journal_entries_keep_the_true_originals(rk: tuple[Path, Engine, dict]) -> None:
    _tree, engine, _ = rk
    knobs(engine).apply(2)
    state = Journal(engine.journal.dir).load()
    assert state is not None
    entry = next(c for c in state.changes
                 if c.path == f"{POLICIES}/policy4/scaling_min_freq")
    assert (entry.current, entry.desired, entry.restore_value) == ("408000", "1800000", "0")


def test_a_restarted_controller_builds_the_same_ladder_and_clears_old_floors(
        rk: tuple[Path, Engine, dict]) -> None:
    """Floors a previous run left (its ladder raised policy0 too) are under the layer: the
    new ladder starts from the profile's floors and its first move takes the stray off."""
    tree, engine, _ = rk
    fresh = knobs(engine).ladder()
    layer.set_layer(engine.root, engine.journal, {
        layer.Layered(f"{POLICIES}/policy0/scaling_min_freq", "old"): "1800000",
        layer.Layered(f"{POLICIES}/policy4/scaling_min_freq", "old"): "2400000"})
    restarted = knobs(engine)
    assert restarted.ladder() == fresh
    restarted.apply(1)
    assert (floor(tree, "policy0"), floor(tree, "policy4")) == ("408000", "1200000")
    assert sorted(layer.under(engine.journal.load())) == [
        f"{POLICIES}/policy4/scaling_min_freq", f"{POLICIES}/policy6/scaling_min_freq"]
    journal = engine.journal.path.stat().st_ino  # each save replaces the file
    restarted.apply(1)  # where it is already: nothing written, the journal as it was
    assert engine.journal.path.stat().st_ino == journal


class Clamping(Root):
    """A kernel that keeps a lower floor than asked on policy6 (another max request)."""

    def write_text(self, path: str, value: str) -> None:
        if path == f"{POLICIES}/policy6/scaling_min_freq" and value.isdigit():
            value = str(min(int(value), 1416000))
        super().write_text(path, value)


def test_a_floor_that_does_not_read_back_is_not_applied(
        rk: tuple[Path, Engine, dict]) -> None:
    tree, engine, _ = rk
    before, journal = snapshot(tree), engine.journal.load()
    latency = knobs(Engine(Clamping(tree), engine.topology, engine.journal, engine.store))
    with pytest.raises(KnobError, match="policy6/scaling_min_freq: writing 1800000 .*: EIO "
                       r"\(reads back '1416000'\)"):
        latency.apply(2)
    assert (latency.rung, snapshot(tree), engine.journal.load()) == (0, before, journal)


@pytest.mark.parametrize("board", ["jetson-orin-nano-jp6", "x86-edge-npu", "rpi5-hailo"])
def test_every_rung_and_back_on_other_boards(tmp_path: Path, board: str) -> None:
    """Jetson (nvpmodel's caps in scaling_max_freq), intel_pstate (no frequency table: even
    steps, dynamic powersave), a single-policy Pi: each rung reads back, rung 0 is the
    device as it was."""
    tree = copy_board(board, tmp_path)
    pristine = snapshot(tree)
    engine = engine_for(tree, tmp_path / "state")
    latency = knobs(engine)
    assert len(latency.ladder()) > 3
    for rung, step in enumerate(latency.ladder()):
        latency.apply(rung)
        for policy, khz in (step.cpu_floor_khz or {}).items():
            assert floor(tree, policy) == str(khz)
        assert engine.verify() == []
    latency.restore()
    assert snapshot(tree) == pristine and not engine.journal.exists()


class Watching(Root):
    """Records, for each write, whether another thread could take the journal's lock."""

    def __init__(self, base: Path, journal: Journal) -> None:
        super().__init__(base)
        self.lock, self.free = Journal(journal.dir).updating, []  # another object, one lock

    def write_text(self, path: str, value: str) -> None:
        def try_lock() -> None:
            if self.lock.acquire(blocking=False):
                self.lock.release()
                self.free.append(path)
        other = threading.Thread(target=try_lock)
        other.start()
        other.join()
        super().write_text(path, value)


def test_every_journal_writer_holds_the_journal_s_lock(tmp_path: Path) -> None:
    """The engine, the knobs and the dynamic THP controller share one journal from several
    threads: none saves over another's entry mid-update."""
    tree = copy_board("rk3588-mainline", tmp_path)  # no transparent_hugepage= set
    (tree / "proc/pressure").mkdir(exist_ok=True)  # memory pressure: THP's levers
    (tree / "proc/pressure/memory").write_text("some avg10=30.00 avg60=1.00 avg300=0.50 "
                                               "total=1\nfull avg10=0 avg60=0 avg300=0 total=1\n")
    pristine = snapshot(tree)
    plain = engine_for(tree, tmp_path / "state")
    root = Watching(tree, plain.journal)
    engine = Engine(root, plain.topology, plain.journal, plain.store)
    engine.apply("rk3588")  # THP on madvise: the dynamic controller has levers
    knobs(engine).apply(3)
    thp = ThpDynamicController(root, plain.journal, {"disable_above_psi_some_avg10": 20},
                               lambda event: None)
    assert thp.step(0.0) is not None
    engine.rollback()
    assert len(root.free) == 0 and snapshot(tree) == pristine
