"""How the link moves between the members of its broker list (``brokers.Brokers``): it waits
out the backoff, says why a connect failed, follows or refuses a redirect, and reports each
move to another member: a log line, ``status.failovers`` and a ``broker_failover`` event
with the reason it left the member it was on.

Nothing else changes with the member: the outbox, ``session`` and ``seq`` are the node's,
so a failover is a reconnect, which replays what the old member did not acknowledge; the
connect announces state and birth (naming ``broker``) on the new member with its Last Will.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from agent.link.brokers import REDIRECTS, Brokers, Member, parse_member
from agent.link.settings import LinkSettings, LinkStatus

logger = logging.getLogger("agent.link.mqtt")  # its lines are the link's

EventSink = Callable[..., None]  # (kind, **fields): the service's ``event``


class Failover:
    def __init__(self, settings: LinkSettings, status: LinkStatus,
                 event: EventSink | None = None) -> None:
        listed = [parse_member(text) for text in settings.brokers]
        members = [member for member in listed if member is not None]
        if len(members) != len(listed):
            raise ValueError(f"not host:port: {settings.brokers}")
        self.brokers = Brokers(members or [(settings.host, settings.port)], settings.client_id,
                               settings.reconnect_min_s, settings.reconnect_max_s)
        self.status, self._event = status, event
        self.member = self._home = self.brokers.members[0]  # the one it is on or tries first
        self._why: str | None = None  # why it left _home
        self._refusal: str | None = None  # the last redirect not followed: logged once
        status.broker, status.brokers = str(self.member), [str(m) for m in self.brokers.members]

    def wait(self, stop: threading.Event, beat: Callable[[], None],
             stretch: Callable[[float], float] = float) -> Member | None:
        """The member to connect to, after its backoff (None: the agent stops meanwhile);
        ``stretch``: the backoff as something else needs it (a diagnosed takeover)."""
        member, delay = self.brokers.next()
        delay = stretch(delay)
        until = time.monotonic() + delay
        while time.monotonic() < until:
            if stop.wait(max(0.0, min(1.0, until - time.monotonic()))):
                return None
            beat()  # waiting is not hanging
        if stop.is_set():
            return None
        self.member, self.status.broker = member, str(member)
        return member

    def unreachable(self, error: Exception, last: str | None) -> str:
        """The connect failed before a CONNACK: the message (logged unless it is ``last``)."""
        message = f"cannot reach the broker {self.member}: {error}"
        if message != last:
            logger.warning("mqtt: %s; retrying", message)
        return message

    def refused(self, code: Any, properties: Any, last: str | None) -> str:
        """A CONNACK that refuses (a redirect's is followed, or refused with a warning)."""
        if self.redirect(code, properties):
            return f"the broker {self.member} redirected the node"
        hint = ""
        if str(code) in ("Bad user name or password", "Not authorized"):
            hint = " (check mqtt.username and mqtt.password_file)"
        message = f"the broker {self.member} refused the connection: {code}{hint}"
        if message != last:
            logger.error("mqtt: %s; retrying", message)
        return message

    def redirect(self, code: Any, properties: Any) -> bool:
        """A CONNACK or DISCONNECT with a redirect's reason: the member it names is tried
        next when it is another listed one (True); any other reason is no redirect."""
        name = REDIRECTS.get(getattr(code, "value", -1))
        if name is None:
            return False
        reference = getattr(properties, "ServerReference", None)
        target = self.brokers.redirect(self.member,
                                       reference if isinstance(reference, str) else None)
        if isinstance(target, str):
            refusal = f"{self.member} redirects the node ({name}); not followed: {target}"
            if refusal != self._refusal:  # a broker that keeps redirecting: one line
                logger.warning("mqtt: %s", refusal)
            self._refusal = refusal
            return False
        logger.info("mqtt: %s redirects the node to %s (%s)", self.member, target, name)
        self._left(f"{self.member} redirected the node to {target} ({name})")
        return True

    def ended(self, healthy: bool, why: str | None) -> None:
        """The connect attempt or connection to the current member ended (see
        ``Brokers.ended``); ``why``: what went wrong, if anything."""
        self._left(why or f"the connection to {self.member} ended")
        self.brokers.ended(self.member, healthy)

    def accepted(self) -> None:
        """The current member accepted the connection: a move when it is another than the
        one the node was on (or tried first)."""
        member, before, why = self.member, self._home, self._why
        self._home, self._why = member, None
        if member is before:
            return
        self.status.failovers += 1
        logger.warning("mqtt: failed over from %s to %s: %s", before, member, why)
        if self._event is not None:
            self._event("broker_failover", **{"from": str(before), "to": str(member),
                                              "reason": why})

    def _left(self, why: str) -> None:
        """The first reason after the last accepted connection is why the node left it."""
        if self._why is None:
            self._why = why
