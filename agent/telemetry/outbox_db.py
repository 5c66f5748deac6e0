"""The outbox's SQLite table: its format, how it is opened, and each statement run on it.

Kept apart from the queueing in ``outbox.py`` so the one place that knows the table's columns
and SQLite's limits (parameters a statement, the size SQLite counts) is this file; the
functions take the connection and leave transactions and locking to the caller.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

_BATCH = 500  # ids per DELETE: old SQLite allows 999 parameters a statement
_ROWS_PER_INSERT = 200  # 4 parameters each
_SIZE = "LENGTH(payload) + LENGTH(topic)"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS outbox (
    id INTEGER PRIMARY KEY,
    topic TEXT NOT NULL,
    payload BLOB NOT NULL,
    created_ms INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""


@dataclass(frozen=True)
class Record:
    id: int
    topic: str
    payload: bytes
    created_ms: int

    @property
    def size(self) -> int:
        """What the record counts against ``max_bytes`` (SQLite's LENGTH of both columns)."""
        return len(self.payload) + len(self.topic)


def connect(path: Path) -> sqlite3.Connection:
    """The outbox database, created if new; sqlite3.OperationalError when another process
    holds it.

    One agent owns its outbox: the exclusive lock refuses a second one on the same state
    directory, and spares every transaction the shared-memory locking.  WAL with
    ``synchronous=NORMAL`` keeps commits cheap.
    """
    db = sqlite3.connect(str(path), isolation_level=None, timeout=1.0, check_same_thread=False)
    try:
        db.execute("PRAGMA locking_mode=EXCLUSIVE")
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.executescript(_SCHEMA)
    except sqlite3.OperationalError:
        db.close()
        raise
    return db


def next_id(db: sqlite3.Connection) -> int:
    return int(db.execute("SELECT COALESCE(MAX(id), 0) + 1 FROM outbox").fetchone()[0])


def totals(db: sqlite3.Connection) -> tuple[int, int]:
    """Records stored and the bytes they count."""
    depth, size = db.execute(f"SELECT COUNT(*), COALESCE(SUM({_SIZE}), 0) FROM outbox"
                             ).fetchone()
    return int(depth), int(size)


def insert(db: sqlite3.Connection, records: Sequence[Record]) -> None:
    """Many rows per statement: each statement's step lets go of the interpreter lock, and a
    row-by-row executemany would hand it to the link thread per row."""
    for start in range(0, len(records), _ROWS_PER_INSERT):
        rows = records[start:start + _ROWS_PER_INSERT]
        db.execute("INSERT INTO outbox (id, topic, payload, created_ms) VALUES "
                   + ",".join(["(?, ?, ?, ?)"] * len(rows)),
                   [value for r in rows for value in (r.id, r.topic, r.payload, r.created_ms)])


def delete(db: sqlite3.Connection, ids: Sequence[int]) -> int:
    """Delete these records; how many were there."""
    deleted = 0
    for start in range(0, len(ids), _BATCH):
        chunk = list(ids[start:start + _BATCH])
        deleted += db.execute(f"DELETE FROM outbox WHERE id IN ({','.join('?' * len(chunk))})",
                              chunk).rowcount
    return deleted


def delete_through(db: sqlite3.Connection, last_id: int) -> None:
    db.execute("DELETE FROM outbox WHERE id <= ?", (last_id,))


def select(db: sqlite3.Connection, after_id: int, below_id: int, limit: int) -> list[Record]:
    """Up to ``limit`` records with ``after_id < id < below_id``, oldest first."""
    rows = db.execute("SELECT id, topic, payload, created_ms FROM outbox WHERE id > ? AND id < ? "
                      "ORDER BY id LIMIT ?", (after_id, below_id, limit)).fetchall()
    return [Record(*row) for row in rows]


def oldest_covering(db: sqlite3.Connection, excess: int) -> tuple[int, int, int]:
    """``(last id, count, bytes)`` of the fewest oldest records that free ``excess`` bytes."""
    last = count = freed = 0
    for record_id, size in db.execute(f"SELECT id, {_SIZE} FROM outbox ORDER BY id"):
        if freed >= excess:
            break
        freed, last, count = freed + int(size), int(record_id), count + 1
    return last, count, freed


def created_before(db: sqlite3.Connection, cutoff_ms: int) -> tuple[int, int, int]:
    """``(last id, count, bytes)`` of the records created before ``cutoff_ms``."""
    last, count, freed = db.execute(
        f"SELECT COALESCE(MAX(id), 0), COUNT(*), COALESCE(SUM({_SIZE}), 0) FROM outbox "
        "WHERE created_ms < ?", (cutoff_ms,)).fetchone()
    return int(last), int(count), int(freed)


def add_to_counter(db: sqlite3.Connection, name: str, amount: int) -> None:
    db.execute("INSERT INTO counters (name, value) VALUES (?, ?) ON CONFLICT(name) "
               "DO UPDATE SET value = value + excluded.value", (name, amount))


def counter(db: sqlite3.Connection, name: str) -> int:
    row = db.execute("SELECT value FROM counters WHERE name = ?", (name,)).fetchone()
    return int(row[0]) if row else 0
