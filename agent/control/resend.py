"""A command sent once more while its replies are collected: to the whole scope after the
operator's session moved to another member, to one node when that node came back.

Sent to the scope again for one node's return, a broadcast would reach the whole fleet
once more, every node verifying it and answering from its store: over a broker member's
failover, with hundreds of nodes coming back one by one, that is quadratic in the fleet
(measured in bench/fleet.py).  So a node that came back gets the envelope on its own
topic, with itself as the target and signed anew: the same id and times, so a node that
ran it answers from its store and one that never heard of it runs it once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent.control.envelope import signed
from agent.control.operator import Bus, publish_command


def resender(bus: Bus, key: Ed25519PrivateKey, scope: str,
             envelope: dict[str, Any]) -> Callable[[str | None], None]:
    """``collect``'s ``again`` for ``envelope`` sent to ``scope`` (a node, ``all`` or
    ``group/<g>``)."""

    def again(node: str | None) -> None:
        if node is None or envelope["target"] == f"node:{node}":
            publish_command(bus, scope, envelope)
        else:
            publish_command(bus, node, signed(key, {**envelope, "target": f"node:{node}"}))

    return again
