"""The on-disk outbox: every record waits here until the broker has acknowledged it.

SQLite in WAL mode, opened exclusively by one agent, survives a killed process and broker
outages of any length.  The queue is bounded by size and age (oldest dropped first, counted
in ``dropped``).  The same database keeps the persisted counters the link needs (the MQTT
session number), so delivery state lives in one file.  WAL with ``synchronous=NORMAL``
makes a put cost microseconds; a power cut may lose the last records not yet checkpointed,
never corrupt the queue.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

AGE_CHECK_INTERVAL_S = 10.0
_BATCH = 500
_SCHEMA = """
CREATE TABLE IF NOT EXISTS outbox (
    id INTEGER PRIMARY KEY,
    topic TEXT NOT NULL,
    payload BLOB NOT NULL,
    created_ms INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""


class OutboxBusy(RuntimeError):
    """The outbox belongs to another running agent."""


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


class Outbox:
    """A bounded FIFO of (topic, payload) records on disk, safe to share between threads."""

    def __init__(self, path: str | Path, max_bytes: int, max_age_s: float,
                 clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.max_bytes, self.max_age_s, self._clock = max_bytes, max_age_s, clock
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(self.path), isolation_level=None, timeout=1.0,
                                   check_same_thread=False)
        try:
            # One agent owns its outbox: the exclusive lock refuses a second one on the same
            # state directory, and spares every transaction the shared-memory locking.
            self._db.execute("PRAGMA locking_mode=EXCLUSIVE")
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
        except sqlite3.OperationalError as error:
            self._db.close()
            raise OutboxBusy(f"{self.path}: {error} (is another edge-agent using this "
                             "state directory?)") from error
        self._recount()
        self._dropped = self.counter("dropped")  # kept in memory: status reads it each second
        # Ids come from here, not SQLite: they must never repeat within a run (the link's
        # cursors rely on it), and AUTOINCREMENT would cost a second table write per put.
        self._next_id = int(self._db.execute(
            "SELECT COALESCE(MAX(id), 0) + 1 FROM outbox").fetchone()[0])
        self._last_age_check = 0.0

    # -- queue ------------------------------------------------------------------------------

    def put(self, topic: str, payload: bytes) -> int:
        """Store one record (committed before this returns); returns its id."""
        now = self._clock()
        with self._lock:
            record_id = self._next_id
            self._db.execute(
                "INSERT INTO outbox (id, topic, payload, created_ms) VALUES (?, ?, ?, ?)",
                (record_id, topic, payload, int(now * 1000)))
            self._next_id += 1
            self._depth += 1
            self._bytes += len(payload) + len(topic)  # topics are ASCII
            if self._bytes > self.max_bytes:
                self._drop_oldest_until_within_size()
            if now - self._last_age_check >= AGE_CHECK_INTERVAL_S:
                self._drop_expired(now)
            return record_id

    def pending(self, after_id: int, limit: int, below_id: int | None = None) -> list[Record]:
        """Up to ``limit`` records with ``after_id < id`` (``< below_id``), oldest first."""
        upper = below_id if below_id is not None else 2**63 - 1
        with self._lock:
            rows = self._db.execute(
                "SELECT id, topic, payload, created_ms FROM outbox WHERE id > ? AND id < ? "
                "ORDER BY id LIMIT ?", (after_id, upper, limit)).fetchall()
        return [Record(int(i), str(t), bytes(p), int(c)) for i, t, p, c in rows]

    def delete(self, records: Iterable[Record]) -> None:
        """Forget acknowledged records.  Sizes come from the records themselves; ones the
        bounds dropped meanwhile are not there to delete, and the totals are re-read."""
        wanted = list(records)
        with self._lock:
            deleted = 0
            self._db.execute("BEGIN")
            for start in range(0, len(wanted), _BATCH):  # old SQLite allows 999 parameters
                chunk = [r.id for r in wanted[start:start + _BATCH]]
                deleted += self._db.execute(
                    f"DELETE FROM outbox WHERE id IN ({','.join('?' * len(chunk))})",
                    chunk).rowcount
            self._db.execute("COMMIT")
            if deleted == len(wanted):
                self._depth -= deleted
                self._bytes -= sum(r.size for r in wanted)
            else:
                self._recount()

    def _recount(self) -> None:
        depth, size = self._db.execute(
            "SELECT COUNT(*), COALESCE(SUM(LENGTH(payload) + LENGTH(topic)), 0) "
            "FROM outbox").fetchone()
        self._depth, self._bytes = int(depth), int(size)

    def last_id(self) -> int:
        """The newest id handed out: records up to it are the backlog of a connect."""
        return self._next_id - 1

    @property
    def depth(self) -> int:
        return self._depth

    @property
    def size_bytes(self) -> int:
        return self._bytes

    @property
    def dropped(self) -> int:
        return self._dropped

    def stats(self) -> dict[str, int]:
        """The outbox metric group of telemetry."""
        return {"depth": self._depth, "bytes": self._bytes, "dropped": self.dropped}

    # -- bounds -----------------------------------------------------------------------------

    def _drop_oldest_until_within_size(self) -> None:
        excess, last, count = self._bytes - self.max_bytes, 0, 0
        freed = 0
        for record_id, size in self._db.execute(
                "SELECT id, LENGTH(payload) + LENGTH(topic) FROM outbox ORDER BY id"):
            if freed >= excess:
                break
            freed, last, count = freed + int(size), int(record_id), count + 1
        self._forget_through(last, count, freed)

    def _drop_expired(self, now: float) -> None:
        self._last_age_check = now
        cutoff = int((now - self.max_age_s) * 1000)
        last, count, freed = self._db.execute(
            "SELECT COALESCE(MAX(id), 0), COUNT(*), "
            "COALESCE(SUM(LENGTH(payload) + LENGTH(topic)), 0) FROM outbox "
            "WHERE created_ms < ?", (cutoff,)).fetchone()
        self._forget_through(int(last), int(count), int(freed))

    def _forget_through(self, last_id: int, count: int, freed: int) -> None:
        """Drop every record up to ``last_id`` (they are the oldest) and count them."""
        if count == 0:
            return
        self._db.execute("BEGIN")
        self._db.execute("DELETE FROM outbox WHERE id <= ?", (last_id,))
        self._add(self._db, "dropped", count)
        self._dropped += count
        self._db.execute("COMMIT")
        self._depth -= count
        self._bytes -= freed

    # -- persisted counters -----------------------------------------------------------------

    @staticmethod
    def _add(db: sqlite3.Connection, name: str, amount: int) -> None:
        db.execute("INSERT INTO counters (name, value) VALUES (?, ?) ON CONFLICT(name) "
                   "DO UPDATE SET value = value + excluded.value", (name, amount))

    def counter(self, name: str) -> int:
        with self._lock:
            row = self._db.execute("SELECT value FROM counters WHERE name = ?",
                                   (name,)).fetchone()
        return int(row[0]) if row else 0

    def bump(self, name: str) -> int:
        """Add one to a persisted counter and return the new value (committed)."""
        with self._lock:
            self._add(self._db, name, 1)
            row = self._db.execute("SELECT value FROM counters WHERE name = ?",
                                   (name,)).fetchone()
        return int(row[0])

    def close(self) -> None:
        with self._lock:
            self._db.close()
