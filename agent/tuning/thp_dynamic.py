"""Dynamic THP: under memory pressure direct compaction stops first, then THP itself.

The allocation stalls THP causes under pressure come from ``defrag``: a huge-page fault that
finds no free 2 MiB block reclaims and compacts memory synchronously (``always``, and
``madvise``/``defer+madvise`` for madvised regions;
https://docs.kernel.org/admin-guide/mm/transhuge.html).  So the first lever is ``defrag`` to
``never`` (huge pages only where they are free; no direct or background compaction for them),
and only when pressure stays high for a hold time after that is ``enabled`` switched to
``never`` too (no huge-page faults, khugepaged stops).  Levers are released in the reverse
order, each only after pressure has fallen well below the trigger (hysteresis) and a hold time
has passed, so it never flaps.  A lever whose normal value already avoids stalls (``defrag``
at ``defer`` or ``never``) is left alone, as is ``enabled`` where the administrator set
``transparent_hugepage=`` on the command line.  Every switch is journaled before the write,
so ``Engine.rollback`` restores the true original value, and is reported through
``on_event``.  Signals: PSI ``some avg10`` of /proc/pressure/memory
(https://docs.kernel.org/accounting/psi.html) and a cgroup's ``memory.events`` ``high``
counter (https://docs.kernel.org/admin-guide/cgroup-v2.html).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from agent.kernel.fsroot import Root
from agent.kernel.parsers import parse_memory_events, parse_psi, thp_cmdline_choice
from agent.tuning.journal import Journal, JournalState, current_boot_id
from agent.tuning.plan import Change, read_normalised
from agent.tuning.tuners.thp import THP

ENABLED = f"{THP}/enabled"
DEFRAG = f"{THP}/defrag"
PSI_MEMORY = "/proc/pressure/memory"
NEVER = "never"
LEVERS = (DEFRAG, ENABLED)  # pulled in this order under pressure, released in reverse
NO_STALL_DEFRAG = ("defer", NEVER)  # defrag values that never compact synchronously

DISABLE_KEY = "disable_above_psi_some_avg10"
RESTORE_KEY = "restore_below_psi_some_avg10"
HOLD_KEY = "hold_s"
DEFAULT_HOLD_S = 30.0
# Journal runtime keys: the value each lever returns to, so a restarted controller that finds
# it at ``never`` (and the journal entry's desired value already ``never``) still knows it.
NORMAL_KEY = "thp_dynamic_normal"
NORMAL_KEYS = {ENABLED: NORMAL_KEY, DEFRAG: "thp_dynamic_normal_defrag"}
# Profile name of a journal the controller starts itself, when no profile was applied.
JOURNAL_PROFILE = "thp-dynamic"


OnEvent = Callable[[dict[str, Any]], None]


class ThpDynamicError(ValueError):
    """Settings the controller cannot run with; the message names the key."""


@dataclass(frozen=True)
class Thresholds:
    disable_above: float  # PSI some avg10 (%) above which THP goes to never
    restore_below: float  # ... below which it may return to the normal value
    hold_s: float  # minimum time since the last switch before returning


@dataclass(frozen=True)
class Sample:
    avg10: float | None  # None: PSI is not available
    high_rise: tuple[int, int] | None  # memory.events ``high`` (before, after) when it rose
    signals: bool  # False when neither PSI nor memory.events could be read


# -- settings and parsers ------------------------------------------------------------------


def _number(settings: Mapping[str, Any], key: str, default: float | None,
            maximum: float) -> float:
    value = settings.get(key, default)
    if value is None:
        raise ThpDynamicError(f"thp.dynamic.{key}: required")
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not 0 <= value <= maximum:
        raise ThpDynamicError(f"thp.dynamic.{key}: {value!r} is not a number from 0 to "
                              f"{maximum:g}")
    return float(value)


def parse_settings(settings: Mapping[str, Any]) -> Thresholds:
    """Validate a profile's ``thp.dynamic`` section; restore defaults to half the trigger."""
    unknown = sorted(set(settings) - {DISABLE_KEY, RESTORE_KEY, HOLD_KEY})
    if unknown:
        raise ThpDynamicError(f"thp.dynamic.{unknown[0]}: unknown setting (allowed: "
                              f"{DISABLE_KEY}, {RESTORE_KEY}, {HOLD_KEY})")
    disable = _number(settings, DISABLE_KEY, None, 100)
    restore = _number(settings, RESTORE_KEY, disable / 2, 100)
    if restore >= disable:
        raise ThpDynamicError(f"thp.dynamic.{RESTORE_KEY}: {restore:g} must be below "
                              f"{DISABLE_KEY} ({disable:g}), or THP would flap")
    return Thresholds(disable, restore, _number(settings, HOLD_KEY, DEFAULT_HOLD_S, 86400))


def parse_psi_some_avg10(text: str) -> float:
    """``some avg10=34.20 avg60=… total=…`` -> 34.2 (percent of wall time)."""
    some = parse_psi(text).get("some")
    if some is None or "avg10" not in some:
        raise ValueError(f"no 'some avg10=' line in {text.strip()[:80]!r}")
    return some["avg10"]


def read_psi_some_avg10(root: Root) -> float | None:
    """Memory PSI ``some avg10``; None when the kernel has no PSI (CONFIG_PSI off, psi=0)."""
    try:
        return parse_psi_some_avg10(root.read_text(PSI_MEMORY))
    except FileNotFoundError:
        return None


def read_memory_high_events(root: Root, cgroup_dir: str) -> int | None:
    """How often the cgroup went over memory.high; None when the file or counter is absent."""
    try:
        return parse_memory_events(root.read_text(f"{cgroup_dir}/memory.events")).get("high")
    except FileNotFoundError:
        return None


def admin_thp_choice(root: Root) -> str | None:
    """``transparent_hugepage=`` on the kernel command line: the admin's choice, not ours."""
    try:
        cmdline = root.read_text("/proc/cmdline")
    except FileNotFoundError:
        return None
    return thp_cmdline_choice(cmdline)


# -- the controller ------------------------------------------------------------------------


class ThpDynamicController:
    """Samples pressure and pulls the THP levers (``defrag``, then ``enabled``) to ``never``
    and back to their normal values.

    ``settings`` is a profile's ``thp.dynamic`` section (the journal's
    ``runtime["thp_dynamic"]`` after apply).  ``cgroup_dir`` is a logical cgroup path whose
    ``memory.events`` ``high`` counter rising between samples also counts as high pressure.
    ``inactive_reason`` says why the controller will never switch (None when it may).
    """

    def __init__(self, root: Root, journal: Journal, settings: Mapping[str, Any],
                 on_event: OnEvent, cgroup_dir: str | None = None) -> None:
        self.root = root
        self.journal = journal
        self.thresholds = parse_settings(settings)
        self.on_event = on_event
        self.cgroup_dir = cgroup_dir.rstrip("/") if cgroup_dir else None
        self._last_high = read_memory_high_events(root, self.cgroup_dir) \
            if self.cgroup_dir else None
        self._last_switch: float | None = None
        current = {path: read_normalised(root, path, "selection") for path in LEVERS}
        self.normals = {path: self._normal(path, value) for path, value in current.items()}
        self.admin = admin_thp_choice(root)
        self.levers = [path for path in LEVERS if self._pulls(path, current[path])]
        self.inactive_reason = self._inactive_reason(current[ENABLED])

    @property
    def normal(self) -> str:
        """The normal value of ``enabled``."""
        return self.normals[ENABLED]

    def _live_state(self) -> JournalState | None:
        """The journal of this boot; one from another boot is stale and not built on."""
        state = self.journal.load()
        if state is None or state.boot_id != current_boot_id(self.root):
            return None
        return state

    def _normal(self, path: str, current: str | None) -> str:
        """What the profile set (journaled), else what the file holds at start."""
        state = self._live_state()
        if state is not None:
            if NORMAL_KEYS[path] in state.runtime:
                return str(state.runtime[NORMAL_KEYS[path]])
            for change in state.changes:
                if change.path == path:
                    return change.desired
        return current or NEVER

    def _pulls(self, path: str, current: str | None) -> bool:
        """Whether this lever is switched at all here."""
        if current is None or self.normals[path] == NEVER:
            return False
        if path == DEFRAG:
            return self.normals[path] not in NO_STALL_DEFRAG
        return self.admin is None

    def _inactive_reason(self, enabled: str | None) -> str | None:
        if enabled is None:
            return f"{ENABLED} is absent: THP is not built into this kernel"
        admin = (f"transparent_hugepage={self.admin} is set on the kernel command line by the "
                 "administrator") if self.admin is not None else None
        if self.normal == NEVER:
            return f"{admin}; not switching THP" if admin else \
                "THP is normally never here; there is nothing to switch off"
        if not self.levers:
            return (f"{admin}, and " if admin else "") + \
                f"defrag is normally {self.normals[DEFRAG]}, which never stalls: nothing to switch"
        return None

    # -- sampling and deciding -----------------------------------------------------------

    def _sample(self) -> Sample:
        avg10 = read_psi_some_avg10(self.root)
        high = read_memory_high_events(self.root, self.cgroup_dir) if self.cgroup_dir else None
        before = self._last_high
        if high is not None:
            self._last_high = high  # a counter that fell (cgroup recreated) is a new baseline
        rise = (before, high) if before is not None and high is not None and high > before \
            else None
        return Sample(avg10, rise, avg10 is not None or high is not None)

    def _pressure_reason(self, sample: Sample) -> str | None:
        """Why pressure is high now, or None."""
        limits = self.thresholds
        if sample.avg10 is not None and sample.avg10 > limits.disable_above:
            return f"psi some avg10 {sample.avg10:g} > {limits.disable_above:g}"
        if sample.high_rise is not None:
            before, after = sample.high_rise
            return f"{self.cgroup_dir}/memory.events high rose {before} -> {after}"
        return None

    def _restore_reason(self, sample: Sample, now: float, since: float) -> str | None:
        """Why a lever may return to normal now (pressure low and held long enough), or
        None."""
        limits = self.thresholds
        if sample.high_rise is not None or now - since < limits.hold_s:
            return None
        if sample.avg10 is None:
            calm = "memory.events high did not rise"
        elif sample.avg10 < limits.restore_below:
            calm = f"psi some avg10 {sample.avg10:g} < {limits.restore_below:g}"
        else:
            return None
        return f"{calm}, {now - since:.0f} s since the last switch (hold {limits.hold_s:g} s)"

    def step(self, now: float) -> dict[str, Any] | None:
        """Sample once and switch one lever if due; ``now`` is monotonic seconds.  Returns
        the event."""
        if self.inactive_reason is not None:
            return None
        if self._last_switch is None:
            # A fresh or restarted controller holds from its first sample, so it does not
            # undo at once a switch made before it started.
            self._last_switch = now
        since = self._last_switch
        sample = self._sample()
        values = {path: read_normalised(self.root, path, "selection") for path in self.levers}
        if not sample.signals or None in values.values():
            return None
        pulled = [path for path in self.levers if values[path] == NEVER]
        reason = self._pressure_reason(sample)
        if reason is not None:
            waiting = [path for path in self.levers if path not in pulled]
            if not waiting or (pulled and now - since < self.thresholds.hold_s):
                return None  # the next lever only once the last one has had its hold time
            if pulled:
                reason += f", {now - since:.0f} s after defrag went to {NEVER}"
            lever = waiting[0]
            return self._switch(now, lever, str(values[lever]), NEVER, reason)
        restore = self._restore_reason(sample, now, since) if pulled else None
        if restore is None:
            return None
        lever = pulled[-1]
        return self._switch(now, lever, NEVER, self.normals[lever], restore)

    def _switch(self, now: float, path: str, current: str, target: str,
                reason: str) -> dict[str, Any]:
        with self.journal.updating:
            self._journal(path, current, target)
            self.root.write_text(path, target)
        self._last_switch = now
        event = {"type": "thp_switched", "file": path.rsplit("/", 1)[1], "from": current,
                 "to": target, "reason": reason, "mono_ms": int(now * 1000)}
        self.on_event(event)
        return event

    def _journal(self, path: str, current: str, target: str) -> None:
        """Make the original durable before the write; keep an applied profile's original.

        The entry's ``desired`` follows the switch so ``profile verify`` sees no drift.
        """
        state = self._live_state() or JournalState(
            profile=JOURNAL_PROFILE, boot_id=current_boot_id(self.root),
            root=str(self.root.base), changes=[], status="applied")
        entry = next((c for c in state.changes if c.path == path), None)
        if entry is None:
            entry = Change(tuner="thp", path=path, current=current, desired=target,
                           key="thp.dynamic", compare="selection",
                           note="journaled by the dynamic THP controller")
            state.changes.append(entry)
        entry.desired = target
        state.runtime[NORMAL_KEYS[path]] = self.normals[path]
        self.journal.save(state)

    def run(self, stop: threading.Event, interval_s: float = 5.0) -> None:
        """The service loop.  A failed read or write stops it with a ``thp_dynamic_stopped``
        event: a refused write would otherwise be retried and re-journaled every interval."""
        if self.inactive_reason is not None:
            return
        while not stop.is_set():
            try:
                self.step(time.monotonic())
            except (OSError, ValueError) as error:
                self.on_event({"type": "thp_dynamic_stopped", "reason": str(error),
                               "mono_ms": int(time.monotonic() * 1000)})
                return
            stop.wait(interval_s)
