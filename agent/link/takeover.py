"""Another client with this node's client id: diagnosed, reported and backed off from.

A broker lets one connection hold a client id: a second client with the same id takes the
session and the first is disconnected (MQTT 5 says so with reason 0x8E "Session taken over";
a 3.1.1 broker just closes the connection).  Two agents with one node id (a card cloned with
its config or machine id) would otherwise knock each other off in a loop, reconnecting at
once each time, and nothing would say why.  ``Takeover`` weighs how each accepted connection
ends: 0x8E, or the broker closing it within ``SHORT_S`` of the accept (paho's "Unspecified
error": no keepalive timeout, no error of ours), is evidence; ``REPEATS`` of them within
``WINDOW_S`` is the diagnosis: one log line, a ``degraded`` reason naming the node id, and
reconnect delays that grow to ``BACKOFF_MAX_S`` with each further connection that does not
hold.  A connection that holds ``HOLD_S`` (longer than the other client's longest wait)
clears it.  Mosquitto 2.0.11 (Debian 12) sends no 0x8E, not even to MQTT 5 clients: the other
client's connects then end ours after as long as that client waits, so ``SHORT_S`` spans the
first delays of a diagnosed client, and the one that holds is diagnosed too.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from agent.link.settings import LinkStatus, backoff_delay

logger = logging.getLogger(__name__)

SESSION_TAKEN_OVER = 0x8E
CLOSED = 0x80  # paho's reason for a connection the far end closed
SHORT_S = 60.0  # a connection the broker ends this soon after accepting it
REPEATS = 3
WINDOW_S = 120.0
BACKOFF_MIN_S = 10.0
BACKOFF_MAX_S = 300.0
HOLD_S = 2 * BACKOFF_MAX_S


def taken_over(reason: object) -> bool:
    """Whether a disconnect's reason (paho's ReasonCode, or a string) is 0x8E."""
    return getattr(reason, "value", None) == SESSION_TAKEN_OVER


def closed_by_broker(reason: object) -> bool:
    return getattr(reason, "value", None) == CLOSED


class Takeover:
    """One link's diagnosis (see the module); ``ended`` is called from the link thread,
    ``problems`` from any."""

    def __init__(self, client_id: str, status: LinkStatus,
                 clock: Callable[[], float] = time.time) -> None:
        self.client_id, self.status, self.clock = client_id, status, clock
        self._evidence: deque[float] = deque(maxlen=REPEATS)
        self._counted = -1  # the session whose end was weighed (the end is reported twice)
        self.diagnosis: str | None = None
        self.strikes = 0  # connections that did not hold since the diagnosis

    def ended(self, reason: object) -> None:
        """The broker connection ended (each ``gone``): weigh it once (the link logs the
        loss); an end before any accept is no evidence."""
        if self.status.state != "connected" or self._counted == self.status.session:
            return
        self._counted = self.status.session
        now = self.clock()
        held = now - self.status.since
        if held >= HOLD_S:
            self._clear(held)
        elif self.diagnosis is not None:
            self.strikes += 1
        elif taken_over(reason) or (closed_by_broker(reason) and held < SHORT_S):
            self._evidence.append(now)
            if len(self._evidence) == REPEATS and now - self._evidence[0] <= WINDOW_S:
                self._diagnose(taken_over(reason))

    def _diagnose(self, said: bool) -> None:
        how = ("the broker said another client took the session (0x8E)" if said else
               "the broker closed the connection right after accepting it")
        self.diagnosis = (f"mqtt: another client uses this node's id {self.client_id!r} on "
                          f"{self.status.broker}: {how}, {REPEATS} times within "
                          f"{WINDOW_S:.0f} s; likely a cloned image: give each device its own "
                          "node_id in agent.yaml")
        logger.error("%s; reconnecting after growing delays (up to %.0f s) instead of taking "
                     "the session back at once", self.diagnosis, BACKOFF_MAX_S)

    def _clear(self, held: float) -> None:
        self._evidence.clear()
        if self.diagnosis is not None:
            logger.info("mqtt: a connection held %.0f s: no other client took this node's "
                        "id %r", held, self.client_id)
        self.diagnosis, self.strikes = None, 0

    def delay(self, normal: float) -> float:
        """The wait before the next connect: ``normal`` (the link's backoff), or longer while
        diagnosed, growing with each connection that did not hold."""
        if self.diagnosis is None:
            return normal
        return max(normal, backoff_delay(self.strikes, BACKOFF_MIN_S, BACKOFF_MAX_S))

    def problems(self) -> list[str]:
        """The diagnosis, until a connection holds ``HOLD_S``."""
        diagnosis, status = self.diagnosis, self.status
        if diagnosis is None or (status.state == "connected"
                                 and self.clock() - status.since >= HOLD_S):
            return []
        return [diagnosis]
