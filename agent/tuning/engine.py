"""Plan, apply, verify, rollback.

A plan writes nothing; apply journals each original value (fsync'd, keyed by boot id) before
writing it; verify re-reads every planned path; rollback restores the originals exactly, and a
journal from another boot is not replayed onto fresh sysfs.

Switching profiles is transactional: the new profile is loaded, validated and planned
against the original values before anything is written, and the new journal (holding every
original, old and new) is durable before the first write.  A write that fails midway undoes
what was written, so no half-applied state remains.

Settings that survive a reboot (``Change.persistent``: kernel arguments in the boot config,
irqbalance's config, systemd drop-ins) keep their originals in a second, persistent journal
that the boot-id rule never discards.  They are written only by an engine made with
``persistent=True``: the CLI run as root (``sudo edge-agent profile apply``).  The service
runs with ProtectSystem=full (/etc and /boot read-only), so its engine applies and rolls back
the runtime changes only and reports the persistent ones as pending.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial, update_wrapper
from typing import Any, Concatenate, ParamSpec, TypeVar

from agent.discovery.model import Topology
from agent.kernel import irqs
from agent.kernel import sched as rt
from agent.kernel.fsroot import Root
from agent.tuning import conflicts, coowners
from agent.tuning.errors import ProfileError
from agent.tuning.journal import (
    Journal,
    JournalState,
    current_boot_id,
    gone_with_boot,
    live_state,
)
from agent.tuning.kinds import KINDS, follow_ups
from agent.tuning.placement import Placement, detect
from agent.tuning.plan import Change, Plan, PlanContext, matches, read_normalised
from agent.tuning.profiles import ProfileStore
from agent.tuning.refusals import optional_refusal
from agent.tuning.tuners import (
    block,
    cgroup,
    cmdline,
    cpuidle,
    dvfs,
    io_uring,
    irqbalance,
    jetson,
    jetson_clocks,
    memlock,
    nvme,
    pcie,
    rknpu,
    sysctl,
    thp,
)
from agent.tuning.tuners import rt as rt_tuner
from agent.tuning.units import UnitError, Units

Planner = Callable[[dict[str, Any], PlanContext], None]
# Order of application; rollback runs in reverse.  The cgroup tuner comes first and is bound
# to the engine's placement (see ``Engine.planners``).  The nvpmodel mode is switched before
# any clock is set (a switch rewrites the limits); jetson_clocks comes after dvfs.
TUNERS: tuple[tuple[str, Planner], ...] = (
    ("nvpmodel", jetson.plan), ("thp", thp.plan), ("sysctl", sysctl.plan),
    ("io_uring", io_uring.plan), ("rt", rt_tuner.plan),
    ("block", block.plan), ("nvme", nvme.plan), ("cpuidle", cpuidle.plan),
    ("dvfs", dvfs.plan), ("jetson_clocks", jetson_clocks.plan), ("pcie", pcie.plan),
    ("rknpu", rknpu.plan), ("cmdline", cmdline.plan), ("irqbalance", irqbalance.plan),
    ("io_uring", memlock.plan))
PENDING = "pending: the service does not write persistent settings (ProtectSystem=full); " \
    "`sudo edge-agent profile apply {profile}` does"


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _links_read_once(method: Callable[Concatenate[Engine, _P], _R]
                     ) -> Callable[Concatenate[Engine, _P], _R]:
    """One engine operation reads each sysfs link once (Root.cached_links): a plan resolves
    every path through the same few directories, which was most of its time.  It holds the
    journal's update lock too, so a controller's journal update (dynamic THP, the latency
    knobs) never lands in the middle of it."""

    def within(self: Engine, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self.root.cached_links(), self.journal.updating:
            return method(self, *args, **kwargs)

    update_wrapper(within, method)  # its name and docstring
    return within


class TuningError(RuntimeError):
    """Apply or rollback could not complete; the message says what is left and why."""


@dataclass
class ApplyResult:
    plan: Plan
    written: list[Change] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # "path: reason"
    notes: list[str] = field(default_factory=list)
    pending: list[Change] = field(default_factory=list)  # persistent, left to the CLI


def _managed_irq(change: Change, error: OSError) -> bool:
    """EIO from an IRQ's affinity file: a managed IRQ (the plan already skipped per-CPU ones),
    reported, not fatal.  EIO anywhere else, /proc/irq/default_smp_affinity included, is."""
    return error.errno == errno.EIO and irqs.affinity_irq(change.path) is not None


def _refused_affinity(change: Change, error: OSError | rt.RtError) -> str | None:
    """An io_uring thread the kernel pins itself refuses sched_setaffinity (EINVAL):
    reported, not fatal, with io_uring's own way to place it."""
    what = rt.io_uring_thread(change.note) if change.compare == "sched" else None
    if what is None or not isinstance(error, rt.AffinityRefused):
        return None
    return f"kernel refuses affinity ({what})"


class Engine:
    def __init__(self, root: Root, topology: Topology, journal: Journal,
                 store: ProfileStore | None = None, placement: Placement | None = None,
                 persistent: bool = False, lasting: Journal | None = None) -> None:
        self.root = root
        self.topology = topology
        self.journal = journal
        # whether this engine writes persistent settings (the CLI as root, not the service)
        self.persistent = persistent
        self.lasting = lasting or Journal.persistent(journal.dir)
        self.store = store or ProfileStore(root)
        # where the data plane runs: the cgroup tuner's limits go there (units or files)
        self.placement = placement or detect(root, topology)

    def planners(self) -> tuple[tuple[str, Planner], ...]:
        return (("cgroup", partial(cgroup.plan, placement=self.placement)), *TUNERS)

    @_links_read_once
    def plan(self, name: str, force: bool = False,
             baseline: dict[str, str | None] | None = None) -> Plan:
        """Pure: load, validate, resolve against the hardware; nothing is written."""
        profile = self.store.auto(self.topology.board) if name == "auto" else \
            self.store.load(name)
        if profile.match and not force and not profile.matches(self.topology.board):
            board = self.topology.board
            raise ProfileError(profile.file, "match", f"{profile.match} does not match this "
                               f"device (family {board.family}, soc {board.soc}, model "
                               f"{board.model}); use --force to apply it anyway")
        ctx = PlanContext(self.root, self.topology, profile, baseline)
        settings = rt_tuner.with_kernel_args(profile.settings)  # irqaffinity= beside the mask
        for section, planner in self.planners():
            if section in settings:
                with ctx.writes_checked(section):
                    planner(settings[section], ctx)
        irqbalance.warn_unbanned(profile.settings, ctx)
        if "dvfs" in profile.settings.get("overlay", {}):
            ctx.warnings.append(f"overlay.dvfs: {profile.settings['overlay']['dvfs']} is a "
                                "device-tree overlay, installed only on request")
        ctx.warnings += coowners.warnings(self.root, ctx.changes)  # Armbian's boot services
        for change in ctx.changes:
            ctx.check_writable(change.path, change.key, change.compare)
        ctx.changes = conflicts.check(profile.file, ctx.changes, profile.settings,
                                      self.topology, ctx.cpus)
        return Plan(profile=profile.name, changes=ctx.changes, warnings=ctx.warnings,
                    runtime=ctx.runtime, cpus=ctx.cpus, optional=frozenset(
                        c.key for c in ctx.changes if c.key and not profile.requires(c.key)))

    @_links_read_once
    def apply(self, name: str, force: bool = False) -> ApplyResult:
        notes: list[str] = []
        old = live_state(self.root, self.journal, notes)
        originals = {c.path: c for c in old.changes} if old else {}
        kept = self.lasting.load() if self.persistent else None  # never stale: no boot-id rule
        lasting = {c.path: c for c in kept.changes} if kept else {}
        plan = self.plan(name, force, {p: c.current for p, c in {**originals, **lasting}.items()})
        entries = self._journal_entries([c for c in plan.changes if not c.persistent],
                                        originals)
        held = [c for c in plan.changes if c.persistent]
        lasting_entries = self._journal_entries(held, lasting) if self.persistent else []
        result = ApplyResult(plan=plan, notes=notes, pending=[] if self.persistent else held)
        result.notes += [f"{c.path}: {PENDING.format(profile=plan.profile)}"
                         for c in result.pending]
        if any(c.tuner == "cgroup" and c.compare != "unit" for c in entries):
            try:  # the data plane's leaf and its controllers: neutral, needed for the writes
                self.placement.prepare()
            except OSError as error:
                raise TuningError(f"applying {plan.profile}: the data plane's cgroup cannot "
                                  f"be prepared: {error}; nothing was written") from None
        boot_id = current_boot_id(self.root)
        state = JournalState(profile=plan.profile, boot_id=boot_id,
                             root=str(self.root.base), changes=entries, runtime=plan.runtime)
        self.journal.save(state)  # every original is durable before the first write
        if lasting_entries:
            self.lasting.save(JournalState(profile=plan.profile, boot_id=boot_id,
                                           root=str(self.root.base), changes=lasting_entries,
                                           status="applied"))
        # the old profile's leftovers first, then the plan in its own order (an nvpmodel mode
        # before the clocks it rewrites); rollback restores the runtime journal first
        planned = {id(c) for c in plan.changes}
        every = [c for c in [*entries, *lasting_entries] if id(c) not in planned] + [
            c for c in plan.changes if self.persistent or not c.persistent]
        for index, change in enumerate(every):
            try:
                self._write(change, change.write_value)
            except ProcessLookupError:  # a thread the plan named has exited since
                result.skipped.append(f"{change.path}: the thread has exited")
                continue
            except (OSError, rt.RtError) as error:
                if isinstance(error, OSError) and _managed_irq(change, error):
                    result.skipped.append(f"{change.path}: {irqs.MANAGED}")
                    continue
                refused = _refused_affinity(change, error) or optional_refusal(
                    change, error, plan.optional)
                if refused is not None:
                    result.skipped.append(f"{change.path}: {refused}")
                    state.runtime = {**state.runtime,
                                     "skipped": [s.split(":")[0] for s in result.skipped]}
                    self.journal.save(state, durable=False)  # rollback leaves it alone
                    continue
                gone = set(state.runtime.get("skipped", []))
                self._undo_apply([c for c in every[:index] if c.path not in gone],
                                 every[index:], old)
                raise TuningError(f"applying {plan.profile} failed at {change.path} "
                                  f"({change.key}): {error}; every earlier write was rolled "
                                  "back") from None
            result.written.append(change)
        state.status = "applied"
        state.runtime = {**plan.runtime, "skipped": [s.split(":")[0] for s in result.skipped]}
        self.journal.save(state, durable=False)  # "applying" would roll back just as well
        if lasting_entries and not held:  # only restores of the old profile's settings
            self.lasting.clear()
        result.notes += follow_ups(self.root, [c.path for c in lasting_entries])
        return result

    @staticmethod
    def _journal_entries(changes: list[Change], originals: dict[str, Change]) -> list[Change]:
        """New changes carry the true originals; paths only the old profile touched are
        restored as part of the switch (first, in reverse of their old order)."""
        planned = {c.path for c in changes}
        entries = [Change(tuner=c.tuner, path=c.path, current=c.current, desired=c.current or "",
                          key=c.key, compare=c.compare, write=c.restore, restore=c.restore,
                          note="restored: the new profile leaves it alone",
                          persistent=c.persistent, resets=c.resets)
                   for c in Engine._restore_order(list(originals.values()))
                   if c.path not in planned]
        for change in changes:
            old = originals.get(change.path)
            if old is not None:
                change.current, change.restore = old.current, old.restore
            entries.append(change)
        return entries

    def _write(self, change: Change, value: str) -> None:
        """A kernel file write, a thread's scheduling for ``sched`` changes, a unit's
        runtime property for ``unit`` changes."""
        if change.compare == "sched":
            rt.apply_thread_sched(rt.tid_of(change.path), rt.parse_sched(value))
        elif change.compare == "unit":
            self._units().set_runtime(*cgroup.split_unit_path(change.path), value)
        elif change.compare in KINDS:
            KINDS[change.compare].write(self.root, change.path, value)
        else:
            self.root.write_text(change.path, value)

    @staticmethod
    def _restore_order(written: list[Change]) -> list[Change]:
        """Reverse order, except that a change another one resets as a side effect is
        restored right after that one (the scheduler, then nr_requests), not before it."""
        order = list(reversed(written))
        for change in list(order):
            for path in change.resets:
                dependent = next((c for c in order if c.path == path), None)
                if dependent is not None and order.index(dependent) < order.index(change):
                    order.remove(dependent)
                    order.insert(order.index(change) + 1, dependent)
        return order

    def _restore(self, written: list[Change]) -> dict[str, str]:
        """Every original back, in reverse (but see _restore_order); path -> error for those
        that failed."""
        failures = {}
        for change in self._restore_order(written):
            try:
                self._write(change, change.restore_value)
            except ProcessLookupError:
                continue  # the thread is gone: nothing is left to restore
            except (OSError, rt.RtError) as error:
                if isinstance(error, OSError) and _managed_irq(change, error):
                    continue  # the kernel never let it change (an apply cut short before
                    # it journaled the skip): the original still stands
                failures[change.path] = f"{change.path}: {error}"
        return failures

    def _undo_apply(self, written: list[Change], unwritten: list[Change],
                    old: JournalState | None = None) -> None:
        """A failed apply puts back what the device held before it: a failed switch leaves
        the old profile applied (each written path gets the old profile's value where it set
        one, and the old runtime journal, with every original, stays), a failed first apply
        leaves the originals and no runtime journal.  The persistent journal keeps every
        original that may still be needed (a setting not restored, or one not reached,
        which may hold the old profile's value)."""
        before = {c.path: c for c in old.changes} if old else {}
        skipped = set(old.runtime.get("skipped", [])) if old else set()
        back = [replace(c, restore=before[c.path].write_value)
                if c.path in before and c.path not in skipped and not c.persistent else c
                for c in written]
        failures = self._restore(back)
        if not any(not c.persistent for c in written if c.path in failures):
            if old is not None:
                self.journal.save(old)
            else:
                self.journal.clear()
        left = [c for c in [*written, *unwritten] if c.persistent and
                (c.path in failures or c in unwritten)]
        state = self.lasting.load() if any(c.persistent for c in written) or left else None
        if state is not None and left:
            state.changes = left
            self.lasting.save(state)
        elif state is not None:
            self.lasting.clear()
        follow_ups(self.root, [c.path for c in written if c.persistent])

    @_links_read_once
    def verify(self) -> list[tuple[Change, str | None]]:
        """Every journaled path that no longer holds its desired value, with what it holds.
        A runtime journal from another boot is not drift: its settings went with the reboot
        (journal.gone_with_boot says so)."""
        state = self.journal.load()
        state = None if gone_with_boot(state, self.root) else state
        kept = self.lasting.load()
        if state is None and kept is None:
            return []
        skipped = set(state.runtime.get("skipped", [])) if state else set()
        drift = []
        for change in [*(state.changes if state else []), *(kept.changes if kept else [])]:
            if change.path in skipped:
                continue
            try:
                actual = self._read(change)
            except (OSError, ValueError) as error:
                actual = f"unreadable: {error}"
            if actual is None and change.compare == "sched":
                continue  # the thread has exited: there is nothing left to hold
            if not matches(change, actual):
                drift.append((change, actual))
        return drift

    def _units(self) -> Units:
        if self.placement.units is None:
            raise UnitError(errno.ENOSYS, "systemd does not run here: the journal's unit "
                            "properties cannot be set")
        return self.placement.units

    def _read(self, change: Change) -> str | None:
        if change.compare == "unit":
            unit, name = cgroup.split_unit_path(change.path)
            return self._units().show(unit, [name]).get(name)
        return read_normalised(self.root, change.path, change.compare)

    @_links_read_once
    def rollback(self) -> tuple[str | None, list[str]]:
        """Restore every original in reverse order; returns (profile, notes).  Persistent
        settings too when this engine writes them; otherwise a note says they remain."""
        notes: list[str] = []
        state = live_state(self.root, self.journal, notes)
        kept = self.lasting.load()
        failures: list[str] = []
        if state is not None:
            skipped = set(state.runtime.get("skipped", []))
            lost = self._restore([c for c in state.changes if c.path not in skipped])
            failures += lost.values()
            if not lost:
                self.journal.clear()
        if kept is not None and self.persistent:
            lost = self._restore(kept.changes)
            failures += lost.values()
            notes += follow_ups(self.root, [c.path for c in kept.changes])
            if not lost:
                self.lasting.clear()
        elif kept is not None:
            notes.append(f"{self.lasting.path}: the persistent settings of {kept.profile} "
                         f"({', '.join(c.path for c in kept.changes)}) stay: the service "
                         "does not write them (ProtectSystem=full); `sudo edge-agent profile "
                         "rollback` restores them")
        if failures:
            raise TuningError("rollback left these paths unrestored (journal kept, run "
                              "rollback again): " + "; ".join(failures))
        done = state or (kept if self.persistent else None)
        if done is None:
            return None, notes or ["nothing to roll back"]
        return done.profile, notes
