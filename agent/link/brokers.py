"""The brokers a node may use (``mqtt.brokers``; ``host``/``port`` is a list of one), the
order it tries them in, each one's backoff, and which redirects it follows.

paho-mqtt has no server list, so failover is the link's.  Each node tries the members in an
order of its own, a shuffle seeded by its client id: a fleet spreads over the members, and
the nodes of a member that dies spread over the others instead of all moving to the next
one.  Each member has its own exponential backoff with jitter: a dead member is tried less
and less often while a live one is tried at once.  An MQTT 5 redirect (reason 0x9C "use
another server" or 0x9D "server moved", with a Server Reference) is followed once, and only
to a listed member: a broker cannot send a node to a broker the operator did not list.
"""

from __future__ import annotations

import ipaddress
import random
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from agent.link.settings import backoff_delay

MAX_MEMBERS = 16
REDIRECTS = {0x9C: "use another server", 0x9D: "server moved"}
_LABEL = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?$")
EXAMPLE = "host:port such as mqtt-a.example:1883 or [2001:db8::1]:8883 (port 1..65535)"


def parse_member(value: Any) -> tuple[str, int] | None:
    """``host:port`` (an IPv6 address in brackets) as (host, port), or None when it is not
    one: a host name of dot-separated labels, an IPv4 or a bracketed IPv6 address."""
    if not isinstance(value, str) or not value.isascii() or len(value) > 300:
        return None
    if value.startswith("["):
        host, separator, port = value[1:].partition("]:")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return None
    else:
        host, separator, port = value.rpartition(":")
        if len(host) > 253 or not all(_LABEL.match(label) for label in host.split(".")):
            return None
    if not separator or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host, int(port)


def address(host: str, port: int) -> str:
    """How a member is written (and logged): ``host:port``, IPv6 in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def members_problem(value: Any) -> str | None:
    """The config check of ``mqtt.brokers``: None when fine, else what is allowed."""
    allowed = f"a list of 1 to {MAX_MEMBERS} brokers, each {EXAMPLE}"
    if not isinstance(value, list) or not 0 < len(value) <= MAX_MEMBERS:
        return allowed
    seen: set[tuple[str, int]] = set()
    for item in value:
        member = parse_member(item)
        if member is None:
            return f"{allowed} ({item!r} is not)"
        if _key(member) in seen:
            return f"{allowed}, each once ({item!r} is listed twice)"
        seen.add(_key(member))
    return None


def _key(member: tuple[str, int]) -> tuple[str, int]:
    """Two spellings of one member are one: host names ignore case, IPv6 is compressed."""
    host, port = member
    try:
        return ipaddress.ip_address(host).compressed, port
    except ValueError:
        return host.lower(), port


@dataclass
class Member:
    host: str
    port: int
    failures: int = 0  # since it last held a connection: its backoff's exponent
    retry_at: float = 0.0  # monotonic: not tried again before

    def __str__(self) -> str:
        return address(self.host, self.port)


class Brokers:
    """The members in this node's order, and where and when it connects next."""

    def __init__(self, members: Sequence[tuple[str, int]], seed: str, low: float,
                 high: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not members:
            raise ValueError("no broker to connect to")
        order = list({_key(member): member for member in members}.values())
        random.Random(seed).shuffle(order)  # the same order on every start of this node
        self.members = [Member(host, port) for host, port in order]
        self.low, self.high, self._clock = low, high, clock
        self._at = 0  # the member tried last: the search for the next starts there
        self._target: Member | None = None  # a followed redirect's: tried next
        self._redirected = False  # the member tried last was a redirect's
        self._hold_until = 0.0  # after a connection ended: a jitter before the next connect

    def next(self) -> tuple[Member, float]:
        """The member to connect to next, and how many seconds to wait first: a redirect's
        at once, else the first in order whose backoff is over (the one whose backoff ends
        first when none is)."""
        now = self._clock()
        self._redirected, target, self._target = self._target is not None, self._target, None
        if target is None:
            count = len(self.members)
            rotation = [self.members[(self._at + step) % count] for step in range(count)]
            ready = [member for member in rotation if member.retry_at <= now]
            target = ready[0] if ready else min(rotation, key=lambda member: member.retry_at)
        self._at = self.members.index(target)
        if self._redirected:
            return target, 0.0
        return target, max(0.0, target.retry_at - now, self._hold_until - now)

    def ended(self, member: Member, healthy: bool) -> None:
        """A connect attempt failed, or a connection ended (``healthy``: it was accepted and
        worked, so its member's backoff starts again, and the next connect, to whichever
        member, waits a jitter below ``low``: a fleet that loses a member does not arrive at
        the others in one wave)."""
        now = self._clock()
        if healthy:
            member.failures = 0
            self._hold_until = now + random.uniform(0, self.low)
        member.retry_at = now + backoff_delay(member.failures, self.low, self.high)
        member.failures += 1

    def redirect(self, member: Member, reference: str | None) -> Member | str:
        """The listed member a redirect from ``member`` names (connected to next), or why
        it is not followed.  ``reference`` is the Server Reference: one or more
        ``host[:port]`` separated by spaces (no port: ``member``'s)."""
        if self._redirected:
            return f"{member} was reached by a redirect, and a redirect is followed once"
        if not reference:
            return "it names no server (no Server Reference)"
        for token in reference.split()[:MAX_MEMBERS]:
            named = parse_member(token) or parse_member(f"{token}:{member.port}")
            found = [m for m in self.members if named and _key((m.host, m.port)) == _key(named)]
            if found and found[0] is not member:
                self._target = found[0]
                return found[0]
        return f"{reference[:200]!a} is not another member of mqtt.brokers"
