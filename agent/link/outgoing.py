"""What the link publishes besides the outbox (command replies, live-only messages) and the
faults it survives, counted per reason.

A reply to a validly signed command, and the node's own live messages, are ``must deliver``:
while the link is up they are never dropped.  Their queue has no bound of its own; instead
the link dispatches fewer incoming messages while it is long (``REPLY_HIGH``), which is the
only way it grows.  A reply to junk (unsigned, malformed, forged) is ``droppable``: it waits
in a short queue that drops its oldest, counted, so that a flood of forged messages can
neither grow memory nor crowd out an answer that matters.  A topic paho would refuse is
refused here, where the message is queued, never inside the link's pump.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from agent import protocol

logger = logging.getLogger("agent.link.mqtt")  # its lines are the link's

REPLY_HIGH = 200  # must-deliver messages waiting: above this the link dispatches fewer
DROPPABLE_MAX = 100  # junk replies waiting: beyond this the oldest is dropped
LOG_EVERY_S = 10.0  # per fault reason: one log line, then a count, not a line per message


class Faults:
    """Per-reason counts of what the link survived (shown in ``edge-agent status`` as
    ``link.faults``), logged at most once per ``LOG_EVERY_S`` per reason: a flood must not
    become a flood of log lines."""

    def __init__(self, counts: dict[str, int]) -> None:
        self.counts = counts
        self._lock = threading.Lock()
        self._logged: dict[str, tuple[float, int]] = {}  # reason -> (when, count then)

    def record(self, reason: str, message: str, *args: object, exc_info: bool = False) -> None:
        with self._lock:
            count = self.counts[reason] = self.counts.get(reason, 0) + 1
            now = time.monotonic()
            when, before = self._logged.get(reason, (float("-inf"), 0))
            if now - when < LOG_EVERY_S:
                return
            self._logged[reason] = (now, count)
        logger.error("mqtt: " + message + " [%s: %d so far, %d since the last line]",
                     *args, reason, count, count - before, exc_info=exc_info)


@dataclass(frozen=True)
class Message:
    topic: str
    payload: bytes
    retain: bool = False
    properties: Properties | None = None
    droppable: bool = False


class Outgoing:
    """The two queues, and which of their messages paho holds unacknowledged (by mid)."""

    def __init__(self, faults: Faults) -> None:
        self.faults = faults
        self._must: deque[Message] = deque()
        self._droppable: deque[Message] = deque()
        self._lock = threading.Lock()  # put() runs on the controller's threads too
        self._sent: dict[int, Message] = {}

    def put(self, message: Message) -> bool:
        """Queue ``message``; False (dropped, counted) when its topic cannot be published."""
        problem = protocol.topic_problem(message.topic)
        if problem is not None:
            self.faults.record("unpublishable_topic", "not publishing to %s: %s; dropped",
                               ascii(message.topic)[:120], problem)
            return False
        with self._lock:
            if not message.droppable:
                self._must.append(message)
                return True
            if len(self._droppable) >= DROPPABLE_MAX:
                dropped = self._droppable.popleft()
                self.faults.record("junk_reply_dropped", "too many replies to junk waiting; "
                                   "dropped the oldest (to %s)", ascii(dropped.topic)[:120])
            self._droppable.append(message)
        return True

    def reply(self, topic: str, body: bytes, droppable: bool, response_topic: str | None,
              correlation: bytes | None) -> None:
        """A reply on ``topic``, and to ``response_topic`` (MQTT 5) with its correlation
        data when given; one that cannot be published to is skipped, counted."""
        self.put(Message(topic, body, droppable=droppable))
        if response_topic is None:
            return
        properties: Properties | None = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
        try:
            if correlation is not None:
                properties.CorrelationData = correlation  # type: ignore[union-attr]
        except (TypeError, ValueError) as error:  # paho checks its type and size
            self.faults.record("bad_correlation", "reply to %s: correlation data dropped: %s",
                               ascii(response_topic)[:120], error)
            properties = None
        self.put(Message(response_topic, body, properties=properties, droppable=droppable))

    @property
    def waiting(self) -> int:
        """Must-deliver messages not yet handed to paho: the link's backpressure signal."""
        return len(self._must)

    @property
    def in_flight(self) -> int:
        return len(self._sent)

    def take(self) -> Message | None:
        """The next message to hand to paho: must-deliver ones first."""
        with self._lock:
            if self._must:
                return self._must.popleft()
            return self._droppable.popleft() if self._droppable else None

    def handed(self, mid: int, message: Message) -> None:
        self._sent[mid] = message

    def acknowledged(self, mid: int) -> bool:
        """A PUBACK for one of these (True), or for an outbox record (False)."""
        return self._sent.pop(mid, None) is not None

    def connection_lost(self) -> None:
        """A new connection: the must-deliver replies paho held unacknowledged go again,
        first and in order (a duplicate is possible, a loss is not); retained state
        messages do not (the connect announces the current state)."""
        again = [m for m in self._sent.values() if not m.droppable and not m.retain]
        self._sent = {}
        with self._lock:
            self._must.extendleft(reversed(again))
