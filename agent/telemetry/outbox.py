"""The on-disk outbox: every record waits here until the broker has acknowledged it.

SQLite in WAL mode, opened exclusively by one agent, survives a killed process and broker
outages of any length.  The queue is bounded by size and age (oldest dropped first, counted
in ``dropped``).  The same database keeps the persisted counters the link needs (the MQTT
session number), so delivery state lives in one file.

One writer thread does the disk work in rounds: ``put`` and ``delete`` only hand records
over and wake it, and each round commits everything handed over since the last one in one
transaction.  A record becomes visible to ``pending`` (and so to the link) only once it is
committed, so nothing is sent before it is on disk.  Committing per put would spend a burst on
per-transaction work and on the link thread waiting for the disk while acknowledgements queue
up; in rounds the disk work runs beside the network work instead.  What a killed process can
lose is what was handed over in the last round (typically well under a millisecond, measured by
``bench/telemetry.py``), as it can lose a record still being sampled.  WAL with
``synchronous=NORMAL`` keeps commits cheap; a power cut may lose the last records not yet
checkpointed, never corrupt the queue.

The table and its statements are in ``outbox_db``, the window of recent records kept in
memory in ``outbox_window``; this module queues, runs the writer's rounds and keeps the
bounds.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from agent.telemetry import outbox_db
from agent.telemetry.outbox_db import Record
from agent.telemetry.outbox_window import RecentWindow

logger = logging.getLogger(__name__)

AGE_CHECK_INTERVAL_S = 10.0
WRITE_RETRY_S = 1.0


class OutboxBusy(RuntimeError):
    """The outbox belongs to another running agent."""


class Outbox:
    """A bounded FIFO of (topic, payload) records on disk, safe to share between threads.

    Two locks: ``_db_lock`` for the SQLite connection (held across disk work) and
    ``_mem_lock`` for what is in memory (held briefly, never across disk work), so the link
    reading new records never waits for a commit.  Order: ``_db_lock`` before ``_mem_lock``.
    """

    def __init__(self, path: str | Path, max_bytes: int, max_age_s: float,
                 clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.max_bytes, self.max_age_s, self._clock = max_bytes, max_age_s, clock
        self._db_lock = threading.Lock()
        self._mem_lock = threading.Lock()
        try:
            self._db = outbox_db.connect(self.path)
        except sqlite3.OperationalError as error:
            raise OutboxBusy(f"{self.path}: {error} (is another edge-agent using this "
                             "state directory?)") from error
        self._recount()
        self._dropped = self.counter("dropped")  # kept in memory: status reads it each second
        # Ids come from here, not SQLite: they must never repeat within a run (the link's
        # cursors rely on it), and AUTOINCREMENT would cost a second table write per put.
        self._next_id = outbox_db.next_id(self._db)
        self._committed_id = self._next_id - 1
        self._last_age_check = 0.0
        self._recent = RecentWindow()
        # Handed over, not yet on disk: records to store (in id order) and ones to forget.
        self._queue: list[Record] = []
        self._queued_bytes = 0
        self._forget: list[Record] = []
        self._unstored_drops = 0
        # taken from the queue by the round under way, not yet committed
        self._storing = self._storing_bytes = 0
        # acknowledged records the round under way is deleting (or ``_forget`` holds): no
        # longer waiting for the broker, so not part of the depth a person is shown
        self._forgetting = self._forgetting_bytes = 0
        self.write_errors = 0
        self.last_error: str | None = None
        self._listeners: list[Callable[[], None]] = []
        self._wake = threading.Event()
        self._closing = False
        self._writer = threading.Thread(target=self._write_loop, name="outbox-writer",
                                        daemon=True)
        self._writer.start()

    # -- queue ------------------------------------------------------------------------------

    def put(self, topic: str, payload: bytes) -> int:
        """Hand one record over (on disk after the writer's next round); returns its id."""
        with self._mem_lock:
            if self._closing:
                raise RuntimeError(f"{self.path}: the outbox is closed")
            record = Record(self._next_id, topic, payload, int(self._clock() * 1000))
            self._next_id += 1
            first = not self._queue
            self._queue.append(record)
            self._queued_bytes += record.size
            if self._queued_bytes > self.max_bytes and self.last_error is not None:
                self._drop_queued_over_bound()  # the disk refuses writes: keep the newest
        if first:  # a round takes the whole queue: one wake per round, not per record
            self._wake.set()
        return record.id

    def delete(self, records: Iterable[Record]) -> None:
        """Forget acknowledged records (deleted in the writer's next round).  A crash before
        then sends them again: a duplicate, never a loss."""
        wanted = list(records)
        if not wanted:
            return
        with self._mem_lock:
            first = not self._forget
            self._forget.extend(wanted)
            self._recent.evict_through(max(r.id for r in wanted))
        if first:
            self._wake.set()

    def pending(self, after_id: int, limit: int, below_id: int | None = None) -> list[Record]:
        """Up to ``limit`` committed records with ``after_id < id`` (``< below_id``), oldest
        first, none of them already handed to ``delete``."""
        upper = below_id if below_id is not None else 2**63 - 1
        with self._mem_lock:
            if after_id >= self._committed_id:
                return []
            found = self._recent.read(after_id, limit, upper)
            if len(found) == limit or (found and found[-1].id + 1 >= min(
                    upper, self._committed_id + 1)):
                return found
        if found:
            after_id, limit = found[-1].id, limit - len(found)
        return found + self._from_disk(after_id, limit, upper)

    def _from_disk(self, after_id: int, limit: int, upper: int) -> list[Record]:
        with self._db_lock:
            with self._mem_lock:  # acknowledged, not yet deleted: skipped, not counted
                forgotten = {r.id for r in self._forget if after_id < r.id < upper}
            stored = outbox_db.select(self._db, after_id, upper, limit + len(forgotten))
        return [r for r in stored if r.id not in forgotten][:limit]

    def listen(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (cheap, never raising) after each round that stored records."""
        self._listeners.append(callback)

    def unlisten(self, callback: Callable[[], None]) -> None:
        if callback in self._listeners:
            self._listeners.remove(callback)

    def flush(self) -> bool:
        """Do a writer round now; False when the disk refused part of it (the rest of the
        work stays queued, and the next round tries again)."""
        with self._db_lock:
            # Deletes first: acknowledged records must not count against the size bound
            # when the new ones are checked against it.
            forgot = self._forget_queued()
            stored = self._store_queued()
            try:
                self._enforce_bounds()
                bounded = True
            except sqlite3.Error as error:
                self._refused(error, "drop records beyond the size and age bounds")
                bounded = False
            done = forgot and stored is not None and bounded
            if done:
                self.last_error = None
        if stored:
            for callback in list(self._listeners):
                callback()
        return done

    def last_id(self) -> int:
        """The newest committed id: records up to it are the backlog of a connect."""
        return self._committed_id

    def _totals(self) -> tuple[int, int, int]:
        """Depth, bytes and records not yet on disk, read together: a round moves records
        from the queue to the table between two unlocked reads."""
        with self._mem_lock:
            unwritten = len(self._queue) + self._storing
            # acknowledged ones waiting for their delete do not wait for the broker any more
            acked = len(self._forget) + self._forgetting
            acked_bytes = sum(r.size for r in self._forget) + self._forgetting_bytes
            return (max(0, self._depth + unwritten - acked),
                    max(0, self._bytes + self._storing_bytes + self._queued_bytes
                        - acked_bytes), unwritten)

    @property
    def depth(self) -> int:
        return self._totals()[0]

    @property
    def size_bytes(self) -> int:
        return self._totals()[1]

    @property
    def dropped(self) -> int:
        return self._dropped

    def stats(self) -> dict[str, int]:
        """The outbox metric group of telemetry (``unwritten``: handed over, not yet on
        disk; it grows only while the disk refuses writes)."""
        depth, size, unwritten = self._totals()
        return {"depth": depth, "bytes": size, "dropped": self._dropped,
                "unwritten": unwritten, "write_errors": self.write_errors}

    # -- the writer -------------------------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()  # before taking the queues: a later hand-over wakes again
            if not self.flush() and not self._closing:
                time.sleep(WRITE_RETRY_S)  # the disk refused: keep the work, try again
                self._wake.set()
            if self._closing:
                return

    def _refused(self, error: sqlite3.Error, what: str) -> None:
        if self._db.in_transaction:
            self._db.rollback()
        self.write_errors += 1
        message = f"{self.path}: cannot {what}: {error}"
        if message != self.last_error:
            logger.error("outbox: %s; retrying (%d records wait in memory)", message,
                         len(self._queue))
        self.last_error = message

    def _store_queued(self) -> int | None:
        """Insert every queued record in one transaction (caller holds ``_db_lock``, so
        batches reach the table in id order); how many, or None when the disk refused."""
        with self._mem_lock:
            batch, queued_bytes, drops = self._queue, self._queued_bytes, self._unstored_drops
            self._queue, self._queued_bytes, self._unstored_drops = [], 0, 0
            self._storing, self._storing_bytes = len(batch), queued_bytes
        if not batch:
            return 0
        try:
            self._db.execute("BEGIN")
            outbox_db.insert(self._db, batch)
            if drops:
                outbox_db.add_to_counter(self._db, "dropped", drops)
            self._db.execute("COMMIT")
        except sqlite3.Error as error:
            with self._mem_lock:  # back in front, in order
                self._queue[:0] = batch
                self._queued_bytes += queued_bytes
                self._unstored_drops += drops
                self._storing = self._storing_bytes = 0
            self._refused(error, "store records")
            return None
        with self._mem_lock:
            self._depth += len(batch)
            self._bytes += queued_bytes
            for record in batch:
                self._recent.remember(record)
            self._committed_id = batch[-1].id
            self._storing = self._storing_bytes = 0
        return len(batch)

    def _forget_queued(self) -> bool:
        """Delete the acknowledged records handed over; False when the disk refused.  Ones
        the bounds dropped meanwhile are not there to delete, and the totals are re-read."""
        with self._mem_lock:
            wanted, self._forget = self._forget, []
            self._forgetting = len(wanted)
            self._forgetting_bytes = sum(r.size for r in wanted)
        if not wanted:
            return True
        try:
            self._db.execute("BEGIN")
            deleted = outbox_db.delete(self._db, [r.id for r in wanted])
            self._db.execute("COMMIT")
        except sqlite3.Error as error:
            with self._mem_lock:
                self._forget[:0] = wanted
                self._forgetting = self._forgetting_bytes = 0
            self._refused(error, "delete acknowledged records")
            return False
        with self._mem_lock:
            if deleted == len(wanted):
                self._depth -= deleted
                self._bytes -= sum(r.size for r in wanted)
            self._forgetting = self._forgetting_bytes = 0
        if deleted != len(wanted):
            self._recount()
        return True

    def _recount(self) -> None:
        """Caller holds ``_db_lock`` (or is the constructor)."""
        depth, size = outbox_db.totals(self._db)
        with self._mem_lock:
            self._depth, self._bytes = depth, size

    # -- bounds -----------------------------------------------------------------------------

    def _drop_queued_over_bound(self) -> None:
        """Caller holds ``_mem_lock``.  The queue outgrew the whole outbox's bound (the disk
        keeps refusing writes): the oldest go, counted like any other drop."""
        while self._queued_bytes > self.max_bytes and len(self._queue) > 1:
            self._queued_bytes -= self._queue.pop(0).size
            self._dropped += 1
            self._unstored_drops += 1  # persisted with the next batch that is stored

    def _enforce_bounds(self) -> None:
        """Drop the oldest records beyond the size bound, and (every so often) the expired
        ones; a refused delete leaves the check to the next round."""
        if self._bytes > self.max_bytes:
            self._drop_oldest_until_within_size()
        now = self._clock()
        if now - self._last_age_check >= AGE_CHECK_INTERVAL_S:
            self._drop_expired(now)
            self._last_age_check = now

    def _drop_oldest_until_within_size(self) -> None:
        self._forget_through(*outbox_db.oldest_covering(self._db, self._bytes - self.max_bytes))

    def _drop_expired(self, now: float) -> None:
        cutoff_ms = int((now - self.max_age_s) * 1000)
        self._forget_through(*outbox_db.created_before(self._db, cutoff_ms))

    def _forget_through(self, last_id: int, count: int, freed: int) -> None:
        """Drop every record up to ``last_id`` (they are the oldest) and count them."""
        if count == 0:
            return
        self._db.execute("BEGIN")
        outbox_db.delete_through(self._db, last_id)
        outbox_db.add_to_counter(self._db, "dropped", count)
        self._db.execute("COMMIT")
        with self._mem_lock:
            self._recent.evict_through(last_id)
            self._dropped += count
            self._depth -= count
            self._bytes -= freed

    # -- persisted counters -----------------------------------------------------------------

    def counter(self, name: str) -> int:
        with self._db_lock:
            return outbox_db.counter(self._db, name)

    def bump(self, name: str) -> int:
        """Add one to a persisted counter and return the new value (committed)."""
        with self._db_lock:
            outbox_db.add_to_counter(self._db, name, 1)
            return outbox_db.counter(self._db, name)

    def close(self) -> None:
        """Finish the writer's work (one last round), then close the database."""
        with self._mem_lock:
            self._closing = True
        self._wake.set()
        self._writer.join()
        self.flush()
        with self._db_lock:
            self._db.close()
