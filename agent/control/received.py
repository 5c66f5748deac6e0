"""What an operator session keeps of the nodes' telemetry: the newest record of each node,
and the keys of its latest records, so that a copy is dropped.

Telemetry is delivered at least once: a record in flight when a broker member dies is
published again by the node on the next member (its outbox keeps it until acknowledged),
and the dead member may have passed it on already.  The protocol makes each record's
(session, seq) unique per node, so the consumer is where a copy is recognised.  A watch
runs for days on a whole fleet: what it keeps is bounded per node and in nodes.
"""

from __future__ import annotations

from collections import deque
from typing import Any

RECENT = 256  # keys kept per node: far more than a failover can have in flight
MAX_NODES = 100_000  # telemetry topics tracked; more is not a fleet but a flood


class Telemetry:
    """Newest record per topic (by ``ts``: a replayed record older than a live one does not
    replace it) and a window of the (session, seq) keys seen per topic."""

    def __init__(self, recent: int = RECENT, max_nodes: int = MAX_NODES) -> None:
        self.newest: dict[str, dict[str, Any]] = {}
        self.duplicates = 0  # copies dropped
        self.untracked = 0  # records on topics past ``max_nodes``, not kept
        self._recent, self._max_nodes = recent, max_nodes
        self._order: dict[str, deque[tuple[Any, Any]]] = {}
        self._seen: dict[str, set[tuple[Any, Any]]] = {}

    def take(self, topic: str, record: dict[str, Any]) -> bool:
        """True when ``record`` is new (and kept), False for a copy or a flood's."""
        if topic not in self._seen and len(self._seen) >= self._max_nodes:
            self.untracked += 1
            return False
        key = (record.get("session"), record.get("seq"))
        seen = self._seen.setdefault(topic, set())
        if key in seen:
            self.duplicates += 1
            return False
        if all(isinstance(part, int) for part in key):  # a record without them: no key
            order = self._order.setdefault(topic, deque())
            if len(order) >= self._recent:
                seen.discard(order.popleft())
            order.append(key)
            seen.add(key)
        kept = self.newest.get(topic)
        if kept is None or _ts(kept) <= _ts(record):
            self.newest[topic] = record
        return True


def _ts(record: dict[str, Any]) -> float:
    value = record.get("ts", 0)
    return float(value) if isinstance(value, int | float) else 0.0
