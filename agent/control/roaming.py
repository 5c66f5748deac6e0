"""The operator's session across the members of a broker list (``mqtt.brokers``).

paho's network thread reconnects by itself, but only to the broker it was given.  When the
connection is lost (or a reconnect fails) this points it at the next member first
(``connect_async`` before paho's reconnect), and on every new connection subscribes again:
the operator's session is a clean one, so a member knows nothing of it.  ``moves`` counts the
connections after the first; ``fleet send`` publishes its command again (same id) after
one, so a node whose replies went to the old member answers again, from its store.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import paho.mqtt.client as mqtt

from agent.link.brokers import address

logger = logging.getLogger(__name__)

KEEPALIVE_S = 30
RECONNECT_MIN_S, RECONNECT_MAX_S = 0.2, 5.0  # paho's own backoff between two tries


class Roaming:
    def __init__(self, client: mqtt.Client, members: list[tuple[str, int]], at: int,
                 topics: list[tuple[str, int]], moved: Callable[[], None]) -> None:
        """Takes over ``client``'s connect and disconnect callbacks; ``at``: the member it
        is connected to; ``topics``: (topic, qos) to subscribe to again; ``moved``: called
        on paho's thread after each new connection."""
        self.client, self.members, self.at = client, members, at
        self.topics, self._moved = topics, moved
        self.moves = 0
        self.connected = threading.Event()
        self.connected.set()
        self.closing = False  # the operator is done: a disconnect is no failure
        client.reconnect_delay_set(RECONNECT_MIN_S, RECONNECT_MAX_S)  # type: ignore[arg-type]
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_connect_fail = self._on_connect_fail

    @property
    def broker(self) -> str:
        return address(*self.members[self.at])

    def close(self) -> None:
        self.closing = True
        self.client.disconnect()

    def _on_disconnect(self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any,
                       properties: Any) -> None:
        self.connected.clear()
        if not self.closing:
            logger.warning("lost the broker %s (%s)", self.broker, reason)
            self._next()

    def _on_connect_fail(self, client: mqtt.Client, userdata: Any) -> None:
        if not self.closing:
            self._next()

    def _next(self) -> None:
        """paho reconnects, after its backoff, to the member named here."""
        self.at = (self.at + 1) % len(self.members)
        host, port = self.members[self.at]
        self.client.connect_async(host, port, KEEPALIVE_S)

    def _on_connect(self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any,
                    properties: Any) -> None:
        if reason.is_failure:  # refused: paho disconnects, which moves on
            logger.warning("the broker %s refused the connection: %s", self.broker, reason)
            return
        if self.topics:
            client.subscribe(self.topics)
        self.moves += 1
        logger.warning("connected to the broker %s", self.broker)
        self.connected.set()
        self._moved()
