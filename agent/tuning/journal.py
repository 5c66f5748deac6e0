"""The crash-safe tuning journal: every original value is on disk before the first write.

One JSON document, replaced atomically (temp file, fsync, rename).  An apply writes the
journal with all originals once, then writes the kernel files; so a kill at any moment
leaves either no journal and an untouched device, or a journal from which rollback restores
every original.  The journal carries the boot id: sysfs is fresh after a reboot, so a
journal from another boot is never replayed.  That is also why the directory is not fsync'd:
only a power loss or kernel crash could lose the rename, and either one resets sysfs too.

The persistent journal (``PERSISTENT_FILE``) holds the originals of settings that survive a
reboot (boot config, files below /etc): it is never discarded for its boot id, and its
directory is fsync'd, since a lost rename would lose an original the disk still differs from.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.kernel.fsroot import Root
from agent.overlays.bootfs import fsync_dir
from agent.tuning.plan import Change

SCHEMA = "tuning-journal/1"
FILE_NAME = "tuning-journal.json"
PERSISTENT_FILE = "tuning-persistent.json"
BOOT_ID = "/proc/sys/kernel/random/boot_id"


def current_boot_id(root: Root) -> str:
    """The kernel's boot id; a fixture without one gets a fixed stand-in."""
    try:
        return root.read_text(BOOT_ID).strip()
    except OSError:
        return "no-boot-id"


def gone_with_boot(state: JournalState | None, root: Root) -> str | None:
    """Why a runtime journal's settings are not in force, when it is from another boot: a
    reboot reset sysfs and procfs, so they went with it (not drift), and what puts them back.
    None for a journal of this boot (or none)."""
    if state is None or state.boot_id == current_boot_id(root):
        return None
    return (f"the runtime settings of {state.profile} were applied in an earlier boot (boot id "
            f"{state.boot_id[:8]}) and went with the reboot; that is not drift. The service "
            f"re-applies them when it starts (tuning.apply: true in its config; the enabled "
            f"edge-agent unit starts at boot), or run `sudo edge-agent profile apply "
            f"{state.profile}`")


@dataclass
class JournalState:
    profile: str
    boot_id: str
    root: str
    changes: list[Change]
    status: str = "applying"  # applying | applied
    created_ms: int = field(default_factory=lambda: int(time.time() * 1000))
    runtime: dict[str, Any] = field(default_factory=dict)


_UPDATES: dict[Path, threading.RLock] = {}  # journal file -> its writers' lock
_UPDATES_GUARD = threading.Lock()


class Journal:
    """Reads and atomically replaces the journal file in the state directory."""

    def __init__(self, state_dir: str | os.PathLike[str], name: str = FILE_NAME,
                 sync_dir: bool = False) -> None:
        self.dir = Path(state_dir)
        self.path = self.dir / name
        self.sync_dir = sync_dir  # the rename made durable too (the persistent journal)

    @property
    def updating(self) -> threading.RLock:
        """Held by a writer that loads, changes and saves the journal while others run (the
        dynamic THP controller, the latency knobs), so neither saves over the other's entry.
        One lock per file, whichever Journal object names it."""
        with _UPDATES_GUARD:
            return _UPDATES.setdefault(self.path.absolute(), threading.RLock())

    @classmethod
    def persistent(cls, state_dir: str | os.PathLike[str]) -> Journal:
        return cls(state_dir, PERSISTENT_FILE, sync_dir=True)

    def exists(self) -> bool:
        return self.path.exists()

    def load(self) -> JournalState | None:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as error:
            raise OSError(f"{self.path}: unreadable tuning journal ({error}); inspect it and "
                          "remove it by hand if the device was rebooted since") from None
        if data.get("schema") != SCHEMA:
            raise OSError(f"{self.path}: unknown journal schema {data.get('schema')!r}")
        changes = [Change(**entry) for entry in data["changes"]]
        return JournalState(profile=data["profile"], boot_id=data["boot_id"], root=data["root"],
                            changes=changes, status=data["status"],
                            created_ms=data["created_ms"], runtime=data.get("runtime", {}))

    def save(self, state: JournalState, durable: bool = True) -> None:
        """Replace the journal atomically; ``durable`` fsyncs it (originals before writes)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        body = {"schema": SCHEMA, **{k: v for k, v in vars(state).items() if k != "changes"}}
        body["changes"] = [dict(vars(change)) for change in state.changes]  # flat: no asdict
        temporary = self.path.with_suffix(".tmp")
        with open(temporary, "w") as handle:
            handle.write(json.dumps(body))  # the C encoder: indent would be 10x slower
            handle.flush()
            if durable:
                os.fsync(handle.fileno())
        os.replace(temporary, self.path)
        if durable and self.sync_dir:
            fsync_dir(self.dir)

    def clear(self) -> None:
        if self.path.exists():
            self.path.unlink(missing_ok=True)
            if self.sync_dir:
                fsync_dir(self.dir)


def live_state(root: Root, journal: Journal, notes: list[str]) -> JournalState | None:
    """The live journal, or None; one from another boot is discarded, never replayed."""
    state = journal.load()
    if state is not None and state.boot_id != current_boot_id(root):
        notes.append(f"{journal.path}: journal of profile {state.profile!r} is from another "
                     "boot; sysfs was reset by the reboot, so it is discarded, not replayed")
        journal.clear()
        return None
    return state
