"""The MQTT link: one thread owns the paho client, the connection and all publishing.

The thread runs paho's network steps itself (``loop_read``/``loop_write``/``loop_misc``)
over an epoll selector, so there is no second thread and no ``select()`` limit of 1024 file
descriptors (a process simulating hundreds of nodes needs more).  paho's callbacks only
append to a queue the thread drains.  Every connect uses a fresh client and paho never
reconnects by itself, so it never re-sends a message from memory: the outbox is the one
source of truth.  Records acknowledged by the broker (PUBACK) leave the outbox; whatever
was queued before a connect is replayed oldest-first, rate-limited and marked
``historical``, while live records go first.  The retained ``state`` and ``birth`` are
published on every connect, and the Last Will says ``offline`` with the connect's session.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode
from paho.mqtt.subscribeoptions import SubscribeOptions

from agent.telemetry.outbox import Outbox
from agent.telemetry.outbox_db import Record
from agent.telemetry.records import Sequence, encode, stamp

logger = logging.getLogger(__name__)

# On the wire: at most IN_FLIGHT unacknowledged messages, paho's default and Mosquitto's
# receive maximum.  Handed to paho: up to WINDOW; paho sends the next one as each PUBACK
# arrives, so the connection never idles while this thread fetches the next batch.
IN_FLIGHT = 20
WINDOW = 200
_RETRYABLE = {0x89, 0x97}  # server busy, quota exceeded: the message may go later
_STOP_ACK_S = 2.0
# Acknowledged records leave the outbox in batches: one transaction per batch, not per
# message.  A crash before a batch is deleted re-sends it (duplicates, never a loss).
ACK_BATCH = 200
ACK_BATCH_S = 0.25


@dataclass(frozen=True)
class LinkSettings:
    client_id: str
    topic_root: str  # edge/v1/<fleet>/<node>
    host: str = "localhost"
    port: int = 1883
    protocol: str = "5"  # or "3.1.1"
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls: bool = False
    username: str | None = None
    password_file: str | None = None
    keepalive_s: int = 30
    max_payload_bytes: int = 64 * 1024
    reconnect_min_s: float = 0.5
    reconnect_max_s: float = 30.0
    replay_per_s: float = 200.0


@dataclass
class LinkStatus:
    """What ``edge-agent status`` and the live terminal line show."""

    state: str = "starting"  # connecting, connected, disconnected, stopped
    broker: str = ""
    session: int = 0
    since: float = field(default_factory=time.time)
    last_error: str | None = None
    connects: int = 0
    published: int = 0
    acked: int = 0
    replayed: int = 0
    rejected: int = 0
    sessions_ended: dict[int, int] = field(default_factory=dict)  # session -> records taken
    heartbeat: float = field(default_factory=time.monotonic)  # the link thread's last round

    def to_dict(self) -> dict[str, Any]:
        fields = dict(self.__dict__)
        del fields["sessions_ended"], fields["heartbeat"]
        return fields


def backoff_delay(attempt: int, low: float, high: float) -> float:
    """Exponential backoff with equal jitter: a fleet reconnecting after a broker restart
    spreads out instead of arriving in one wave."""
    ceiling = min(high, low * 2.0 ** min(attempt, 30))
    return float(ceiling / 2 + random.uniform(0, ceiling / 2))


def read_password(path: str | None) -> str | None:
    """The password in ``path`` without its trailing newline; read at every connect, so a
    rotated file is picked up."""
    if path is None:
        return None
    with open(path) as handle:
        return handle.read().rstrip("\n")


def _reason_failed(code: Any) -> bool:
    return bool(getattr(code, "is_failure", False))


class MqttLink:
    """Connects, reconnects, publishes the outbox and the retained state; see the module."""

    def __init__(self, settings: LinkSettings, outbox: Outbox, sequence: Sequence,
                 announce: Callable[[int], list[tuple[str, bytes]]],
                 on_message: Callable[[mqtt.MQTTMessage], None] | None = None,
                 subscriptions: tuple[str, ...] = ()) -> None:
        self.settings, self.outbox, self.sequence = settings, outbox, sequence
        self.announce, self.on_message, self.subscriptions = announce, on_message, subscriptions
        self.health = "online"  # or "degraded", with the reason
        self.health_reason: str | None = None
        self.status = LinkStatus(broker=f"{settings.host}:{settings.port}")
        self._stop = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._wake_pending = False
        # live-only messages (command replies, state changes): topic, payload, retain, props
        self._direct: deque[tuple[str, bytes, bool, Properties | None]] = deque(maxlen=1000)
        self._rebirth = False
        self._events: deque[tuple[Any, ...]] = deque()  # appended by paho's callbacks only
        self._thread: threading.Thread | None = None
        self._flush_s = 0.0
        self._candidate_session = 0
        # per connection: records in flight by mid, and the two cursors into the outbox
        self._inflight: dict[int, Record] = {}
        self._acked: list[Record] = []
        self._acked_since = 0.0
        self._live_cursor = self._replay_cursor = 0
        self._replay_below = 1
        self._replay_tokens = 0.0
        self._last_refill = time.monotonic()

    # -- API for other threads --------------------------------------------------------------

    def start(self) -> None:
        self.outbox.listen(self.wake)  # new records on disk: publish them
        self._thread = threading.Thread(target=self._run, name="mqtt-link", daemon=True)
        self._thread.start()

    def stop(self, flush_s: float = 2.0, timeout: float = 15.0) -> None:
        """Flush the outbox for up to ``flush_s``, publish ``stopped``, disconnect cleanly."""
        self._flush_s = flush_s
        self.outbox.unlisten(self.wake)
        self._stop.set()
        self.wake()
        if self._thread is not None:
            self._thread.join(timeout)
        self._wake_r.close()
        self._wake_w.close()

    def wake(self) -> None:
        """Tell the link thread there is something to publish (safe from any thread).
        Wakes coalesce: a burst of records costs one system call, not one each."""
        if self._wake_pending:
            return
        self._wake_pending = True
        with contextlib.suppress(OSError):  # closed, or already a byte waiting
            self._wake_w.send(b"\0")

    def _drain_wake(self) -> None:
        """Read the wake bytes, then let the next wake() write one.  A wake() racing with
        this either found the flag still set (its message, queued before, goes out in the
        pump that follows) or wrote a byte that makes the next select return at once;
        clearing the flag first could swallow that byte and leave the flag set for good."""
        with contextlib.suppress(OSError):  # BlockingIOError: drained
            while self._wake_r.recv(4096):
                pass
        self._wake_pending = False

    def publish_now(self, suffix: str, payload: dict[str, Any], retain: bool = False) -> None:
        """A message that is only worth sending live: not kept on disk."""
        self._direct.append((self.topic(suffix), encode(payload), retain, None))
        self.wake()

    def publish_reply(self, topic: str, payload: dict[str, Any], response_topic: str | None,
                      correlation: bytes | None) -> None:
        """A command reply on ``topic``, and under MQTT 5 also to the request's response
        topic with its correlation data (a requester then needs no wildcard)."""
        body = encode(payload)
        self._direct.append((topic, body, False, None))
        if response_topic and self.settings.protocol == "5":
            properties = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
            if correlation is not None:
                properties.CorrelationData = correlation
            self._direct.append((response_topic, body, False, properties))
        self.wake()

    def rebirth(self) -> None:
        """Publish state, birth and the other announcements again, as on a connect."""
        self._rebirth = True
        self.wake()

    def set_health(self, state: str, reason: str | None = None) -> None:
        """``online`` or ``degraded`` (with why): the retained state changes at once."""
        self.health, self.health_reason = state, reason
        if self.status.state == "connected":
            self._direct.append((self.topic("state"),
                                 self._state_payload(state, self.status.session), True, None))
            self.wake()

    def topic(self, suffix: str) -> str:
        return f"{self.settings.topic_root}/{suffix}"

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- the thread -------------------------------------------------------------------------

    def _run(self) -> None:
        attempt = 0
        while not self._stop.is_set():
            client = self._connect()
            if client is not None:
                if self._serve(client):
                    attempt = 0
                sock = client.socket()
                client.disconnect()  # written at once (no paho thread); no-op when gone
                _cork(sock, False)  # and sent now
                if self._stop.is_set():
                    break
            delay = backoff_delay(attempt, self.settings.reconnect_min_s,
                                  self.settings.reconnect_max_s)
            attempt += 1
            self._set_state("disconnected")
            until = time.monotonic() + delay
            while not self._stop.wait(max(0.0, min(1.0, until - time.monotonic()))) and \
                    time.monotonic() < until:
                self.status.heartbeat = time.monotonic()  # waiting is not hanging
        self._set_state("stopped")

    def _set_state(self, state: str, error: str | None = None) -> None:
        if state != self.status.state:
            self.status.state, self.status.since = state, time.time()
        if error is not None:
            self.status.last_error = error

    def _state_payload(self, state: str, session: int) -> bytes:
        reason = {"reason": self.health_reason} if state == "degraded" else {}
        return encode(stamp("state/1", state=state, session=session,
                            node_id=self.settings.client_id, **reason))

    def _new_client(self, session: int) -> mqtt.Client:
        s = self.settings
        version = (MQTTProtocolVersion.MQTTv5 if s.protocol == "5"
                   else MQTTProtocolVersion.MQTTv311)
        client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=s.client_id,
                             protocol=version,
                             clean_session=None if version == MQTTProtocolVersion.MQTTv5
                             else True)
        client.max_inflight_messages_set(IN_FLIGHT)
        client.connect_timeout = 5.0
        client.will_set(self.topic("state"), self._state_payload("offline", session), qos=1,
                        retain=True)
        if s.tls:
            client.tls_set(ca_certs=s.tls_ca, certfile=s.tls_cert, keyfile=s.tls_key)
        if s.username is not None:
            client.username_pw_set(s.username, read_password(s.password_file))  # rotation
        events = self._events
        client.on_connect = lambda c, u, flags, code, props: events.append(("connack", code))
        client.on_disconnect = lambda c, u, flags, code, props: events.append(("gone", code))
        client.on_publish = lambda c, u, mid, code, props: events.append(("ack", mid, code))
        client.on_message = lambda c, u, message: events.append(("message", message))
        return client

    def _connect(self) -> mqtt.Client | None:
        """A fresh client with its Last Will, TCP/TLS connected and CONNECT sent."""
        self._set_state("connecting")
        # The LWT must name the session before the broker knows it; it is committed only
        # when the broker accepts the connection.
        self._candidate_session = self.outbox.counter("session") + 1
        self._events.clear()
        try:
            client = self._new_client(self._candidate_session)
            client.connect(self.settings.host, self.settings.port, self.settings.keepalive_s)
            sock: Any = client.socket()
            # Replies and telemetry are small writes: Nagle would hold the second of two
            # until the broker's delayed ACK (tens of ms) arrives.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except (OSError, ValueError) as error:
            message = f"cannot reach the broker {self.status.broker}: {error}"
            if message != self.status.last_error:
                logger.warning("mqtt: %s; retrying", message)
            self._set_state("connecting", message)
            return None
        return client

    def _serve(self, client: mqtt.Client) -> bool:
        """Run one connection until it ends or the agent stops (then flush and say
        ``stopped`` on it); True once it was accepted."""
        accepted = False
        self._inflight = {}
        self._live_cursor = self._replay_cursor = 0
        self._replay_below = 1
        sock = client.socket()
        if sock is None:
            return False
        with selectors.DefaultSelector() as selector:
            selector.register(self._wake_r, selectors.EVENT_READ)
            selector.register(sock, selectors.EVENT_READ)
            while not (self._stop.is_set() and accepted):
                if not self._step(client, sock, selector, self._wait_s(accepted)):
                    self._events.append(("gone", "socket closed"))
                outcome = self._handle_events()
                if outcome == "accepted":
                    accepted = True
                    self._on_accepted(client)
                elif outcome in ("refused", "gone") or (self._stop.is_set() and not accepted):
                    return accepted
                if accepted:
                    self._pump(client)
            self._shut_down(client, sock, selector)
        return accepted

    def _step(self, client: mqtt.Client, sock: Any, selector: selectors.BaseSelector,
              timeout: float) -> bool:
        """One round of network I/O; False once paho has closed the socket."""
        current: Any = client.socket()
        if current is not sock:
            return False
        wanted = selectors.EVENT_READ | (selectors.EVENT_WRITE if client.want_write() else 0)
        selector.modify(sock, wanted)
        _cork(sock, False)  # what the last round wrote leaves before this one waits
        events = selector.select(timeout)
        _cork(sock, True)  # this round's writes go out together, in full segments
        for key, mask in events:
            if key.fileobj is self._wake_r:
                self._drain_wake()
                continue
            if mask & selectors.EVENT_READ:
                client.loop_read()
            if mask & selectors.EVENT_WRITE and client.socket() is sock:
                client.loop_write()
        if client.socket() is sock:
            client.loop_misc()  # keepalive pings
        self.status.heartbeat = time.monotonic()
        return client.socket() is sock

    def _wait_s(self, accepted: bool) -> float:
        """Sleep until woken, readable, the next replay slot or ack batch, at most 1 s."""
        wait = 1.0
        if accepted and self._replay_below > self._replay_cursor + 1:
            wait = min(wait, max(0.001, 1.0 / self.settings.replay_per_s))
        if self._acked:
            wait = min(wait, max(0.0, self._acked_since + ACK_BATCH_S - time.monotonic()))
        return wait

    def _handle_events(self) -> str | None:
        outcome = None
        while self._events:
            event = self._events.popleft()
            kind = event[0]
            if kind == "connack":
                if _reason_failed(event[1]):
                    self._refused(event[1])
                    outcome = "refused"
                else:
                    outcome = "accepted"
            elif kind == "gone":
                self._forget_acked()
                if self.status.state == "connected":
                    logger.warning("mqtt: connection to %s lost (%s)", self.status.broker,
                                   event[1])
                outcome = outcome if outcome == "refused" else "gone"
            elif kind == "ack":
                record = self._ack(event[1], event[2])
                if record is not None:
                    if not self._acked:
                        self._acked_since = time.monotonic()
                    self._acked.append(record)
                    self.status.acked += 1
            elif kind == "message" and self.on_message is not None:
                self.on_message(event[1])
        # Acks are batched while a burst is in flight; once nothing is, the outbox hears at
        # once (a record a second must not show as waiting for the broker after its PUBACK).
        if len(self._acked) >= ACK_BATCH or (self._acked and (
                not self._inflight or time.monotonic() - self._acked_since >= ACK_BATCH_S)):
            self._forget_acked()
        return outcome

    def _forget_acked(self) -> None:
        if self._acked:
            self.outbox.delete(self._acked)
            self._acked = []

    def _refused(self, code: ReasonCode) -> None:
        hint = ""
        if str(code) in ("Bad user name or password", "Not authorized"):
            hint = " (check mqtt.username and mqtt.password_file)"
        message = f"the broker {self.status.broker} refused the connection: {code}{hint}"
        if message != self.status.last_error:
            logger.error("mqtt: %s; retrying", message)
        self._set_state("connecting", message)

    def _ack(self, mid: int, code: Any) -> Record | None:
        """The outbox record a PUBACK settles, or None (a direct message, or retry later)."""
        record = self._inflight.pop(mid, None)
        if record is None:
            return None
        value = getattr(code, "value", 0)
        if _reason_failed(code) and value in _RETRYABLE:
            self._replay_below = max(self._replay_below, record.id + 1)
            self._replay_cursor = min(self._replay_cursor, record.id - 1)
            return None
        if _reason_failed(code):
            self.status.rejected += 1
            logger.error("mqtt: the broker refused %s: %s; dropped", record.topic, code)
        return record

    def _on_accepted(self, client: mqtt.Client) -> None:
        session = self._candidate_session
        self.outbox.bump("session")  # now committed: the broker holds our Last Will
        ended, taken = self.sequence.session, self.sequence.begin(session)
        self.status.sessions_ended[ended] = taken
        self.status.session, self.status.last_error = session, None
        self.status.connects += 1
        self._set_state("connected")
        logger.info("mqtt: connected to %s, session %d", self.status.broker, session)
        self._announce(client)
        if self.subscriptions:
            # MQTT 5 keeps the retain flag as published, so a command sent retained is
            # recognised (and refused) even when it arrives live.
            options: Any = (SubscribeOptions(qos=1, retainAsPublished=True)
                            if self.settings.protocol == "5" else 1)
            client.subscribe([(pattern, options) for pattern in self.subscriptions])
        # Everything stored before this connect is the backlog: replayed, marked historical.
        self._forget_acked()
        backlog = self.outbox.last_id()
        self._live_cursor, self._replay_cursor, self._replay_below = backlog, 0, backlog + 1

    def _announce(self, client: mqtt.Client) -> None:
        """The retained state, birth and Home Assistant discovery of this session."""
        session = self.status.session
        client.publish(self.topic("state"), self._state_payload(self.health, session), qos=1,
                       retain=True)
        for topic, payload in self.announce(session):
            client.publish(topic, payload, qos=1, retain=True)

    def _pump(self, client: mqtt.Client) -> None:
        """Fill the in-flight window: direct messages, live records, then the replay."""
        if self._rebirth:
            self._rebirth = False
            self._announce(client)
        free = WINDOW - len(self._inflight)
        while free > 0 and self._direct:
            topic, payload, retain, properties = self._direct.popleft()
            client.publish(topic, payload, qos=1, retain=retain, properties=properties)
            free -= 1
        if free <= 0:
            return
        if self.outbox.last_id() > self._live_cursor:  # no query when nothing new was put
            for record in self.outbox.pending(self._live_cursor, free):
                self._send(client, record, record.payload)
                self._live_cursor = record.id
                free -= 1
        now = time.monotonic()
        rate = self.settings.replay_per_s
        self._replay_tokens = min(float(IN_FLIGHT), self._replay_tokens
                                  + (now - self._last_refill) * rate)
        self._last_refill = now
        allowed = min(free, int(self._replay_tokens))
        if allowed <= 0 or self._replay_cursor + 1 >= self._replay_below:
            return
        batch = self.outbox.pending(self._replay_cursor, allowed, self._replay_below)
        for record in batch:
            self._send(client, record, _as_historical(record.payload))
            self._replay_cursor = record.id
            self._replay_tokens -= 1
            self.status.replayed += 1
        if len(batch) < allowed:
            self._replay_cursor = self._replay_below - 1  # the backlog is all sent

    def _send(self, client: mqtt.Client, record: Record, payload: bytes) -> None:
        if len(payload) > self.settings.max_payload_bytes:
            self.status.rejected += 1
            logger.error("mqtt: %s record %d is %d bytes, above the %d limit; dropped",
                         record.topic, record.id, len(payload), self.settings.max_payload_bytes)
            self.outbox.delete([record])
            return
        info = client.publish(record.topic, payload, qos=1)
        self._inflight[info.mid] = record
        self.status.published += 1

    def _shut_down(self, client: mqtt.Client, sock: Any,
                   selector: selectors.BaseSelector) -> None:
        """Flush for a bounded time, then say ``stopped`` (the caller disconnects cleanly,
        so the broker drops the Last Will)."""
        self.outbox.flush()  # what was handed over last (the sampler has stopped) goes too
        deadline = time.monotonic() + self._flush_s
        while time.monotonic() < deadline and (
                self._inflight or self.outbox.last_id() > self._live_cursor
                or self._replay_cursor + 1 < self._replay_below):
            if not self._step(client, sock, selector, 0.05) or \
                    self._handle_events() == "gone":
                return
            self._pump(client)
        self._forget_acked()
        info = client.publish(self.topic("state"),
                              self._state_payload("stopped", self.status.session), qos=1,
                              retain=True)
        deadline = time.monotonic() + _STOP_ACK_S
        while not info.is_published() and time.monotonic() < deadline:
            if not self._step(client, sock, selector, 0.05):
                return
        self._handle_events()
        self._forget_acked()


def _cork(sock: Any, on: bool) -> None:
    """Hold a round's writes back and send them together when it ends (Linux's TCP_CORK):
    a burst of publishes becomes a few full segments instead of one each, which spares both
    ends per-segment work (in a burst of 3,000: a sixth less CPU per message here, a third
    less in Mosquitto), and nothing waits past the round, as it would for Nagle.  A no-op
    without a socket."""
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, int(on))


def _as_historical(payload: bytes) -> bytes:
    """The same record, marked as replayed (not live) for the subscriber."""
    try:
        document = json.loads(payload)
    except ValueError:
        return payload
    if isinstance(document, dict):
        document["historical"] = True
        return encode(document)
    return payload

