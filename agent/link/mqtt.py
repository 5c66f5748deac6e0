"""The MQTT link: one thread owns the paho client, the connection and all publishing.

The thread runs paho's network steps itself over an epoll selector (no second thread, no
``select()`` limit of 1024 descriptors); paho's callbacks only append to a queue it drains.
Every connect uses a fresh client and paho never reconnects by itself, so it never re-sends
a message from memory: the outbox is the one source of truth.  Records the broker acknowledges
leave the outbox; those queued before a connect are replayed oldest-first, rate-limited and
marked ``historical``, while live records go first.  The retained ``state`` and ``birth`` are
published on every connect, and the Last Will says ``offline`` with the connect's session;
each connect goes to a member of the broker list that ``failover.Failover`` chooses.

No message stops the thread: what the handler (the controller) raises is caught and counted
per reason (``status.faults``); a publish paho refuses drops that message.  Incoming messages
wait in a bounded inbox, each at most ``max_incoming_bytes`` (``client.BoundedClient``),
dispatched a batch a round and fewer while replies wait (replies are never dropped, a flood
cannot grow memory).  A thread that dies anyway leaves the state ``dead``, its cause in
``died``, for the service to ``restart``.  ``status.subscribed``: the broker confirmed the
subscriptions (on a broker list, a ``probe.DeliveryProbe`` checks they deliver).
"""

from __future__ import annotations

import logging
import selectors
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import paho.mqtt.client as mqtt

from agent import protocol
from agent.link.client import connect, new_client, subscribe
from agent.link.delivery import WINDOW, Delivery, reason_failed
from agent.link.failover import EventSink, Failover
from agent.link.outgoing import REPLY_HIGH, Faults, Message, Outgoing
from agent.link.probe import PROBE, DeliveryProbe
from agent.link.settings import LinkSettings, LinkStatus
from agent.link.sockets import Waker, close_now, cork, watch
from agent.link.takeover import Takeover
from agent.telemetry.outbox import Outbox
from agent.telemetry.records import Sequence, encode, stamp

logger = logging.getLogger(__name__)

_STOP_ACK_S = 2.0
INBOX_HIGH = 500  # incoming messages read but not dispatched: above this, stop reading
DISPATCH_PER_ROUND = 50  # between two rounds of network I/O: replies go out during a burst


class MqttLink:
    """Connects, reconnects, publishes the outbox and the retained state; see the module."""

    def __init__(self, settings: LinkSettings, outbox: Outbox, sequence: Sequence,
                 announce: Callable[[int], list[tuple[str, bytes]]],
                 on_message: Callable[[mqtt.MQTTMessage], None] | None = None,
                 subscriptions: tuple[str, ...] = (), event: EventSink | None = None) -> None:
        self.settings, self.outbox, self.sequence = settings, outbox, sequence
        self.announce, self.on_message, self.subscriptions = announce, on_message, subscriptions
        self.health = "online"  # or "degraded", with the reason
        self.health_reason: str | None = None
        self.status = LinkStatus()
        self._failover = Failover(settings, self.status, event)  # names status.broker
        self.takeover = Takeover(settings.client_id, self.status)  # another client, our id
        self._probe = DeliveryProbe(self.topic(protocol.command_suffix(PROBE)), settings)
        self._stop, self._waker = threading.Event(), Waker()
        self.faults = Faults(self.status.faults)
        self._outgoing = Outgoing(self.faults)  # live-only: replies, state changes
        self._rebirth = False
        self._events: deque[tuple[Any, ...]] = deque()  # appended by paho's callbacks only
        self._inbox: deque[mqtt.MQTTMessage] = deque()  # likewise: messages to dispatch
        self._thread: threading.Thread | None = None
        self._client: mqtt.Client | None = None
        self.died: str | None = None  # why the thread last ended abnormally
        self._flush_s, self._candidate_session, self._oversized = 0.0, 0, False
        self._delivery = Delivery(settings, outbox, self.status)

    # -- API for other threads --------------------------------------------------------------

    def start(self) -> None:
        self.outbox.listen(self.wake)  # new records on disk: publish them
        self._spawn()

    def restart(self) -> bool:
        """Start the thread again after it died (it sends what was queued); else False."""
        if self._thread is None or self._thread.is_alive() or self._stop.is_set():
            return False
        self.status.restarts += 1
        self._spawn()
        return True

    def problems(self) -> list[str]:
        """Why the link does not work although the agent runs (empty when it does)."""
        if self.status.state == "dead":
            return [f"mqtt: the link thread died ({self.died}); nothing is published"]
        return self.takeover.problems()

    def _spawn(self) -> None:
        self._thread = threading.Thread(target=self._main, name="mqtt-link", daemon=True)
        self._thread.start()

    def stop(self, flush_s: float = 2.0, timeout: float = 15.0) -> None:
        """Flush the outbox for up to ``flush_s``, publish ``stopped``, disconnect cleanly."""
        self._flush_s = flush_s
        self.outbox.unlisten(self.wake)
        self._stop.set()
        self.wake()
        if self._thread is not None:
            self._thread.join(timeout)
        self._waker.close()

    def wake(self) -> None:
        """Tell the link thread there is something to publish (safe from any thread)."""
        self._waker.wake()

    def publish_now(self, suffix: str, payload: dict[str, Any], retain: bool = False) -> None:
        """A message that is only worth sending live: not kept on disk."""
        self._outgoing.put(Message(self.topic(suffix), encode(payload), retain))
        self.wake()

    def publish_reply(self, topic: str, payload: dict[str, Any], response_topic: str | None,
                      correlation: bytes | None, droppable: bool = False) -> None:
        """A command reply on ``topic`` (and under MQTT 5 the request's response topic, with
        its correlation data); never dropped while the link is up, unless ``droppable`` (a
        reply to junk) and too many wait; a bad response topic is skipped (counted)."""
        self._outgoing.reply(topic, encode(payload), droppable,
                             response_topic if self.settings.protocol == "5" else None,
                             correlation)
        self.wake()

    def rebirth(self) -> None:
        """Publish state, birth and the other announcements again, as on a connect."""
        self._rebirth = True
        self.wake()

    def set_health(self, state: str, reason: str | None = None) -> None:
        """``online`` or ``degraded`` (with why): the retained state changes at once."""
        self.health, self.health_reason = state, reason
        if self.status.state == "connected":
            payload = self._state_payload(state, self.status.session)
            self._outgoing.put(Message(self.topic(protocol.STATE), payload, self.settings.retain))
            self.wake()

    def topic(self, suffix: str) -> str:
        return protocol.topic(self.settings.topic_root, suffix)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _main(self) -> None:
        try:
            self._run()
        except Exception as error:  # a bug: the service sees ``dead`` and restarts it
            self.died = f"{type(error).__name__}: {error}"[:300]
            self.faults.record("thread_died", "the link thread died: %s", self.died,
                               exc_info=True)
            if self._client is not None:  # no DISCONNECT: the broker says ``offline`` now
                close_now(self._client.socket())
            self.status.subscribed = False
            self._set_state("dead", f"the link thread died: {self.died}")

    def _run(self) -> None:
        while (member := self._failover.wait(self._stop, self.status.beat, lambda normal: (
                self._probe.delay(self.takeover.delay(normal))))) is not None:
            client = self._client = self._connect(member.host, member.port)
            accepted = False
            if client is not None:
                accepted = self._serve(client)
                sock = client.socket()
                client.disconnect()  # written at once (no paho thread); no-op when gone
                cork(sock, False)  # and sent now
                if self._stop.is_set():
                    break
            # a connection that ended on an oversized packet (resent): its member backs off
            self._failover.ended(accepted and not (self._oversized or self._probe.broken),
                                 self.status.last_error)
            self._set_state("disconnected")
        self._set_state("stopped")

    def _set_state(self, state: str, error: str | None = None) -> None:
        if state != self.status.state:
            self.status.state, self.status.since = state, time.time()
        if error is not None:
            self.status.last_error = error

    def _state_payload(self, state: str, session: int) -> bytes:
        reason = {"reason": self.health_reason} if state == "degraded" else {}
        return encode(stamp("state/1", state=state, session=session, broker=self.status.broker,
                            node_id=self.settings.client_id, **reason))

    def _connect(self, host: str, port: int) -> mqtt.Client | None:
        """A fresh client with its Last Will, TCP/TLS connected and CONNECT sent."""
        self._set_state("connecting")
        # The LWT must name the session before the broker knows it; it is committed only
        # when the broker accepts the connection.
        self._candidate_session, self._oversized = self.outbox.counter("session") + 1, False
        self._events.clear()
        try:
            client = new_client(self.settings, self.topic(protocol.STATE),
                                self._state_payload("offline", self._candidate_session),
                                self._events, self._inbox,
                                self._probe.client_id(self.settings.client_id))
            connect(client, self.settings, host, port)
        except (OSError, ValueError) as error:
            self._set_state("connecting", self._failover.unreachable(error,
                                                                     self.status.last_error))
            return None
        return client

    def _serve(self, client: mqtt.Client) -> bool:
        """Run one connection until it ends or the agent stops (then flush and say
        ``stopped`` on it); True once it was accepted."""
        accepted = False
        self._delivery.reset()
        self._outgoing.connection_lost()
        sock = client.socket()
        if sock is None:
            return False
        with selectors.DefaultSelector() as selector:
            selector.register(self._waker.reader, selectors.EVENT_READ)
            selector.register(sock, selectors.EVENT_READ)
            while not (self._stop.is_set() and accepted):
                wait = 0.0 if self._inbox else self._delivery.wait_s(accepted)
                if not self._step(client, sock, selector, wait,
                                  read=len(self._inbox) < INBOX_HIGH):
                    self._events.append(("gone", "socket closed", None))
                outcome = self._handle_events()
                if outcome == "accepted":
                    accepted = True
                    self._on_accepted(client)
                elif outcome in ("refused", "gone") or (self._stop.is_set() and not accepted):
                    return accepted
                if accepted:
                    if broken := self._probe.failed(self.status.broker, client, self._inbox):
                        self.status.subscribed, self.status.last_error = False, broken  # in order
                        return accepted
                    self._dispatch()
                    self._pump(client)
            self._shut_down(client, sock, selector)
        return accepted

    def _step(self, client: mqtt.Client, sock: Any, selector: selectors.BaseSelector,
              timeout: float, read: bool = True) -> bool:
        """One round of network I/O (not reading while ``read`` is False: the inbox is
        full); False once paho has closed the socket or failed on it."""
        current: Any = client.socket()
        if current is not sock:
            return False
        wanted = (selectors.EVENT_READ if read else 0) | (
            selectors.EVENT_WRITE if client.want_write() else 0)
        watch(selector, sock, wanted)
        cork(sock, False)  # what the last round wrote leaves before this one waits
        events = selector.select(timeout)
        cork(sock, True)  # this round's writes go out together, in full segments
        try:
            for key, mask in events:
                if key.fileobj is self._waker.reader:
                    self._waker.drain()
                    continue
                if mask & selectors.EVENT_READ:
                    client.loop_read()
                if mask & selectors.EVENT_WRITE and client.socket() is sock:
                    client.loop_write()
            if client.socket() is sock:
                client.loop_misc()  # keepalive pings
        except Exception as error:  # paho choked on what arrived: a new connection
            self.faults.record("network_error", "paho failed on the connection: %r; "
                               "reconnecting", error, exc_info=True)
            return False
        finally:
            self.status.beat()
        return client.socket() is sock

    def _dispatch(self) -> None:
        """A batch of incoming messages to the handler; while replies wait, none until the
        inbox is full (the socket is still read: PUBACKs come in, replies drain)."""
        budget = DISPATCH_PER_ROUND
        if self._outgoing.waiting >= REPLY_HIGH:
            budget = 1 if len(self._inbox) >= INBOX_HIGH else 0
        while budget > 0 and self._inbox:
            budget -= 1
            message = self._inbox.popleft()
            if self.on_message is None or self._probe.take(message):
                continue
            try:
                self.on_message(message)
            except Exception as error:
                self.faults.record("handler_error", "handling a message failed: %s: %s; "
                                   "the link goes on", type(error).__name__,
                                   str(error)[:200], exc_info=True)

    def _handle_events(self) -> str | None:
        outcome = None
        while self._events:
            event = self._events.popleft()
            kind = event[0]
            if kind == "connack":
                if reason_failed(event[1]):
                    self._set_state("connecting", self._failover.refused(
                        event[1], event[2], self.status.last_error))
                    outcome = "refused"
                else:
                    outcome = "accepted"
            elif kind == "oversized":  # the connection ends: "gone" follows
                self.faults.record("oversized_packet", "%s; connecting again", event[1])
                self.status.last_error, self._oversized = event[1], True
            elif kind == "suback":  # commands sent from now on reach this node, unless refused
                if why := self._probe.acknowledged(self._client, self.status.broker,
                                                   self.subscriptions, event[1]):
                    self.status.last_error = why
                    outcome = "refused" if self._probe.broken else outcome
                self.status.subscribed = why is None
            elif kind == "gone":
                self._delivery.forget_acked()
                self.status.subscribed = False
                if self.status.state == "connected" and outcome != "gone":  # paho's, then ours
                    self.status.last_error = f"connection to {self.status.broker} lost " \
                                             f"({event[1]})"
                    logger.warning("mqtt: %s", self.status.last_error)
                self.takeover.ended(event[1])  # weighs it (takeover.py)
                self._failover.redirect(event[1], event[2])
                outcome = outcome if outcome == "refused" else "gone"
            elif kind == "ack" and not self._outgoing.acknowledged(event[1]):
                self._delivery.acknowledged(event[1], event[2])
        self._delivery.settle()
        return outcome

    def _on_accepted(self, client: mqtt.Client) -> None:
        session = self._candidate_session
        self.outbox.bump("session")  # now committed: the broker holds our Last Will
        # the backlog (everything stored before this connect: replayed, marked historical) is
        # marked as the session changes, so no record of either session lands on the wrong side
        ended, taken = self.sequence.session, self.sequence.begin(session, self._delivery.begin)
        self.status.sessions_ended[ended] = taken
        self.status.session, self.status.last_error = session, None
        self.status.connects, self.status.subscribed = self.status.connects + 1, False
        self._set_state("connected")
        logger.info("mqtt: connected to %s, session %d", self.status.broker, session)
        self._failover.accepted()  # a failover's event goes out in the new session
        self._probe.reset()
        if self.subscriptions:  # before the birth: an operator that sees it may resend at once
            subscribe(client, self.settings, self.subscriptions)
        self._announce(client)

    def _announce(self, client: mqtt.Client) -> None:
        """The retained state, birth and Home Assistant discovery of this session."""
        session = self.status.session
        client.publish(self.topic(protocol.STATE), self._state_payload(self.health, session),
                       qos=1, retain=self.settings.retain)
        for topic, payload in self.announce(session):
            client.publish(topic, payload, qos=1, retain=self.settings.retain)

    def _pump(self, client: mqtt.Client) -> None:
        """Fill the in-flight window: direct messages, live records, then the replay."""
        if self._rebirth:
            self._rebirth = False
            self._announce(client)
        free = WINDOW - len(self._delivery.inflight) - self._outgoing.in_flight
        while free > 0:
            message = self._outgoing.take()
            if message is None:
                break
            try:
                info = client.publish(message.topic, message.payload, qos=1,
                                      retain=message.retain, properties=message.properties)
            except (ValueError, TypeError) as error:  # refused by paho: this message only
                self.faults.record("publish_refused", "paho refused a message to %s: %s; "
                                   "dropped", ascii(message.topic)[:120], error)
                continue
            self._outgoing.handed(info.mid, message)
            free -= 1
        if free <= 0:
            return
        self._delivery.fill(client, free)

    def _shut_down(self, client: mqtt.Client, sock: Any,
                   selector: selectors.BaseSelector) -> None:
        """Flush for a bounded time, then say ``stopped`` (the caller disconnects cleanly,
        so the broker drops the Last Will)."""
        self.outbox.flush()  # what was handed over last (the sampler has stopped) goes too
        deadline = time.monotonic() + self._flush_s
        while time.monotonic() < deadline and self._delivery.pending:
            if not self._step(client, sock, selector, 0.05) or \
                    self._handle_events() == "gone":
                return
            self._pump(client)
        self._delivery.forget_acked()
        info = client.publish(self.topic(protocol.STATE),
                              self._state_payload("stopped", self.status.session), qos=1,
                              retain=self.settings.retain)
        deadline = time.monotonic() + _STOP_ACK_S
        while not info.is_published() and time.monotonic() < deadline:
            if not self._step(client, sock, selector, 0.05):
                return
        self._handle_events()
        self._delivery.forget_acked()


