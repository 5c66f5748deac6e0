"""Collecting a command's replies, node by node, and sending it again where it may not
have arrived.

A command reaches a node when the broker delivers it; nothing in MQTT says it did.  So
while the replies come in, the command goes again (same id: a node that ran it answers
from its store) when the operator's session moved to another member, when a node that
has not answered announces a new birth, and once, when no reply came for ``SILENT_S``, to
each node still silent, on its own topic (while replies flow, a busy fleet is still
answering, and more sends would only make it busier).  A RabbitMQ 3.10 member's clean-up
after another member died was measured to leave nodes that hear commands on their own
topic but no broadcast (21 of 1,000 in bench/fleet.py, every one answering a command sent
to it alone).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agent import protocol
from agent.control.operator import Bus

SILENT_S = 5.0  # no reply for this long: each silent node gets the command on its own topic
NO_REPLY = "no reply"


@dataclass
class Outcome:
    """One node's answer to a command, its result put back together from chunks."""

    node: str
    status: str = NO_REPLY
    code: str = ""
    message: str = ""
    ms: float | None = None
    result: Any = None
    chunks: dict[int, str] = field(default_factory=dict)

    def absorb(self, reply: dict[str, Any], sent_at: float) -> None:
        whole = protocol.reassembled(self.chunks, reply)
        if whole is None or self.status in protocol.FINAL:
            return
        self.status = whole.get("status", "?")
        self.code = whole.get("code", "")
        self.message = whole.get("message") or whole.get("step") or ""
        self.result = whole.get("result")
        self.ms = round((time.time() - sent_at) * 1000, 1)


def collect(bus: Bus, command_id: str, expected: set[str], sent_at: float, timeout: float,
            again: Callable[[str | None], None] | None = None) -> dict[str, Outcome]:
    """Replies by node until every expected node has a final one, or the timeout.
    ``again(None)`` publishes the command once more (same id) when the session moved to
    another member, ``again(node)`` when a node still to answer came back (a new birth, live,
    not from a retained store: its clean session kept nothing; ``resend.resender``) and,
    once, for each node silent when no reply came for ``SILENT_S``: it answers from its
    store, once."""
    outcomes = {node: Outcome(node) for node in expected}
    seen, moves, back = 0, bus.moves, set[str]()  # back: nodes to send it to again
    known = bus.nodes()  # the births retained now; then each new one as it arrives
    births = {n: (known.get(n, {}).get("birth") or {}).get("session") for n in expected}
    deadline = time.monotonic() + timeout
    silent_at: float | None = time.monotonic() + SILENT_S
    while True:
        if again is not None and silent_at is not None and time.monotonic() >= silent_at:
            back |= {node for node in expected if outcomes[node].status == NO_REPLY}
            silent_at = None
        if again is not None and (bus.moves != moves or back):
            for node in [None] if bus.moves != moves else sorted(back):
                again(node)
            moves, back = bus.moves, set()
        with bus.lock:
            fresh, first, seen = bus.messages[seen:], seen, len(bus.messages)
        for index, (topic, reply) in enumerate(fresh, first):
            parsed = protocol.node_topic(bus.fleet, topic)
            if parsed is not None and parsed[1] == protocol.BIRTH and parsed[0] in births:
                node, session = parsed[0], reply.get("session")
                if again and session != births[node] and index not in bus.stale and \
                        outcomes[node].status not in protocol.FINAL:
                    back.add(node)
                births[node] = session
            if not protocol.is_reply(topic) or reply.get("id") != command_id:
                continue
            node = reply.get("node_id", "?")
            outcomes.setdefault(node, Outcome(node)).absorb(reply, sent_at)
            if silent_at is not None:  # replies flow: not yet
                silent_at = time.monotonic() + SILENT_S
        if time.monotonic() >= deadline or (expected and all(
                o.status in protocol.FINAL for o in outcomes.values() if o.node in expected)):
            return outcomes
        if not back:
            until = deadline if silent_at is None or again is None else min(deadline, silent_at)
            bus.wait_past(seen, until - time.monotonic(), moves)
