"""A check that a cluster member delivers the node's commands, a few times per connection.

RabbitMQ 3.10 keeps each MQTT subscription in a queue named after the client id.  When a
node's member dies and the node lands on another within a second or two, the survivors are
still removing the dead member's queues by name, in batches, and then their topic bindings
(``rabbit_amqqueue:on_node_down``; rabbitmq-server issues 6271 and 9798, fixed for MQTT only
in 3.12.12 / 3.13): the new queue's record or bindings, made in between, go too.  The
SUBSCRIBE was acknowledged, the node's telemetry flows, and its commands go nowhere, for
good (measured: 342 of 1,000 nodes of ``bench/fleet.py`` answered no broadcast).  So on a
broker list the link publishes a nonce to a topic of its own command subscription, the
first filter of its SUBSCRIBE (bound first: when it survived the clean-up, so did the
rest), once subscribed, again ``AGAIN_S`` later (each stretched by up to ``SPREAD``: the
nodes of a dead member land together and must not probe in waves for good), when the
clean-up is over, and every ``EVERY_S`` from then on.  When one has not come back within
``PROBE_S`` (in the link's inbox counts: a node busy with replies reads its socket but
dispatches later) the connection ends, and the member is treated as a failed one (its
backoff, the next member, after ``PAUSE_S``), where the subscriptions are made anew,
under a client id of its own (``client_id``): a clean-up that is still going on deletes by
name, and the node's own name was measured to be deleted again after 5-10 s (317 of 1,000
nodes twice or three times).

A shared filter (``all``, a group) cannot be probed: its probe would reach every node.  Yet
3.10 was measured to leave nodes deaf to ``all`` alone, for good (10 of 1,000 after a kill,
answered only when the operator sent each its command alone).  So before each later probe
the subscriptions are made anew (``client.renew``: UNSUBSCRIBE, SUBSCRIBE, then the probe,
in order on the connection), which binds them again (0-1 of 1,000 left measured after).
The probe message never reaches the controller.
"""

from __future__ import annotations

import logging
import random
import secrets
import time
from collections.abc import Callable, Iterable
from typing import Any

from agent.link.client import renew
from agent.link.settings import LinkSettings

logger = logging.getLogger("agent.link.mqtt")  # its lines are the link's
PROBE = "_link-probe"  # a command name no controller has: ``cmd/_link-probe``
PROBE_S = 10.0
AGAIN_S = (30.0, 90.0)  # after the subscriptions, once more each: past a member's clean-up
SPREAD = 0.5  # each of AGAIN_S is stretched by a random share up to this
EVERY_S = 600.0  # and from then on: a subscription lost later is found within this
# after a lost probe, before the next connect: the queue the dead connection leaves is
# deleted by name when it goes, and must go before a new one of that name is made
PAUSE_S = 5.0


class DeliveryProbe:
    def __init__(self, topic: str, settings: LinkSettings,
                 clock: Callable[[], float] = time.monotonic,
                 share: Callable[[], float] = random.random) -> None:
        """Enabled on a broker list of more than one member; ``share``: a number in [0, 1)
        that stretches each later probe (tests pin it)."""
        self.topic, self.settings, self.clock, self.share = topic, settings, clock, share
        self.enabled = len(settings.brokers) > 1
        self._filters: tuple[str, ...] = ()  # the node's subscriptions, renewed before a probe
        self._renewing = False  # a renewal's SUBACK is due: no new round of probes
        self._nonce = b""
        self._sent_at: float | None = None
        self._subscribed_at: float | None = None
        self._again: list[float] = []  # the later probes still to send on this connection
        self.broken = False  # the last connection failed its probe
        self.lost = 0  # probes lost since the agent started

    def reset(self) -> None:
        """A new connection: nothing sent on it yet."""
        self._sent_at, self._subscribed_at, self._again, self.broken = None, None, [], False
        self._renewing = False

    def start(self, client: Any) -> None:
        """The subscriptions are acknowledged: send the nonce through them (and later
        again)."""
        if self.enabled and client is not None:
            self._subscribed_at = self.clock()
            self._again = [again * (1 + SPREAD * self.share()) for again in AGAIN_S]
            self._send(client)

    def acknowledged(self, client: Any, broker: str, filters: tuple[str, ...],
                     failed: list[bool]) -> str | None:
        """The SUBACK: the probe starts, or why not (the broker refused some of ``filters``:
        logged; on a list the connection then ends as after a lost probe: another member,
        and a client id of its own, may take them)."""
        refused = [pattern for pattern, bad in zip(filters, failed, strict=False) if bad]
        if not refused:
            if not self._renewing:  # a renewal's probe went after it
                self._filters = filters
                self.start(client)
            self._renewing = False
            return None
        if self.enabled:
            self._lose()
        why = f"{broker} refused the subscription to {', '.join(refused)}"
        logger.error("mqtt: %s; %s", why, "reconnecting" if self.enabled else
                     "the commands sent there do not reach this node")
        return why

    def client_id(self, node_id: str) -> str:
        """The client id of the next connection: the node id until a probe is lost, then
        one with ``~`` and the count (a node id has no ``~``), which no clean-up deletes."""
        return f"{node_id}~{self.lost}" if self.lost else node_id

    def _lose(self) -> None:
        """This connection does not deliver: no more probes on it, the next waits and has
        a client id of its own."""
        self._sent_at, self._again, self.broken, self.lost = None, [], True, self.lost + 1

    def _send(self, client: Any) -> None:
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

    def delay(self, normal: float) -> float:
        """The wait before the next connect: ``normal``, or after a lost probe at least
        PAUSE_S (up to twice that, spread so the nodes of one member do not come back at
        once)."""
        return max(normal, PAUSE_S * (1 + random.random())) if self.broken else normal

    def failed(self, broker: str, client: Any = None, inbox: Iterable[Any] = ()) -> str | None:
        """Why the connection to ``broker`` must end (a probe did not come back in time,
        logged), or None; a later probe that is due is sent on ``client``; ``inbox``: the
        messages received and not yet dispatched (``take`` swallows the probe there later)."""
        now = self.clock()
        if self._sent_at is None:
            if self._again and self._subscribed_at is not None and client is not None and \
                    now - self._subscribed_at >= self._again[0]:
                due = self._again.pop(0)
                self._again = self._again or [due + EVERY_S]
                if self._filters:  # renewed, then the probe, in order on the connection
                    renew(client, self.settings, self._filters)
                    self._renewing = True
                self._send(client)
            return None
        if now - self._sent_at < PROBE_S or any(self.take(message) for message in inbox
                                                 if message.payload == self._nonce):
            return None
        self._lose()
        why = (f"{broker} acknowledged the subscriptions but delivered nothing on them within "
               f"{PROBE_S:.0f} s (a queue left by a member that died?)")
        logger.warning("mqtt: %s; reconnecting", why)
        return why
