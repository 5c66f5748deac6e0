"""Dynamic THP: switches on real fixture trees, journaled so Engine.rollback restores them.

Pressure is driven by rewriting the copied tree's /proc/pressure/memory and memory.events
between ``step()`` calls; time is injected, so nothing sleeps.  The host is only ever read.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Any

import pytest

from agent.discovery import discover
from agent.kernel.fsroot import Root
from agent.tuning.engine import Engine
from agent.tuning.journal import Journal
from agent.tuning.profiles import ProfileStore
from agent.tuning.thp_dynamic import (
    DEFRAG,
    ENABLED,
    NORMAL_KEYS,
    ThpDynamicController,
    ThpDynamicError,
    parse_memory_events,
    parse_psi_some_avg10,
    parse_settings,
    read_psi_some_avg10,
)

FIXTURES = Path(__file__).resolve().parent / "fixtures"
THP_FILE = ENABLED.lstrip("/")
CGROUP = "/sys/fs/cgroup/system.slice/edge-agent.service"
SETTINGS = {"disable_above_psi_some_avg10": 20, "restore_below_psi_some_avg10": 10,
            "hold_s": 30}
PROFILE = """\
name: thp-test
thp:
  enabled: madvise
  defrag: always
  dynamic: {disable_above_psi_some_avg10: 20, restore_below_psi_some_avg10: 10, hold_s: 30}
"""


def copy_board(tmp_path: Path, board: str = "rk3588-mainline") -> Path:
    tree = tmp_path / board
    shutil.copytree(FIXTURES / board, tree, symlinks=True)
    return tree


def set_psi(tree: Path, avg10: float) -> None:
    (tree / "proc/pressure").mkdir(exist_ok=True)
    (tree / "proc/pressure/memory").write_text(
        f"some avg10={avg10:.2f} avg60=1.00 avg300=0.50 total=123456\n"
        "full avg10=0.00 avg60=0.00 avg300=0.00 total=4567\n")


def set_high_events(tree: Path, high: int) -> None:
    (tree / CGROUP.lstrip("/") / "memory.events").write_text(
        f"low 0\nhigh {high}\nmax 0\noom 0\noom_kill 0\noom_group_kill 0\n")


def thp_text(tree: Path) -> str:
    return (tree / THP_FILE).read_text()


class Harness:
    """A copied tree, its journal and a controller whose events are collected."""

    def __init__(self, tmp_path: Path, board: str = "rk3588-mainline",
                 settings: dict[str, Any] | None = None) -> None:
        self.tree = copy_board(tmp_path, board)
        self.root = Root(self.tree)
        self.journal = Journal(tmp_path / "state")
        self.settings = SETTINGS if settings is None else settings
        self.events: list[dict[str, Any]] = []

    def controller(self, cgroup_dir: str | None = None) -> ThpDynamicController:
        return ThpDynamicController(self.root, self.journal, self.settings, self.events.append,
                                    cgroup_dir=cgroup_dir)

    def engine(self, profiles: Path | None = None) -> Engine:
        store = ProfileStore(self.root, dirs=[profiles]) if profiles else None
        return Engine(self.root, discover(self.root), self.journal, store)


@pytest.fixture
def harness(tmp_path: Path) -> Harness:
    return Harness(tmp_path)


# -- switching and hysteresis --------------------------------------------------------------

DEFRAG_FILE = DEFRAG.lstrip("/")
DEFRAG_NORMAL = "always defer defer+madvise [madvise] never\n"
DEFRAG_NEVER = "always defer defer+madvise madvise [never]\n"


def defrag_text(tree: Path) -> str:
    return (tree / DEFRAG_FILE).read_text()


def test_high_psi_stops_direct_compaction_first_then_thp(harness: Harness) -> None:
    """defrag (direct compaction, where the stalls come from) goes first; enabled only
    when pressure is still high a hold time later."""
    controller = harness.controller()
    assert controller.inactive_reason is None
    assert controller.normals == {DEFRAG: "madvise", ENABLED: "always"}
    set_psi(harness.tree, 0)
    assert controller.step(0.0) is None
    set_psi(harness.tree, 34.2)
    event = controller.step(5.0)
    assert event == {"type": "thp_switched", "file": "defrag", "from": "madvise",
                     "to": "never", "reason": "psi some avg10 34.2 > 20", "mono_ms": 5000}
    assert harness.events == [event]
    assert (defrag_text(harness.tree), thp_text(harness.tree)) == (
        DEFRAG_NEVER, "[always] madvise never\n")
    assert controller.step(10.0) is None  # still high, inside the hold: no second event
    event = controller.step(35.0)
    assert event is not None and (event["file"], event["from"], event["to"]) == (
        "enabled", "always", "never")
    assert event["reason"] == "psi some avg10 34.2 > 20, 30 s after defrag went to never"
    assert thp_text(harness.tree) == "always madvise [never]\n"
    assert controller.step(100.0) is None  # nothing left to pull
    assert len(harness.events) == 2


def test_levers_are_released_in_reverse(harness: Harness) -> None:
    controller = harness.controller()
    set_psi(harness.tree, 50)
    controller.step(0.0)
    controller.step(30.0)
    set_psi(harness.tree, 1)
    assert controller.step(59.0) is None  # the hold runs from the last switch
    assert [controller.step(t)["file"] for t in (60.0, 90.0)] == ["enabled", "defrag"]
    assert (defrag_text(harness.tree), thp_text(harness.tree)) == (
        DEFRAG_NORMAL, "[always] madvise never\n")
    assert [(e["file"], e["to"]) for e in harness.events] == [
        ("defrag", "never"), ("enabled", "never"), ("enabled", "always"),
        ("defrag", "madvise")]


def test_defrag_that_never_stalls_is_left_alone(harness: Harness) -> None:
    (harness.tree / DEFRAG_FILE).write_text("always [defer] defer+madvise madvise never\n")
    controller = harness.controller()
    assert controller.levers == [ENABLED]
    set_psi(harness.tree, 50)
    event = controller.step(0.0)
    assert event is not None and event["file"] == "enabled"


def test_an_admin_thp_mode_leaves_only_defrag(harness: Harness) -> None:
    cmdline = harness.tree / "proc/cmdline"
    cmdline.write_text(cmdline.read_text().strip() + " transparent_hugepage=always\n")
    controller = harness.controller()
    assert controller.inactive_reason is None and controller.levers == [DEFRAG]
    set_psi(harness.tree, 50)
    assert controller.step(0.0)["file"] == "defrag"
    assert controller.step(100.0) is None  # enabled is the administrator's
    assert thp_text(harness.tree) == "[always] madvise never\n"


def test_restore_waits_for_low_pressure_and_hold(harness: Harness) -> None:
    controller = harness.controller()
    set_psi(harness.tree, 50)
    assert controller.step(100.0) is not None
    set_psi(harness.tree, 3.5)
    assert controller.step(110.0) is None  # low, but only 10 s of the 30 s hold
    assert controller.step(129.9) is None
    assert defrag_text(harness.tree) == DEFRAG_NEVER
    event = controller.step(130.0)
    assert event is not None and (event["from"], event["to"]) == ("never", "madvise")
    assert event["reason"] == "psi some avg10 3.5 < 10, 30 s since the last switch (hold 30 s)"
    assert defrag_text(harness.tree) == DEFRAG_NORMAL
    assert [e["to"] for e in harness.events] == ["never", "madvise"]


def test_pressure_inside_the_band_never_flaps(harness: Harness) -> None:
    controller = harness.controller()
    # At or just below the trigger: no switch (the trigger is strictly above).
    for now, avg10 in enumerate([19.9, 20.0, 15.0, 20.0, 0.0]):
        set_psi(harness.tree, avg10)
        assert controller.step(float(now)) is None
    set_psi(harness.tree, 20.01)
    assert controller.step(10.0) is not None
    # Between restore_below and disable_above, for far longer than the hold: stays never.
    for now, avg10 in zip(range(11, 500, 7), [10.0, 19.0, 20.0, 12.5, 10.0] * 20, strict=False):
        set_psi(harness.tree, avg10)
        assert controller.step(float(now)) is None
    assert defrag_text(harness.tree) == DEFRAG_NEVER
    assert len(harness.events) == 1


def test_default_restore_is_half_the_trigger_and_hold_is_30s(tmp_path: Path) -> None:
    harness = Harness(tmp_path, settings={"disable_above_psi_some_avg10": 20})
    controller = harness.controller()
    set_psi(harness.tree, 21)
    assert controller.step(0.0) is not None
    set_psi(harness.tree, 10)  # not below 10 (half of 20)
    assert controller.step(100.0) is None
    set_psi(harness.tree, 9.99)
    assert controller.step(29.0) is None  # below, but inside the 30 s hold
    assert controller.step(30.0) is not None


def test_rising_memory_high_counter_switches_with_psi_low(harness: Harness) -> None:
    set_psi(harness.tree, 0.5)
    set_high_events(harness.tree, 3)
    controller = harness.controller(cgroup_dir=CGROUP)
    assert controller.step(0.0) is None  # counter steady since the controller started
    set_high_events(harness.tree, 7)
    event = controller.step(1.0)
    assert event is not None and event["to"] == "never"
    assert event["reason"] == f"{CGROUP}/memory.events high rose 3 -> 7"
    set_high_events(harness.tree, 9)
    assert controller.step(20.0) is None  # still rising, inside the hold: stays as it is
    assert controller.step(41.0) is not None  # steady and PSI low: back to normal
    assert defrag_text(harness.tree) == DEFRAG_NORMAL


def test_memory_events_alone_when_psi_is_absent(harness: Harness) -> None:
    (harness.tree / "proc/pressure/memory").unlink()
    no_signal = harness.controller()
    assert no_signal.step(0.0) is None
    set_high_events(harness.tree, 0)
    controller = harness.controller(cgroup_dir=CGROUP)
    set_high_events(harness.tree, 1)
    assert controller.step(0.0) is not None
    event = controller.step(30.0)
    assert event is not None and event["to"] == "madvise"
    assert event["reason"].startswith("memory.events high did not rise, 30 s")


# -- journal and rollback ------------------------------------------------------------------


def _originals() -> tuple[bytes, bytes]:
    board = FIXTURES / "rk3588-mainline"
    return (board / THP_FILE).read_bytes(), (board / DEFRAG_FILE).read_bytes()


def _now(tree: Path) -> tuple[bytes, bytes]:
    return (tree / THP_FILE).read_bytes(), (tree / DEFRAG_FILE).read_bytes()


def test_rollback_after_both_switches_restores_the_fixture_bytes(harness: Harness) -> None:
    controller = harness.controller()
    set_psi(harness.tree, 90)
    controller.step(0.0)
    state = harness.journal.load()
    assert state is not None and state.profile == "thp-dynamic"
    [entry] = state.changes
    assert (entry.path, entry.current, entry.desired) == (DEFRAG, "madvise", "never")
    controller.step(30.0)
    assert harness.engine().verify() == []  # the journal follows the switches: no drift
    profile, _ = harness.engine().rollback()
    assert profile == "thp-dynamic"
    assert _now(harness.tree) == _originals()
    assert not harness.journal.exists()


class JournalFirstRoot(Root):
    """Records, at each THP write, what a fresh reader finds in the journal on disk."""

    def __init__(self, base: Path, state_dir: Path) -> None:
        super().__init__(base)
        self.state_dir = state_dir
        self.seen: list[tuple[str, str | None, str]] = []

    def write_text(self, path: str, value: str) -> None:
        state = Journal(self.state_dir).load()
        entry = next(c for c in state.changes if c.path == path) if state else None
        self.seen.append((value, entry.current if entry else None,
                          entry.desired if entry else ""))
        super().write_text(path, value)


def test_original_is_on_disk_before_each_write(tmp_path: Path) -> None:
    tree = copy_board(tmp_path)
    root = JournalFirstRoot(tree, tmp_path / "state")
    controller = ThpDynamicController(root, Journal(tmp_path / "state"), SETTINGS,
                                      lambda event: None)
    set_psi(tree, 30)
    controller.step(0.0)
    set_psi(tree, 0)
    controller.step(60.0)
    assert root.seen == [("never", "madvise", "never"), ("madvise", "madvise", "madvise")]


def test_rollback_restores_the_pre_profile_original(harness: Harness, tmp_path: Path) -> None:
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    (profiles / "thp-test.yaml").write_text(PROFILE)
    harness.engine(profiles).apply("thp-test")
    assert (thp_text(harness.tree), defrag_text(harness.tree)) == (
        "always [madvise] never\n", "[always] defer defer+madvise madvise never\n")
    applied = harness.journal.load()
    assert applied is not None
    harness.settings = applied.runtime["thp_dynamic"]
    controller = harness.controller()
    # what the profile set, not the pre-profile values
    assert controller.normals == {DEFRAG: "always", ENABLED: "madvise"}
    set_psi(harness.tree, 40)
    controller.step(0.0)
    state = harness.journal.load()
    assert state is not None and state.profile == "thp-test"
    assert [(c.path, c.current, c.desired) for c in state.changes] == [
        (ENABLED, "always", "madvise"), (DEFRAG, "madvise", "never")]  # originals kept
    set_psi(harness.tree, 1)
    assert controller.step(30.0) is not None
    assert defrag_text(harness.tree) == "[always] defer defer+madvise madvise never\n"
    set_psi(harness.tree, 40)
    controller.step(31.0)
    assert harness.engine(profiles).rollback()[0] == "thp-test"
    assert _now(harness.tree) == _originals()


def test_restarted_controller_returns_to_the_journaled_normal(harness: Harness) -> None:
    set_psi(harness.tree, 40)
    harness.controller().step(0.0)
    state = harness.journal.load()
    assert state is not None and state.runtime[NORMAL_KEYS[DEFRAG]] == "madvise"
    restarted = harness.controller()  # defrag reads never now; the journal knows the normal
    assert restarted.normals[DEFRAG] == "madvise"
    set_psi(harness.tree, 0)
    assert restarted.step(1000.0) is None  # the hold starts at its first sample
    event = restarted.step(1030.0)
    assert event is not None and (event["from"], event["to"]) == ("never", "madvise")


def test_journal_from_another_boot_is_not_built_on(harness: Harness) -> None:
    set_psi(harness.tree, 40)
    harness.controller().step(0.0)
    (harness.tree / "proc/sys/kernel/random/boot_id").write_text("another-boot\n")
    (harness.tree / DEFRAG_FILE).write_text("[always] defer defer+madvise madvise never\n")
    controller = harness.controller()
    assert controller.normals[DEFRAG] == "always"  # not the stale journal's "madvise"
    controller.step(0.0)
    state = harness.journal.load()
    assert state is not None and state.boot_id == "another-boot"
    assert [(c.current, c.desired) for c in state.changes] == [("always", "never")]


# -- when it must not switch ---------------------------------------------------------------


def test_admin_cmdline_choice_blocks_switching(tmp_path: Path) -> None:
    harness = Harness(tmp_path, board="rk3588-vendor")
    before = _now(harness.tree)
    set_psi(harness.tree, 95)  # the vendor tree has no PSI: give it high pressure
    controller = harness.controller()
    assert controller.inactive_reason is not None
    assert "transparent_hugepage=never" in controller.inactive_reason
    assert controller.step(0.0) is None and controller.step(100.0) is None
    stop = threading.Event()
    controller.run(stop, interval_s=0.001)  # returns at once, writes nothing
    assert _now(harness.tree) == before
    assert harness.events == []
    assert not harness.journal.exists()


def test_absent_thp_makes_the_controller_inactive(harness: Harness) -> None:
    shutil.rmtree(harness.tree / "sys/kernel/mm/transparent_hugepage")
    controller = harness.controller()
    assert controller.inactive_reason is not None and "absent" in controller.inactive_reason
    set_psi(harness.tree, 95)
    assert controller.step(0.0) is None
    assert not harness.journal.exists()


# -- service loop --------------------------------------------------------------------------


def test_run_switches_and_stops_on_request(harness: Harness) -> None:
    stop = threading.Event()
    events: list[dict[str, Any]] = []

    def on_event(event: dict[str, Any]) -> None:
        events.append(event)
        stop.set()

    set_psi(harness.tree, 60)
    ThpDynamicController(harness.root, harness.journal, SETTINGS, on_event).run(stop, 0.001)
    assert [e["type"] for e in events] == ["thp_switched"]
    assert defrag_text(harness.tree) == DEFRAG_NEVER


def test_run_stops_with_an_event_when_the_write_is_refused(harness: Harness) -> None:
    (harness.tree / DEFRAG_FILE).write_text("always defer [madvise]\n")  # no "never": EINVAL
    set_psi(harness.tree, 60)
    stop = threading.Event()
    harness.controller().run(stop, 0.001)
    [event] = harness.events
    assert event["type"] == "thp_dynamic_stopped" and "'never'" in event["reason"]
    assert not stop.is_set()
    assert harness.engine().rollback()[0] == "thp-dynamic"  # the journaled original is fine
    assert defrag_text(harness.tree) == "always defer [madvise]\n"


# -- settings and parsers ------------------------------------------------------------------


@pytest.mark.parametrize(("settings", "key"), [
    ({"disable_above_psi_some_avg10": 20, "restore_below_psi_some_avg10": 20},
     "restore_below_psi_some_avg10"),
    ({"disable_above_psi_some_avg10": 10, "restore_below_psi_some_avg10": 15},
     "restore_below_psi_some_avg10"),
    ({"restore_below_psi_some_avg10": 5}, "disable_above_psi_some_avg10"),
    ({"disable_above_psi_some_avg10": 120}, "disable_above_psi_some_avg10"),
    ({"disable_above_psi_some_avg10": True}, "disable_above_psi_some_avg10"),
    ({"disable_above_psi_some_avg10": 20, "hold_s": -1}, "hold_s"),
    ({"disable_above_psi_some_avg10": 20, "hold": 5}, "hold"),
])
def test_bad_settings_name_the_key(settings: dict[str, Any], key: str) -> None:
    with pytest.raises(ThpDynamicError, match=rf"^thp\.dynamic\.{key}: "):
        parse_settings(settings)


def test_bad_settings_refused_by_the_constructor(harness: Harness) -> None:
    with pytest.raises(ThpDynamicError, match="must be below disable_above_psi_some_avg10"):
        ThpDynamicController(harness.root, harness.journal,
                             {"disable_above_psi_some_avg10": 5,
                              "restore_below_psi_some_avg10": 8}, harness.events.append)


def test_parsers() -> None:
    psi = ("some avg10=34.20 avg60=12.01 avg300=3.00 total=987654\n"
           "full avg10=20.00 avg60=5.00 avg300=1.00 total=12345\n")
    assert parse_psi_some_avg10(psi) == 34.2
    assert parse_psi_some_avg10(psi.splitlines()[1] + "\n" + psi.splitlines()[0]) == 34.2
    with pytest.raises(ValueError, match="no 'some avg10='"):
        parse_psi_some_avg10("full avg10=1.00 avg60=0.00 avg300=0.00 total=1\n")
    assert parse_memory_events("low 0\nhigh 42\nmax 1\noom 0\noom_kill 0\n") == {
        "low": 0, "high": 42, "max": 1, "oom": 0, "oom_kill": 0}


def test_fixture_psi_reads_through_root(harness: Harness) -> None:
    assert read_psi_some_avg10(harness.root) == 0.0
    (harness.tree / "proc/pressure/memory").unlink()
    assert read_psi_some_avg10(harness.root) is None


def test_this_host_memory_psi_is_a_percentage() -> None:
    if not Path("/proc/pressure/memory").exists():
        pytest.skip("this kernel has no PSI (CONFIG_PSI off or psi=0)")
    avg10 = read_psi_some_avg10(Root("/"))
    assert isinstance(avg10, float) and 0.0 <= avg10 <= 100.0
