"""The outbox's window in memory: the newest committed records, so the link sends live
records without reading back from disk what was just written.

A run of committed records with consecutive ids, none of them deleted or asked to be, up to
``RECENT_BYTES``.  Not thread-safe: the outbox guards it with its memory lock.
"""

from __future__ import annotations

from collections import deque

from agent.telemetry.outbox_db import Record

RECENT_BYTES = 1 << 20


class RecentWindow:
    def __init__(self) -> None:
        self._records: deque[Record] = deque()
        self._bytes = 0

    def remember(self, record: Record) -> None:
        """Keep the record if it extends the window.  A full window keeps its oldest records,
        the ones the link reads next, and the rest are read from disk; once acknowledgements
        have emptied it, it opens again at the next record stored."""
        records = self._records
        if records and (records[-1].id != record.id - 1
                        or self._bytes + record.size > RECENT_BYTES):
            return
        records.append(record)
        self._bytes += record.size

    def evict_through(self, last_id: int) -> None:
        """A delete or a drop evicts the record and everything older."""
        while self._records and self._records[0].id <= last_id:
            self._bytes -= self._records.popleft().size

    def read(self, after_id: int, limit: int, below_id: int) -> list[Record]:
        """The records the window holds from ``after_id + 1`` on: up to ``limit``, below
        ``below_id``; nothing when it does not hold ``after_id + 1``."""
        records = self._records
        if not records or not records[0].id <= after_id + 1 <= records[-1].id:
            return []
        start = after_id + 1 - records[0].id
        end = min(len(records), start + limit, below_id - records[0].id)
        return [records[i] for i in range(start, end)]
