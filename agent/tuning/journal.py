"""The crash-safe tuning journal: every original value is on disk before the first write.

One JSON document, replaced atomically (temp file, fsync, rename, fsync of the directory).
An apply writes the journal with all originals once, then writes the kernel files; so a
kill at any moment leaves either no journal and an untouched device, or a journal from which
rollback restores every original.  The journal carries the boot id: sysfs is fresh after a
reboot, so a journal from another boot is never replayed.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from agent.fsroot import Root
from agent.tuning.plan import Change

SCHEMA = "tuning-journal/1"
FILE_NAME = "tuning-journal.json"
BOOT_ID = "/proc/sys/kernel/random/boot_id"


def current_boot_id(root: Root) -> str:
    """The kernel's boot id; a fixture without one gets a fixed stand-in."""
    try:
        return root.read_text(BOOT_ID).strip()
    except OSError:
        return "no-boot-id"


@dataclass
class JournalState:
    profile: str
    boot_id: str
    root: str
    changes: list[Change]
    status: str = "applying"  # applying | applied
    created_ms: int = field(default_factory=lambda: int(time.time() * 1000))
    runtime: dict[str, Any] = field(default_factory=dict)


class Journal:
    """Reads and atomically replaces the journal file in the state directory."""

    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.dir = Path(state_dir)
        self.path = self.dir / FILE_NAME

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

    def save(self, state: JournalState) -> None:
        """Replace the journal atomically and durably."""
        self.dir.mkdir(parents=True, exist_ok=True)
        body = {"schema": SCHEMA, **asdict(state)}
        body["changes"] = [asdict(change) for change in state.changes]
        temporary = self.path.with_suffix(".tmp")
        with open(temporary, "w") as handle:
            json.dump(body, handle, indent=1)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, self.path)
        self._sync_dir()

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)
        self._sync_dir()

    def _sync_dir(self) -> None:
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
