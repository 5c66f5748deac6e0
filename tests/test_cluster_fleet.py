"""The fleet on a real three-node RabbitMQ cluster (fixture ``rabbit_cluster``, marker
``cluster``): a real ``edge-agent run`` at 10 Hz loses its member and is on another within
5 s, its telemetry with no gap across the failover, its birth and state on the new member
(RabbitMQ 3.10 keeps retained messages per member), and a signed command sent while it was
away answered after; the operator's watch and send move with it.  Two agents with one node
id: the diagnosis appears and neither floods the cluster.  RabbitMQ 3.10's MQTT plugin
speaks 3.1.1 only, so the agents and the operator do too."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agent_process import start_agent, status, write_config
from control_helpers import sign, trusted
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from mqtt_helpers import Subscriber, wait_until
from rabbit_cluster import Member, RabbitCluster

from agent import protocol
from agent.control import collect, operator
from agent.control.operator import BrokerSettings

pytestmark = pytest.mark.cluster
TOPIC = "edge/v1/lab/orin-1"
INFLIGHT = 20  # at most this many records may be in flight when a member dies


@pytest.fixture()
def cluster(rabbit_cluster: RabbitCluster) -> Iterator[RabbitCluster]:
    """The session's cluster, every member running again after the test."""
    yield rabbit_cluster
    for member in rabbit_cluster.members:
        if member.name not in rabbit_cluster.pids:
            rabbit_cluster.start(member)


def node_config(tmp_path: Path, cluster: RabbitCluster, key: Ed25519PrivateKey,
                **extra: Any) -> Path:
    return write_config(
        tmp_path, 0, mqtt={"brokers": [m.address for m in cluster.members],
                           "protocol": "3.1.1", "local_broker": False,
                           "reconnect": {"min_s": 0.1, "max_s": 0.5}},
        inference={"enabled": False}, telemetry={"interval_s": 0.1},
        control={"trusted_keys": trusted(key)}, **extra)


def member_of(cluster: RabbitCluster, address: str) -> Member:
    return next(m for m in cluster.members if m.address == address)


def on(cluster: RabbitCluster, address: str, fleet: str, watch: list[str]) -> operator.Bus:
    """An operator session on the member at ``address`` (with the others to move to)."""
    others = [m.address for m in cluster.members if m.address != address]
    for _ in range(20):  # it starts on a random member of its list
        bus = operator.connect(BrokerSettings(brokers=(address, *others), protocol="3.1.1"),
                               fleet, watch)
        if bus.roaming is not None and bus.roaming.broker == address:
            return bus
        bus.close()
    raise AssertionError(f"no operator session on {address}")


def test_edge_agent_run_fails_over_with_no_gap_and_the_operator_moves_with_it(
        tmp_path: Path, cluster: RabbitCluster) -> None:
    key = Ed25519PrivateKey.generate()
    config = node_config(tmp_path, cluster, key)
    agent = start_agent(config)
    watcher: Subscriber | None = None
    bus: operator.Bus | None = None
    try:
        assert wait_until(lambda: status(config)[1].get("link", {}).get("state")
                          == "connected", 90), agent
        a = member_of(cluster, status(config)[1]["link"]["broker"])
        survivor = next(m for m in cluster.members if m != a)
        watcher = Subscriber(survivor, [f"{TOPIC}/#"], client_id="cluster-watch")
        bus = on(cluster, a.address, "lab", [protocol.STATE, protocol.BIRTH,
                                             protocol.TELEMETRY, protocol.reply_suffix("ping")])
        assert wait_until(lambda: len(watcher.on("telemetry")) >= 10, 30)  # across members
        assert wait_until(lambda: "telemetry" in bus.nodes().get("orin-1", {}), 30)
        cluster.kill(a)
        # a signed command sent while the node is away: answered once it is back
        envelope = sign(key, "ping", "node:orin-1", {})
        sent_at = time.time()
        operator.publish_command(bus, "orin-1", envelope)

        def moved() -> bool:
            link = status(config)[1].get("link", {})
            return link.get("state") == "connected" and link.get("broker") != a.address

        assert wait_until(moved, 5), status(config)[1].get("link")  # within 5 s of the kill
        outcomes = collect.collect(bus, envelope["id"], {"orin-1"}, sent_at, 60,
                                    again=lambda _node: operator.publish_command(bus, "orin-1",
                                                                           envelope))
        assert outcomes["orin-1"].status == protocol.SUCCEEDED, outcomes
        assert bus.moves >= 1 and bus.roaming is not None and bus.roaming.broker != a.address
        link = status(config)[1]["link"]
        assert link["failovers"] >= 1
        landed = member_of(cluster, link["broker"])
        assert wait_until(lambda: any(r["metrics"]["link"]["broker"] == landed.address
                                      for r in watcher.on("telemetry")), 10)
        # the operator's watch moved too: the node's telemetry reaches it from the new member
        seen = len(bus.messages)
        assert wait_until(lambda: len(bus.messages) > seen + 10, 10)
        # birth and state are on the member it landed on (retained there)
        fresh = Subscriber(landed, [f"{TOPIC}/birth", f"{TOPIC}/state"],
                           client_id="cluster-fresh")
        try:
            assert wait_until(lambda: fresh.on("birth") and fresh.on("state"), 10)
            assert fresh.on("birth")[-1]["broker"] == landed.address
            assert fresh.on("state")[-1]["broker"] == landed.address
        finally:
            fresh.close()
        assert wait_until(lambda: len(watcher.on("telemetry")) >= 20 + len(
            [r for r in watcher.on("telemetry") if r["metrics"]["link"]["broker"]
             == a.address]), 30)
        check_sequences(watcher.on("telemetry"))
        with bus.lock:  # the operator's own session drops the copies a failover makes
            keys = [(p["session"], p["seq"]) for t, p in bus.messages
                    if t.endswith("/telemetry")]
        assert keys and len(keys) == len(set(keys)), "the operator kept a copy of a record"
    finally:
        agent.kill()
        agent.communicate(timeout=30)
        if watcher is not None:
            watcher.close()
        if bus is not None:
            bus.close()


def check_sequences(records: list[dict[str, Any]]) -> None:
    """Per session, every seq from the first seen to the last arrived (the outbox replays
    what the dead member did not acknowledge); copies only of records in flight at the kill,
    which a consumer drops by (session, seq) as the protocol says."""
    keys = [(r["session"], r["seq"]) for r in records]
    duplicates = len(keys) - len(set(keys))
    assert duplicates <= INFLIGHT, f"{duplicates} records arrived twice"
    sessions: dict[int, set[int]] = {}
    for session, seq in set(keys):
        sessions.setdefault(session, set()).add(seq)
    assert len(sessions) >= 2, "no failover in the records"
    for session, seqs in sessions.items():
        missing = set(range(min(seqs), max(seqs) + 1)) - seqs
        assert not missing, f"session {session}: seq {sorted(missing)[:10]} lost"


def test_two_agents_with_one_node_id_are_diagnosed_and_do_not_flood(
        tmp_path: Path, cluster: RabbitCluster) -> None:
    key = Ed25519PrivateKey.generate()
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
    configs = [node_config(tmp_path / name, cluster, key) for name in ("one", "two")]
    agents = [start_agent(config) for config in configs]
    try:
        def diagnosed(config: Path) -> bool:
            return any("another client uses this node's id 'orin-1'" in problem
                       for problem in status(config)[1].get("problems", []))

        assert wait_until(lambda: all(diagnosed(c) for c in configs), 240), \
            [status(c)[1].get("link") for c in configs]
        before = sum(status(c)[1]["link"]["connects"] for c in configs)
        # neither floods: over the next 20 s (an observation, so a span of time) the two
        # connect a handful of times, where without the backoff they connect every 0.1-0.5 s
        assert not wait_until(lambda: sum(status(c)[1]["link"]["connects"] for c in configs)
                              - before > 8, 20)
    finally:
        for agent in agents:
            agent.kill()
            agent.communicate(timeout=30)
