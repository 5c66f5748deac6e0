"""Planning: a pure diff ``{tuner, path, current, desired}`` of what a profile would change.

Each tuner module turns one profile section into changes from the topology and the current
values read through the root.  Nothing is written here.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

from agent.discovery.model import Topology
from agent.kernel import irqs, parsers
from agent.kernel import sched as rt
from agent.kernel.fsroot import Root, WriteRefused
from agent.tuning.errors import ProfileError
from agent.tuning.kinds import KINDS
from agent.tuning.profiles import Profile

# and every key of agent.tuning.kinds.KINDS (boot-config arguments, config files)
COMPARISONS = ("value", "selection", "cpulist", "cpumask", "controllers", "sched", "unit")


@dataclass
class Change:
    tuner: str
    path: str
    current: str | None  # normalised current value (None: file absent)
    desired: str
    key: str = ""  # profile key that asked for it, for messages
    compare: str = "value"  # how verify reads the file back: one of COMPARISONS
    write: str | None = None  # what to write when it differs from ``desired``
    restore: str | None = None  # what rollback writes when it differs from ``current``
    note: str | None = None
    persistent: bool = False  # survives a reboot: kept in the persistent journal
    # paths this write resets as a side effect (a scheduler switch resets nr_requests):
    # rollback restores them after this change, whatever their place in the journal
    resets: list[str] = field(default_factory=list)

    @property
    def write_value(self) -> str:
        return self.desired if self.write is None else self.write

    @property
    def restore_value(self) -> str:
        return (self.current or "") if self.restore is None else self.restore


@dataclass
class Plan:
    profile: str
    changes: list[Change] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    runtime: dict[str, Any] = field(default_factory=dict)  # for the service: RT loop, THP
    cpus: dict[str, list[int]] = field(default_factory=dict)  # resolved sets, by role
    # keys the profile can do without (optional or inherited): a refused write skips them
    optional: frozenset[str] = frozenset()

    def to_dict(self) -> dict[str, Any]:
        return {"profile": self.profile, "changes": [
            {k: v for k, v in asdict(c).items() if k in ("tuner", "path", "current", "desired",
                                                         "key", "note", "persistent")}
            for c in self.changes], "warnings": self.warnings, "runtime": self.runtime,
            "cpus": {role: parsers.format_cpulist(cpus) for role, cpus in self.cpus.items()}}


def read_normalised(root: Root, path: str, compare: str) -> str | None:
    """The value of a kernel file in the form verify compares; None when it is absent.

    ``sched`` changes name a thread (/proc/PID/task/TID): its scheduling is the value; the
    compares of ``KINDS`` read through their kind."""
    if compare in KINDS:
        return KINDS[compare].read(root, path)
    if compare == "sched":
        try:
            return rt.format_sched(rt.read_thread_sched(rt.tid_of(path)))
        except ProcessLookupError:
            return None
    try:
        text = root.read_text(path).strip()
    except FileNotFoundError:
        return None
    if compare == "selection":
        return parsers.parse_selection(text)[0] if "[" in text else text
    if compare == "cpulist":
        return parsers.format_cpulist(parsers.parse_cpulist(text))
    if compare == "cpumask":  # a hex mask file, compared as the CPU list it holds
        return parsers.format_cpulist(irqs.parse_mask(text))
    return " ".join(text.split())


def matches(change: Change, actual: str | None) -> bool:
    if actual is None:
        return False
    if change.compare == "controllers":
        return set(change.desired.split()) <= set(actual.split())
    return actual == change.desired


class PlanContext:
    """What a tuner needs: the root, the topology, the profile (for error messages)."""

    def __init__(self, root: Root, topology: Topology, profile: Profile,
                 baseline: dict[str, str | None] | None = None) -> None:
        self.root = root
        self.topology = topology
        self.profile = profile
        # When switching profiles, the originals in the journal stand in for what the files
        # hold now, so the new plan is a diff against the device as it was before tuning.
        self.baseline = baseline or {}
        self.changes: list[Change] = []
        self.warnings: list[str] = []
        self.runtime: dict[str, Any] = {}
        self.cpus: dict[str, list[int]] = {}

    def error(self, key: str, message: str) -> ProfileError:
        return ProfileError(self.profile.file, key, message)

    def lacking(self, key: str, what: str, allowed: str) -> None:
        """A knob this kernel does not have: an error when the profile asks for it itself,
        else (only inherited, or listed under ``optional``) skipped with a warning, so one
        profile serves kernels built with and without the feature."""
        if self.profile.requires(key):
            raise self.error(key, f"{what}; allowed: {allowed}, or list {key.split('.')[0]} "
                             "under optional to skip it where the kernel lacks it")
        self.warnings.append(f"{key}: skipped: {what}")

    def current(self, path: str, key: str, compare: str = "value") -> str:
        value = self._current(path, key, compare)
        if value is None:
            raise self.error(key, f"{path} does not exist on this device")
        return value

    def _current(self, path: str, key: str, compare: str) -> str | None:
        """The original (when switching) or what the file holds; None: no such file."""
        original = self.baseline.get(path)
        if original is not None:
            return original
        try:
            return read_normalised(self.root, path, compare)
        except (OSError, ValueError) as error:
            raise self.error(key, f"cannot read {path}: {error}") from None

    def check_writable(self, path: str, key: str, compare: str = "value") -> None:
        """A kernel file outside the allowlist is the profile's error, at plan time (not an
        apply that fails with the first write); kinds and threads have their own checks."""
        if compare in ("sched", "unit") or (
                compare in KINDS and not getattr(KINDS[compare], "kernel_file", False)):
            return
        try:
            self.root.check_writable(path)
        except WriteRefused as error:
            raise self.error(key, str(error)) from None

    @contextmanager
    def writes_checked(self, section: str) -> Iterator[None]:
        """A tuner's own allowlist check (cgroup, block) refused at plan time is the
        profile's error too, under its section."""
        try:
            yield
        except WriteRefused as error:
            raise self.error(section, str(error)) from None

    def want(self, tuner: str, path: str, desired: str, key: str, compare: str = "value",
             lacking: tuple[str, str] | None = None, **extra: Any) -> None:
        """Record a change unless the file already holds the desired value.

        A file the kernel does not have goes to ``lacking`` (why it is absent, what is
        allowed): an error or a warning, as the profile asked for it."""
        self.check_writable(path, key, compare)
        current = self._current(path, key, compare)
        if current is None:
            why, allowed = lacking or ("", "keys whose files this device has")
            self.lacking(key, f"{path} does not exist on this device{why}", allowed)
            return
        if compare == "cpulist":
            desired = parsers.format_cpulist(parsers.parse_cpulist(desired))
        change = Change(tuner=tuner, path=path, current=current, desired=desired, key=key,
                        compare=compare, **extra)
        if not matches(change, current):
            self.changes.append(change)
