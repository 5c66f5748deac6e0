"""Seen command ids and their results, on disk: a repeated id never runs twice.

Only envelopes with a valid signature are recorded, so a forged message cannot reserve the id
of a real command.  Entries are kept a day past their expiry (the controller prunes on start
and hourly); by then a replay is refused as expired anyway.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path
from typing import Any

RETENTION_MS = 24 * 3600 * 1000
_SCHEMA = """
CREATE TABLE IF NOT EXISTS commands (
    id TEXT PRIMARY KEY,
    command TEXT NOT NULL,
    expires_ms INTEGER NOT NULL,
    reply TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS state (name TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


class CommandStore:
    def __init__(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA locking_mode=EXCLUSIVE")  # one agent; cheaper commits
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)

    def get(self, command_id: str) -> dict[str, Any] | None:
        """The last reply recorded for ``command_id``."""
        with self._lock:
            row = self._db.execute("SELECT reply FROM commands WHERE id = ?",
                                   (command_id,)).fetchone()
        return json.loads(row[0]) if row else None

    def record(self, command_id: str, command: str, expires_ms: int,
               reply: dict[str, Any]) -> None:
        """Remember the newest reply (accepted, then the outcome) for ``command_id``."""
        with self._lock:
            self._db.execute(
                "INSERT INTO commands (id, command, expires_ms, reply) VALUES (?, ?, ?, ?) "
                "ON CONFLICT(id) DO UPDATE SET reply = excluded.reply",
                (command_id, command, expires_ms, json.dumps(reply)))

    def prune(self, now_ms: int) -> int:
        """Forget ids that expired more than RETENTION_MS before ``now_ms``; how many."""
        with self._lock:
            return self._db.execute("DELETE FROM commands WHERE expires_ms < ?",
                                    (now_ms - RETENTION_MS,)).rowcount

    def get_state(self, name: str) -> Any:
        """Small persisted facts (the desired state last converged to)."""
        with self._lock:
            row = self._db.execute("SELECT value FROM state WHERE name = ?",
                                   (name,)).fetchone()
        return json.loads(row[0]) if row else None

    def set_state(self, name: str, value: Any) -> None:
        with self._lock:
            self._db.execute("INSERT INTO state (name, value) VALUES (?, ?) ON CONFLICT(name) "
                             "DO UPDATE SET value = excluded.value", (name, json.dumps(value)))

    def close(self) -> None:
        with self._lock:
            self._db.close()
