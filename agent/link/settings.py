"""What the MQTT link is told (``LinkSettings``) and what it tells (``LinkStatus``), with the
reconnect backoff and the password file both the link and the operator client read.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class LinkSettings:
    client_id: str
    topic_root: str  # edge/v1/<fleet>/<node>
    host: str = "localhost"
    port: int = 1883
    # mqtt.brokers ("host:port" each): the members to fail over between; empty: host, port
    brokers: tuple[str, ...] = ()
    protocol: str = "5"  # or "3.1.1"
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls: bool = False
    username: str | None = None
    password_file: str | None = None
    keepalive_s: int = 30
    max_payload_bytes: int = 64 * 1024
    # the largest packet the link takes in: paho would otherwise buffer whatever arrives
    max_incoming_bytes: int = 1024 * 1024
    reconnect_min_s: float = 0.5
    reconnect_max_s: float = 30.0
    replay_per_s: float = 200.0
    # False: state, birth and the Last Will are not retained (selftest's probe node, which
    # must leave no ghost on the broker)
    retain: bool = True


@dataclass
class LinkStatus:
    """What ``edge-agent status`` and the live terminal line show."""

    state: str = "starting"  # connecting, connected, disconnected, stopped, dead
    broker: str = ""  # the member in use, or being tried
    brokers: list[str] = field(default_factory=list)  # every member, in this node's order
    failovers: int = 0  # connections accepted by another member than the one before
    session: int = 0
    since: float = field(default_factory=time.time)
    last_error: str | None = None
    connects: int = 0
    published: int = 0
    acked: int = 0
    replayed: int = 0
    rejected: int = 0
    restarts: int = 0  # of the link thread, after it died
    subscribed: bool = False  # the broker confirmed this connection's subscriptions
    faults: dict[str, int] = field(default_factory=dict)  # survived, by reason (outgoing.py)
    sessions_ended: dict[int, int] = field(default_factory=dict)  # session -> records taken
    heartbeat: float = field(default_factory=time.monotonic)  # the link thread's last round

    def beat(self) -> None:
        """The link thread is not hanging (a round, or a wait before a connect)."""
        self.heartbeat = time.monotonic()

    def metrics(self) -> dict[str, Any]:
        """Telemetry's ``link`` group: the member the node was on when a record was taken."""
        return {"broker": self.broker, "state": self.state, "connects": self.connects,
                "failovers": self.failovers}

    def to_dict(self) -> dict[str, Any]:
        fields = dict(self.__dict__)
        fields["faults"] = dict(self.faults)  # a copy: the link thread adds to it
        del fields["sessions_ended"], fields["heartbeat"]
        return fields


def incoming_bound(command_kb: int) -> int:
    """The largest packet a node's link takes in: commands up to twice
    ``control.max_payload_kb`` still reach the controller (which answers ``oversized``),
    and never less than 1 MiB."""
    return max(1 << 20, 2 * command_kb * 1024)


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

