"""Changes layered on the applied profile through its journal: a controller's settings that
move while the service runs (the QoS controller's frequency floors), journaled like the
profile's own.

The journal keeps one entry per path with the true original (``current``/``restore``), so
``Engine.rollback``, ``edge-agent profile rollback`` and the rollback after a crash restore
the device as it was before any tuning, whatever the layer left.  A layered value only moves
the entry's ``desired`` (``profile verify`` sees no drift); the value underneath it (the
profile's own, or none when the profile leaves the path alone) is kept in the journal's
runtime under ``LAYER_KEY``, so the layer can be taken off exactly, by this process or a
restarted one.  Each move is durable in the journal before the first write, every write is
read back, and a write the kernel refuses (or one that does not read back) puts back what
this move wrote, so no half-applied layer remains.
"""

from __future__ import annotations

import copy
import errno
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from agent.kernel.fsroot import Root
from agent.tuning.journal import Journal, JournalState, current_boot_id
from agent.tuning.plan import Change, read_normalised

LAYER_KEY = "layered"  # journal runtime: path -> the value under the layer (None: added)
# Profile name of a journal the layer starts itself, when no profile is applied.
JOURNAL_PROFILE = "latency-knobs"


Restore = Callable[[str], str | None]


class LayerError(OSError):
    """A layered write the kernel refused or did not keep; the layer is as it was before.
    ``errno`` is the kernel's; the message names the file."""

    def __str__(self) -> str:
        return str(self.strerror)


@dataclass(frozen=True)
class Layered:
    """One path a layer may set: how verify compares it, and the journal entry's fields for a
    path the profile leaves alone."""

    path: str
    key: str  # what asked for it, for messages: ``qos.cpu_floor_khz``
    tuner: str = "cpufreq"
    compare: str = "value"
    # what rollback writes for a path the layer adds, from the value the path holds then;
    # None: that value itself (dvfs's "0" for a floor at the hardware minimum goes here)
    restore: Restore | None = None


def live(root: Root, journal: Journal) -> JournalState | None:
    """The journal of this boot; one from another boot is stale and not built on."""
    state = journal.load()
    return state if state is not None and state.boot_id == current_boot_id(root) else None


def under(state: JournalState | None) -> dict[str, str | None]:
    """Path -> the value under the layer, for each path the layer holds now."""
    return dict(state.runtime.get(LAYER_KEY, {})) if state else {}


def set_layer(root: Root, journal: Journal, targets: Mapping[Layered, str | None]) -> None:
    """Move each path to its target (None: back to what is under the layer).

    Raises LayerError naming the file and the kernel's errno when a write is refused or does
    not read back; then every path holds what it held before this call, and so does the
    journal."""
    with journal.updating:
        _set_layer(root, journal, targets)


def _set_layer(root: Root, journal: Journal, targets: Mapping[Layered, str | None]) -> None:
    state = live(root, journal)
    before = copy.deepcopy(state)  # what a refused step puts back
    state = state or JournalState(profile=JOURNAL_PROFILE, boot_id=current_boot_id(root),
                                  root=str(root.base), changes=[], status="applied")
    layered = under(state)
    writes: list[tuple[Layered, str, str]] = []  # what, old value, new value
    for what, target in targets.items():
        entry = next((c for c in state.changes if c.path == what.path), None)
        added = what.path not in layered
        if added and target is None:
            continue  # not layered: nothing to take off
        if entry is None:
            entry = _new_entry(root, what)
            state.changes.append(entry)
            layered[what.path] = None
        elif added:
            layered[what.path] = entry.desired  # the profile's own value
        # what the file holds now, in the form that puts it back exactly
        old = entry.restore_value if added and layered[what.path] is None else entry.desired
        value = target if target is not None else _under_value(entry, layered[what.path])
        if not added and value == old and target is not None:
            continue  # held already: no write, no journal update
        writes.append((what, old, value))
        entry.desired = value
    if not writes:
        return
    state.runtime = {**state.runtime, LAYER_KEY: layered}
    journal.save(state)  # every original is durable before the first write
    done: list[tuple[Layered, str, str]] = []
    for what, old, value in writes:
        try:
            _write_verified(root, what, value)
        except OSError as error:
            _undo(root, [*done, (what, old, value)])
            _put_back(journal, before)
            raise LayerError(error.errno, f"{what.path}: writing {value} "
                             f"({what.key}): {kernel_error(error)}; the earlier "
                             "writes of this step were put back") from None
        done.append((what, old, value))
    _settle(journal, state, [w for w, _, t in writes if targets[w] is None])


def _new_entry(root: Root, what: Layered) -> Change:
    """A journal entry for a path the profile leaves alone, with its true original."""
    current = read_normalised(root, what.path, what.compare)
    if current is None:
        raise LayerError(errno.ENOENT, f"{what.path}: does not exist on this device")
    return Change(tuner=what.tuner, path=what.path, current=current, desired=current,
                  key=what.key, compare=what.compare,
                  restore=what.restore(current) if what.restore else None,
                  note=f"layered on the profile ({what.key})")


def _under_value(entry: Change, below: str | None) -> str:
    """What taking the layer off writes: the profile's value, else the original (rollback's
    value, so a floor at the hardware minimum becomes "no floor" again)."""
    return below if below is not None else entry.restore_value


def _write_verified(root: Root, what: Layered, value: str) -> None:
    root.write_text(what.path, value)
    actual = read_normalised(root, what.path, what.compare)
    expected = read_back(what, value)
    if expected is not None and actual != expected:
        raise OSError(errno.EIO, f"reads back {actual!r}")


def read_back(what: Layered, value: str) -> str | None:
    """What the file shows after ``value`` was written, when that is known: a floor of 0 is
    the request's default and shows the hardware minimum, not 0 (freq_qos)."""
    return None if value == "0" and what.path.endswith("min_freq") else value


def _undo(root: Root, writes: list[tuple[Layered, str, str]]) -> None:
    """Put back the old values, last first; a failure here is left for rollback (the
    journal still holds every original)."""
    for what, old, _new in reversed(writes):
        try:
            root.write_text(what.path, old)
        except OSError:
            continue


def _put_back(journal: Journal, before: JournalState | None) -> None:
    if before is None:
        journal.clear()
    else:
        journal.save(before)


def _settle(journal: Journal, state: JournalState, taken_off: list[Layered]) -> None:
    """Paths back under the layer leave it: an entry the layer added goes, a profile's entry
    gets its own desired value back; a journal left holding nothing goes too."""
    layered = under(state)
    for what in taken_off:
        below = layered.pop(what.path, None)
        entry = next(c for c in state.changes if c.path == what.path)
        if below is None:
            state.changes.remove(entry)
    state.runtime = {**state.runtime, LAYER_KEY: layered}
    if not layered:
        del state.runtime[LAYER_KEY]
    if not state.changes and state.profile == JOURNAL_PROFILE:
        journal.clear()
    elif taken_off:
        journal.save(state)


def kernel_error(error: OSError) -> str:
    """``EINVAL (Invalid argument)``: the errno's name, which the kernel's docs use."""
    name = errno.errorcode.get(error.errno or 0, "an error")
    return f"{name} ({error.strerror or error})"
