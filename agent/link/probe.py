"""A check that a cluster member delivers the node's commands, once per connection.

RabbitMQ 3.10 keeps each MQTT subscription in a queue named after the client id.  When a
node's member dies and the node lands on another within a second or two, the cluster may
not yet have removed the dead member's queue: the SUBSCRIBE is acknowledged, but it is bound
to a queue nobody reads, and the node's commands go nowhere while its telemetry flows
(measured: 342 of 1,000 nodes of ``bench/fleet.py`` answered no broadcast).  So on a broker
list the link publishes a nonce to a topic of its own command subscription once subscribed;
when it has not come back within ``PROBE_S`` the connection ends, and the member is treated
as a failed one (its backoff, the next member).  The probe message never reaches the
controller.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("agent.link.mqtt")  # its lines are the link's
PROBE = "_link-probe"  # a command name no controller has: ``cmd/_link-probe``
PROBE_S = 10.0


class DeliveryProbe:
    def __init__(self, topic: str, brokers: tuple[str, ...],
                 clock: Callable[[], float] = time.monotonic) -> None:
        """Enabled on a broker list of more than one member."""
        self.topic, self.enabled, self.clock = topic, len(brokers) > 1, clock
        self._nonce = b""
        self._sent_at: float | None = None
        self.broken = False  # the last connection failed its probe

    def reset(self) -> None:
        """A new connection: nothing sent on it yet."""
        self._sent_at, self.broken = None, False

    def start(self, client: Any) -> None:
        """The subscriptions are acknowledged: send the nonce through them."""
        if self.enabled and client is not None:
            self._nonce = secrets.token_hex(8).encode()
            self._sent_at = self.clock()
            client.publish(self.topic, self._nonce, qos=1)

    def take(self, message: Any) -> bool:
        """Whether ``message`` is a probe (the handler never sees one); ours passes it."""
        if getattr(message, "topic", None) != self.topic:
            return False
        if message.payload == self._nonce:
            self._sent_at = None
        return True

    def failed(self, broker: str) -> str | None:
        """Why the connection to ``broker`` must end (its probe did not come back in time,
        logged), or None."""
        if self._sent_at is None or self.clock() - self._sent_at < PROBE_S:
            return None
        self._sent_at, self.broken = None, True
        why = (f"{broker} acknowledged the subscriptions but delivered nothing on them within "
               f"{PROBE_S:.0f} s (a queue left by a member that died?)")
        logger.warning("mqtt: %s; reconnecting", why)
        return why
