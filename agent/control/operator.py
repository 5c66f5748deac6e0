"""The operator client: a broker session that knows the fleet, and signed commands over it.

It needs only the broker and a private key; who is in the fleet comes from the nodes'
retained ``state`` and ``birth`` messages.  ``edge-agent fleet`` and the tests both use it.
With a broker list it connects to one member, in an order of its own, and moves to the next
when that one goes away (``roaming``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from paho.mqtt.enums import CallbackAPIVersion

from agent import protocol
from agent.control.envelope import key_id, private_key_pem, public_key_text
from agent.control.received import Telemetry
from agent.control.roaming import Roaming
from agent.link.brokers import parse_member
from agent.link.client import subscription_qos
from agent.link.settings import read_password
from agent.link.sockets import no_delay

RETAINED_SETTLE_S = 2.0  # at most, for the retained messages after subscribing
HANDSHAKE_TIMEOUT_S = 5.0  # CONNACK and SUBACK
PUBLISH_TIMEOUT_S = 10.0  # PUBACK


class FleetError(Exception):
    """The broker took part but the operation failed (a refused publish)."""


class BrokerError(Exception):
    """The broker cannot be used at all: unreachable, TLS, a refused login or subscription,
    a handshake never answered.  The message says which broker and why."""


@dataclass(frozen=True)
class BrokerSettings:
    host: str = "localhost"
    port: int = 1883
    tls: bool = False
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    username: str | None = None
    password_file: str | None = None
    brokers: tuple[str, ...] = ()  # "host:port" each: a cluster's members (not host, port)
    protocol: str = "5"  # or "3.1.1", for a broker without MQTT 5 (RabbitMQ before 3.13)

    @property
    def where(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def members(self) -> list[tuple[str, int]]:
        parsed = [parse_member(text) for text in self.brokers]
        return [member for member in parsed if member is not None] or [(self.host, self.port)]


def generate_key(path: Path) -> dict[str, str]:
    """A new private key written to ``path`` (mode 0600), and the ``trusted_keys`` entry
    every node needs to accept what it signs."""
    key = Ed25519PrivateKey.generate()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(private_key_pem(key))
    public = key.public_key()
    return {"id": key_id(public), "public_key": public_key_text(public)}


# -- the session ----------------------------------------------------------------------------


@dataclass
class Bus:
    """An operator's MQTT session that records what arrives on the topics it watches: the
    newest of each node's retained topics and telemetry, and (``log``, for an operation of
    bounded time) every message, a copy of a telemetry record dropped."""

    fleet: str
    client: mqtt.Client
    lock: threading.Lock = field(default_factory=threading.Lock)
    retained: dict[str, dict[str, Any]] = field(default_factory=dict)  # topic -> payload
    telemetry: Telemetry = field(default_factory=Telemetry)
    log: bool = True  # a watch of days keeps the newest of each node only
    messages: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    stale: set[int] = field(default_factory=set)  # messages that came from a retained store
    acks: dict[int, str | None] = field(default_factory=dict)  # mid -> refusal, if any
    arrived: threading.Condition = field(init=False)  # notified on each message and move
    topics: list[tuple[str, int]] = field(default_factory=list)  # subscribed, with QoS
    roaming: Roaming | None = None  # once connected

    def __post_init__(self) -> None:
        self.arrived = threading.Condition(self.lock)

    def on_message(self, client: mqtt.Client, userdata: Any, message: mqtt.MQTTMessage) -> None:
        try:
            payload = json.loads(message.payload) if message.payload else None
        except ValueError:
            return
        if payload is not None and not isinstance(payload, dict):
            return  # every payload of the protocol is an object
        with self.arrived:
            if message.retain or protocol.suffix_of(message.topic) in protocol.RETAINED:
                if payload is None:
                    self.retained.pop(message.topic, None)
                else:
                    self.retained[message.topic] = payload
            elif payload is not None and protocol.suffix_of(message.topic) == \
                    protocol.TELEMETRY and not self.telemetry.take(message.topic, payload):
                return  # a copy (at-least-once delivery, a replay after a failover)
            if payload is not None and self.log:
                if message.retain:  # what was, not what happens: a birth of long ago
                    self.stale.add(len(self.messages))
                self.messages.append((message.topic, payload))
            self.arrived.notify_all()

    def on_publish(self, client: mqtt.Client, userdata: Any, mid: int, reason: Any,
                   properties: Any) -> None:
        with self.lock:
            self.acks[mid] = str(reason) if reason.is_failure else None

    def publish(self, topic: str, payload: bytes, retain: bool = False) -> None:
        """Publish at QoS 1 and wait for the broker's acknowledgement (again on the next
        member when the session moves first); FleetError if it refuses it (an ACL) or none."""
        deadline = time.monotonic() + PUBLISH_TIMEOUT_S
        while True:  # a member that dies before it acknowledges: again on the next one
            if self.roaming is not None:
                self.roaming.connected.wait(HANDSHAKE_TIMEOUT_S)
            moves, info = self.moves, self.client.publish(topic, payload, qos=1, retain=retain)
            try:
                while not info.is_published() and self.moves == moves and \
                        time.monotonic() < deadline:
                    info.wait_for_publish(0.1)
            except (RuntimeError, ValueError) as error:  # not connected: wait for the move
                while self.moves == moves and time.monotonic() < deadline:
                    self.wait_past(1 << 62, deadline - time.monotonic(), moves)
                if self.moves == moves:
                    raise FleetError(f"could not publish on {topic}: {error}") from None
            if info.is_published() or time.monotonic() >= deadline:
                break
        if not info.is_published():
            raise FleetError(f"the broker did not acknowledge the message on {topic} "
                             f"within {PUBLISH_TIMEOUT_S:.0f} s")
        with self.lock:
            refused = self.acks.pop(info.mid, None)
        if refused:
            raise FleetError(f"the broker refused the message on {topic}: {refused}")

    def wait_past(self, count: int, timeout: float, moves: int) -> None:
        """Until more than ``count`` messages arrived, the session moved to another member
        (``moves`` is past ``moves``) or ``timeout`` passed: woken by each, not polling."""
        with self.arrived:
            self.arrived.wait_for(lambda: len(self.messages) > count or self.moves != moves,
                                  timeout)

    def close(self) -> None:
        if self.roaming is not None:
            self.roaming.close()
        else:
            self.client.disconnect()
        self.client.loop_stop()

    @property
    def moves(self) -> int:
        """Connections to a member after the first: what was published may be lost."""
        return self.roaming.moves if self.roaming is not None else 0

    def _moved(self) -> None:
        with self.arrived:
            self.arrived.notify_all()

    def nodes(self) -> dict[str, dict[str, Any]]:
        """node id -> {state, birth, reported, telemetry (the newest)} from what arrived."""
        found: dict[str, dict[str, Any]] = {}
        with self.lock:
            items = list(self.retained.items()) + list(self.telemetry.newest.items())
        for topic, payload in items:
            parsed = protocol.node_topic(self.fleet, topic)
            if parsed is not None and parsed[1] in protocol.NODE_FACTS:
                found.setdefault(parsed[0], {})[parsed[1]] = payload
        return found


def connect(settings: BrokerSettings, fleet: str, watch: Sequence[str] = (),
            share: str | None = None) -> Bus:
    """A session whose handshake, subscriptions and retained messages are complete, on the
    first member of the broker list that takes it (the list in a random rotation: operators
    spread over the members too); it moves to the next one when that one goes away.

    ``watch`` names the topics of every node to subscribe to (``state``, ``cmd/ping/res``);
    with none it only connects (``desired`` publishes).  ``share``: what is not retained
    comes through the MQTT 5 shared subscription ``$share/<share>/...``, so that operators
    watching in one group each get a part.  Every way the brokers can fail us is a
    BrokerError that says which broker and why."""
    members = settings.members
    start, problems = random.randrange(len(members)), []
    for step in range(len(members)):
        at = (start + step) % len(members)
        host, port = members[at]
        try:
            bus = _connect_one(dataclasses.replace(settings, host=host, port=port), fleet,
                               watch, share)
        except BrokerError as error:
            problems.append(str(error))
            continue
        bus.roaming = Roaming(bus.client, members, at, bus.topics, bus._moved)
        return bus
    raise BrokerError(problems[0] if len(problems) == 1 else
                      "no broker of the list could be used: " + "; ".join(problems))


def _connect_one(settings: BrokerSettings, fleet: str, watch: Sequence[str],
                 share: str | None) -> Bus:
    where = settings.where
    client_id = f"edge-operator-{uuid.uuid4().hex[:12]}"
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id,
                         protocol=mqtt.MQTTv5 if settings.protocol == "5" else mqtt.MQTTv311)
    try:
        if settings.tls:
            client.tls_set(ca_certs=settings.tls_ca, certfile=settings.tls_cert,
                           keyfile=settings.tls_key)
        if settings.username:
            client.username_pw_set(settings.username, read_password(settings.password_file))
    except OSError as error:  # ssl.SSLError is one
        raise BrokerError(f"broker {where}: {error}") from None
    bus = Bus(fleet=fleet, client=client)
    sync_topic = protocol.sync_topic(fleet, client_id)
    connected, subscribed, synced = threading.Event(), threading.Event(), threading.Event()
    refused: list[str] = []

    def on_connect(client: mqtt.Client, userdata: Any, flags: Any, reason: Any,
                   properties: Any) -> None:
        if reason.is_failure:
            refused.append(str(reason))
        connected.set()

    def on_subscribe(client: mqtt.Client, userdata: Any, mid: int, reasons: Any,
                     properties: Any) -> None:
        refused.extend(f"{topic}: {reason}"
                       for topic, reason in zip(topics_sent, reasons, strict=False)
                       if reason.is_failure)
        subscribed.set()

    def on_message(client: mqtt.Client, userdata: Any, message: mqtt.MQTTMessage) -> None:
        if message.topic == sync_topic:
            synced.set()
        else:
            bus.on_message(client, userdata, message)

    wanted = [protocol.each_node(fleet, suffix) if share is None or suffix in
              protocol.RETAINED else f"$share/{share}/{protocol.each_node(fleet, suffix)}"
              for suffix in watch]
    bus.topics = [(topic, subscription_qos(settings.brokers)) for topic in wanted]
    topics_sent = [*wanted, sync_topic]
    client.on_connect, client.on_subscribe, client.on_message = (on_connect, on_subscribe,
                                                                 on_message)
    client.on_publish = bus.on_publish
    try:
        client.connect(settings.host, settings.port, keepalive=30)
    except OSError as error:  # DNS (gaierror), refused, unreachable, timeout, TLS
        raise BrokerError(f"cannot reach the broker {where}: "
                          f"{error.strerror or error}") from None
    no_delay(client.socket())  # a command right after an ack must not wait for Nagle
    client.loop_start()
    try:
        if not connected.wait(HANDSHAKE_TIMEOUT_S):
            raise BrokerError(f"the broker {where} did not answer the MQTT handshake within "
                              f"{HANDSHAKE_TIMEOUT_S:.0f} s")
        if refused:
            raise BrokerError(f"the broker {where} refused the connection: {refused[0]}")
        if wanted:
            client.subscribe([(topic, subscription_qos(settings.brokers))
                              for topic in topics_sent])
            if not subscribed.wait(HANDSHAKE_TIMEOUT_S):
                raise BrokerError(f"the broker {where} did not confirm the subscription "
                                  f"within {HANDSHAKE_TIMEOUT_S:.0f} s")
            if refused:
                raise BrokerError(f"the broker {where} refused the subscription to "
                                  f"{'; '.join(refused)}")
            # The broker sends a subscription's retained messages before anything published
            # after it on this connection: once our own marker is back, they are all here.
            client.publish(sync_topic, b"", qos=1)
            synced.wait(RETAINED_SETTLE_S)
    except BaseException:
        bus.close()
        raise
    return bus


# -- commands and desired state -------------------------------------------------------------


def wire(envelope: dict[str, Any]) -> bytes:
    """An envelope as published: plain JSON, never NaN or Infinity (they are not JSON, and a
    node refuses them)."""
    return json.dumps(envelope, allow_nan=False).encode()


def publish_command(bus: Bus, scope: str, envelope: dict[str, Any]) -> None:
    """A signed envelope on ``<scope>/cmd/<command>`` (scope: a node, ``all``, ``group/<g>``)."""
    bus.publish(protocol.topic(protocol.scope_root(bus.fleet, scope),
                               protocol.command_suffix(envelope["command"])), wire(envelope))


def publish_desired(bus: Bus, scope: str, envelope: dict[str, Any]) -> str:
    """Retain a signed desired state on ``<scope>/desired``; its topic.  A clear is a signed
    envelope too (``clear: true``), retained in its place, so a node that reconnects later
    hears of it and nobody without a key can clear a scope."""
    topic = protocol.topic(protocol.scope_root(bus.fleet, scope), protocol.DESIRED)
    bus.publish(topic, wire(envelope), retain=True)
    return topic


def expected_nodes(bus: Bus, target: str) -> set[str]:
    """Who should answer: the node itself, or the online members of the fleet or group."""
    if target.startswith("node:"):
        return {target.removeprefix("node:")}
    group = target.removeprefix("group:") if target.startswith("group:") else None
    found = set()
    for node, facts in bus.nodes().items():
        if (facts.get("state") or {}).get("state") not in ("online", "degraded"):
            continue
        if group is None or group in (facts.get("birth") or {}).get("groups", []):
            found.add(node)
    return found
