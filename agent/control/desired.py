"""Desired state in order: per scope (the node, each group) the newest signed state wins.

The ``issued_at`` and id of the desired state applied in each scope are persisted in the
command store, so a republished older one is refused (``stale``) even after a restart, and
the retained one the broker redelivers on every reconnect is recognised (a no-op while the
node runs; after a restart it is converged again, since stopping may have rolled it back).
"""

from __future__ import annotations

import threading
from typing import Any

from agent.control.envelope import EnvelopeError
from agent.control.store import CommandStore

REDELIVERED = "redelivered"  # the same id again: nothing to do
APPLY = "apply"


class DesiredStates:
    def __init__(self, store: CommandStore, node_target: str) -> None:
        self.store, self.node_target = store, node_target
        self._lock = threading.Lock()
        self._held: dict[str, dict[str, Any]] = {}  # scope target -> envelope, this run

    def admit(self, target: str, envelope: dict[str, Any]) -> str:
        """APPLY (and persisted as the scope's newest), REDELIVERED, or EnvelopeError
        ``stale``: older than the one applied, or as old and another id (no order)."""
        key = f"desired:{target}"
        with self._lock:
            applied = self.store.get_state(key)
            held = self._held.get(target)
            if held is not None and held["id"] == envelope["id"]:
                return REDELIVERED
            if isinstance(applied, dict) and applied.get("id") != envelope["id"] and \
                    envelope["issued_at"] <= applied.get("issued_at", -1):
                raise EnvelopeError("stale", f"issued at {envelope['issued_at']}, not after "
                                    f"the desired state applied ({applied.get('id')!r}, "
                                    f"issued at {applied.get('issued_at')})")
            self.store.set_state(key, {"id": envelope["id"],
                                       "issued_at": envelope["issued_at"]})
            # a clear is held as a marker, so that its redelivery is recognised too
            self._held[target] = ({"id": envelope["id"], "clear": True}
                                  if envelope.get("clear") else envelope)
            return APPLY

    def chosen(self) -> dict[str, Any] | None:
        """The node's own desired state wins over a group's; the newest group's otherwise."""
        with self._lock:
            held = {t: e for t, e in self._held.items() if not e.get("clear")}
        node = held.get(self.node_target)
        groups = [e for t, e in held.items() if t.startswith("group:")]
        return node or max(groups, key=lambda e: e["issued_at"], default=None)
