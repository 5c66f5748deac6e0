"""The MQTT link: one thread owns the paho client, the connection and all publishing.

paho's callbacks only append to a list the thread drains; nothing else touches the client.
Every connect uses a fresh client, so paho never re-sends a message from memory: the outbox
is the one source of truth.  Records acknowledged by the broker (PUBACK) leave the outbox;
whatever was queued before a connect is replayed oldest-first, rate-limited and marked
``historical``, while live records go first.  The retained ``state`` and ``birth`` are
published on every connect, and the Last Will says ``offline`` with the connect's session.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion
from paho.mqtt.reasoncodes import ReasonCode

from agent.telemetry.outbox import Outbox, Record
from agent.telemetry.records import Sequence, encode, stamp

logger = logging.getLogger(__name__)

WINDOW = 20  # messages in flight, as paho's own default (and Mosquitto's receive maximum)
_RETRYABLE = {0x89, 0x97}  # server busy, quota exceeded: the message may go later
_STOP_ACK_S = 2.0


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

    def to_dict(self) -> dict[str, Any]:
        fields = dict(self.__dict__)
        del fields["sessions_ended"]
        return fields


def backoff_delay(attempt: int, low: float, high: float) -> float:
    """Exponential backoff with equal jitter: a fleet reconnecting after a broker restart
    spreads out instead of arriving in one wave."""
    ceiling = min(high, low * 2.0 ** min(attempt, 30))
    return float(ceiling / 2 + random.uniform(0, ceiling / 2))


def _reason_failed(code: Any) -> bool:
    return bool(getattr(code, "is_failure", False))


class MqttLink:
    """Connects, reconnects, publishes the outbox and the retained state; see the module."""

    def __init__(self, settings: LinkSettings, outbox: Outbox, sequence: Sequence,
                 birth: Callable[[int], dict[str, Any]],
                 on_message: Callable[[mqtt.MQTTMessage], None] | None = None,
                 subscriptions: tuple[str, ...] = ()) -> None:
        self.settings, self.outbox, self.sequence = settings, outbox, sequence
        self.birth, self.on_message, self.subscriptions = birth, on_message, subscriptions
        self.status = LinkStatus(broker=f"{settings.host}:{settings.port}")
        self._stop = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._direct: deque[tuple[str, bytes, bool]] = deque(maxlen=1000)
        self._events: list[tuple[Any, ...]] = []  # filled by paho callbacks only
        self._thread: threading.Thread | None = None
        self._flush_s = 0.0
        self._candidate_session = 0
        # per connection: records in flight by mid, and the two cursors into the outbox
        self._inflight: dict[int, Record] = {}
        self._live_cursor = self._replay_cursor = 0
        self._replay_below = 1
        self._replay_tokens = 0.0
        self._last_refill = time.monotonic()

    # -- API for other threads --------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="mqtt-link", daemon=True)
        self._thread.start()

    def stop(self, flush_s: float = 2.0, timeout: float = 15.0) -> None:
        """Flush the outbox for up to ``flush_s``, publish ``stopped``, disconnect cleanly."""
        self._flush_s = flush_s
        self._stop.set()
        self.wake()
        if self._thread is not None:
            self._thread.join(timeout)
        self._wake_r.close()
        self._wake_w.close()

    def wake(self) -> None:
        """Tell the link thread there is something to publish (safe from any thread)."""
        with contextlib.suppress(OSError):  # already awake (buffer full), or closed
            self._wake_w.send(b"\0")

    def publish_now(self, suffix: str, payload: dict[str, Any], retain: bool = False) -> None:
        """A message that is only worth sending live (command replies): not kept on disk."""
        self._direct.append((self.topic(suffix), encode(payload), retain))
        self.wake()

    def topic(self, suffix: str) -> str:
        return f"{self.settings.topic_root}/{suffix}"

    # -- the thread -------------------------------------------------------------------------

    def _run(self) -> None:
        attempt = 0
        while not self._stop.is_set():
            client = self._connect()
            if client is not None:
                if self._serve(client):
                    attempt = 0
                if self._stop.is_set():
                    self._shut_down(client)
                    break
            delay = backoff_delay(attempt, self.settings.reconnect_min_s,
                                  self.settings.reconnect_max_s)
            attempt += 1
            self._set_state("disconnected")
            self._stop.wait(delay)
        self._set_state("stopped")

    def _set_state(self, state: str, error: str | None = None) -> None:
        if state != self.status.state:
            self.status.state, self.status.since = state, time.time()
        if error is not None:
            self.status.last_error = error

    def _state_payload(self, state: str, session: int) -> bytes:
        return encode(stamp("state/1", state=state, session=session,
                            node_id=self.settings.client_id))

    def _new_client(self, session: int) -> mqtt.Client:
        s = self.settings
        version = (MQTTProtocolVersion.MQTTv5 if s.protocol == "5"
                   else MQTTProtocolVersion.MQTTv311)
        client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=s.client_id,
                             protocol=version,
                             clean_session=None if version == MQTTProtocolVersion.MQTTv5
                             else True)
        client.max_inflight_messages_set(WINDOW)
        client.connect_timeout = 5.0
        client.will_set(self.topic("state"), self._state_payload("offline", session), qos=1,
                        retain=True)
        if s.tls:
            client.tls_set(ca_certs=s.tls_ca, certfile=s.tls_cert, keyfile=s.tls_key)
        if s.username is not None:
            client.username_pw_set(s.username, self._password())
        events = self._events
        client.on_connect = lambda c, u, flags, code, props: events.append(("connack", code))
        client.on_disconnect = lambda c, u, flags, code, props: events.append(("gone", code))
        client.on_publish = lambda c, u, mid, code, props: events.append(("ack", mid, code))
        client.on_message = lambda c, u, message: events.append(("message", message))
        return client

    def _password(self) -> str | None:
        """Read on every connect, so a rotated password file is picked up."""
        if self.settings.password_file is None:
            return None
        with open(self.settings.password_file) as handle:
            return handle.read().rstrip("\n")

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
        except (OSError, ValueError) as error:
            message = f"cannot reach the broker {self.status.broker}: {error}"
            if message != self.status.last_error:
                logger.warning("mqtt: %s; retrying", message)
            self._set_state("connecting", message)
            return None
        return client

    def _serve(self, client: mqtt.Client) -> bool:
        """Run one connection until it ends or the agent stops; True once it was accepted."""
        sock = client.socket()
        accepted = False
        self._inflight = {}
        self._live_cursor = self._replay_cursor = 0
        self._replay_below = 1
        while sock is not None and client.socket() is sock:
            if self._stop.is_set() and accepted:
                return accepted
            writers = [sock] if client.want_write() else []
            readable, writable, _ = select.select([sock, self._wake_r], writers, [],
                                                  self._wait_s(accepted))
            if self._wake_r in readable:
                self._drain_wake()
            if sock in readable:
                client.loop_read()
            if writable and client.socket() is not None:
                client.loop_write()
            client.loop_misc()
            outcome = self._handle_events(client)
            if outcome == "accepted":
                accepted = True
                self._on_accepted(client)
            elif outcome in ("refused", "gone"):
                return accepted
            if accepted:
                self._pump(client)
        return accepted

    def _wait_s(self, accepted: bool) -> float:
        if accepted and self._replay_below > self._replay_cursor + 1:
            return min(1.0, max(0.001, 1.0 / self.settings.replay_per_s))
        return 1.0

    def _drain_wake(self) -> None:
        with contextlib.suppress(OSError):  # BlockingIOError: drained
            while self._wake_r.recv(4096):
                pass

    def _handle_events(self, client: mqtt.Client) -> str | None:
        outcome = None
        events = self._events[:]
        self._events.clear()
        acked: list[int] = []
        for event in events:
            kind = event[0]
            if kind == "connack":
                if _reason_failed(event[1]):
                    self._refused(event[1])
                    outcome = "refused"
                else:
                    outcome = "accepted"
            elif kind == "gone":
                if self.status.state == "connected":
                    logger.warning("mqtt: connection to %s lost (%s)", self.status.broker,
                                   event[1])
                outcome = outcome if outcome == "refused" else "gone"
            elif kind == "ack":
                record = self._ack(event[1], event[2])
                if record is not None:
                    acked.append(record)
            elif kind == "message" and self.on_message is not None:
                self.on_message(event[1])
        if acked:
            self.outbox.delete(acked)
            self.status.acked += len(acked)
        return outcome

    def _refused(self, code: ReasonCode) -> None:
        hint = ""
        if str(code) in ("Bad user name or password", "Not authorized"):
            hint = " (check mqtt.username and mqtt.password_file)"
        message = f"the broker {self.status.broker} refused the connection: {code}{hint}"
        if message != self.status.last_error:
            logger.error("mqtt: %s; retrying", message)
        self._set_state("connecting", message)

    def _ack(self, mid: int, code: Any) -> int | None:
        """The outbox id a PUBACK settles, or None (a direct message, or retry later)."""
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
        return record.id

    def _on_accepted(self, client: mqtt.Client) -> None:
        session = self._candidate_session
        self.outbox.bump("session")  # now committed: the broker holds our Last Will
        ended, taken = self.sequence.session, self.sequence.begin(session)
        self.status.sessions_ended[ended] = taken
        self.status.session, self.status.last_error = session, None
        self.status.connects += 1
        self._set_state("connected")
        logger.info("mqtt: connected to %s, session %d", self.status.broker, session)
        client.publish(self.topic("state"), self._state_payload("online", session), qos=1,
                       retain=True)
        client.publish(self.topic("birth"), encode(self.birth(session)), qos=1, retain=True)
        for pattern in self.subscriptions:
            client.subscribe(pattern, qos=1)
        # Everything stored before this connect is the backlog: replayed, marked historical.
        backlog = self.outbox.last_id()
        self._live_cursor, self._replay_cursor, self._replay_below = backlog, 0, backlog + 1

    def _pump(self, client: mqtt.Client) -> None:
        """Fill the in-flight window: direct messages, live records, then the replay."""
        free = WINDOW - len(self._inflight)
        while free > 0 and self._direct:
            topic, payload, retain = self._direct.popleft()
            client.publish(topic, payload, qos=1, retain=retain)
            free -= 1
        if free <= 0:
            return
        for record in self.outbox.pending(self._live_cursor, free):
            self._send(client, record, record.payload)
            self._live_cursor = record.id
            free -= 1
        now = time.monotonic()
        rate = self.settings.replay_per_s
        self._replay_tokens = min(float(WINDOW), self._replay_tokens
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
            self.outbox.delete([record.id])
            return
        info = client.publish(record.topic, payload, qos=1)
        self._inflight[info.mid] = record
        self.status.published += 1

    def _shut_down(self, client: mqtt.Client) -> None:
        """Flush for a bounded time, say ``stopped``, then a clean DISCONNECT (no LWT)."""
        deadline = time.monotonic() + self._flush_s
        sock = client.socket()
        while sock is not None and time.monotonic() < deadline and (
                self._inflight or self.outbox.pending(self._live_cursor, 1)
                or self._replay_cursor + 1 < self._replay_below):
            self._step(client, sock)
            if self._handle_events(client) == "gone":
                return
            self._pump(client)
        info = client.publish(self.topic("state"),
                              self._state_payload("stopped", self.status.session), qos=1,
                              retain=True)
        deadline = time.monotonic() + _STOP_ACK_S
        while sock is not None and not info.is_published() and time.monotonic() < deadline:
            self._step(client, sock)
            if self._handle_events(client) == "gone":
                return
        client.disconnect()  # paho writes the DISCONNECT at once: no thread of its own
        self.status.state = "stopped"

    def _step(self, client: mqtt.Client, sock: Any) -> None:
        writers = [sock] if client.want_write() else []
        readable, writable, _ = select.select([sock], writers, [], 0.05)
        if readable:
            client.loop_read()
        if writable and client.socket() is not None:
            client.loop_write()


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

