"""The operator side of a broker list (``edge-agent fleet`` and agent.control.operator): it
moves to another member mid-watch and mid-send, and ``watch --share`` splits telemetry
between the watchers of a group.  Real Mosquittos, not bridged: the node and the operator
meet on the member that is left."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from control_helpers import SimulatedNode, sign, trusted_keys
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from mqtt_helpers import Broker, wait_until
from paho.mqtt.enums import CallbackAPIVersion
from test_link_failover import Node, kill

from agent import protocol
from agent.control import collect, operator
from agent.control.operator import BrokerSettings
from agent.control.resend import resender

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture()
def pair(tmp_path: Path) -> Iterator[tuple[Broker, Broker]]:
    """Two members; only the first runs at first, so that node and operator both start on
    it (each tries the members in an order of its own)."""
    a, b = Broker(tmp_path / "a"), Broker(tmp_path / "b")
    a.start()
    yield a, b
    a.stop()
    b.stop()


def listed(*brokers: Broker) -> tuple[str, ...]:
    return tuple(f"127.0.0.1:{broker.port}" for broker in brokers)


def test_a_watch_moves_to_another_member(tmp_path: Path, pair: tuple[Broker, Broker]) -> None:
    a, b = pair
    bus = operator.connect(BrokerSettings(brokers=listed(a, b)), "test",
                           [protocol.STATE, protocol.TELEMETRY])
    try:
        with Node(tmp_path, list(listed(a, b))) as node:
            assert bus.roaming is not None and bus.roaming.broker == listed(a)[0]
            assert wait_until(lambda: "telemetry" in bus.nodes().get("node-1", {}), 10)
            b.start()
            kill(a)
            killed = time.monotonic()
            # both move to B: the watch sees the node's retained state there, then telemetry
            assert wait_until(lambda: bus.moves == 1 and (bus.nodes()["node-1"]["state"].get(
                "broker") == listed(b)[0]), 5), bus.nodes()
            seen = len(bus.messages)
            assert wait_until(lambda: len(bus.messages) > seen + 5, 5)
            assert time.monotonic() - killed < 10
            assert bus.roaming.broker == listed(b)[0]
            # A died; and when B came first in the node's order, B was down at its start
            first_b = node.link.status.brokers[0] == listed(b)[0]
            assert node.link.status.failovers == (2 if first_b else 1)
    finally:
        bus.close()


class SlowNode(SimulatedNode):
    """node-1 on a broker list (``broker`` is its first), whose ping waits until
    ``release``."""

    def __init__(self, state: Path, broker: Broker, brokers: tuple[str, ...],
                 key: Ed25519PrivateKey) -> None:
        self.started, self.release = threading.Event(), threading.Event()
        super().__init__("node-1", broker, state, trusted_keys(key), brokers=brokers,
                         ping=self._ping)

    def _ping(self, args: dict[str, Any], progress: Any) -> dict[str, Any]:
        self.started.set()
        assert self.release.wait(30)
        return {"pong": True}

    def __enter__(self) -> SlowNode:
        self.start()
        assert wait_until(lambda: self.link.status.subscribed, 10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.stop()


def test_a_command_sent_before_the_member_dies_is_answered_after(
        tmp_path: Path, pair: tuple[Broker, Broker]) -> None:
    a, b = pair
    key = Ed25519PrivateKey.generate()
    bus = operator.connect(BrokerSettings(brokers=listed(a, b)), "lab",
                           [protocol.STATE, protocol.reply_suffix("ping")])
    outcomes: dict[str, collect.Outcome] = {}
    try:
        with SlowNode(tmp_path, a, listed(a, b), key) as node:
            envelope = sign(key, "ping", "node:node-1", {})
            sent_at = time.time()
            operator.publish_command(bus, "node-1", envelope)
            collecting = threading.Thread(target=lambda: outcomes.update(collect.collect(
                bus, envelope["id"], {"node-1"}, sent_at, 20,
                again=lambda _node: operator.publish_command(bus, "node-1", envelope))))
            collecting.start()
            assert node.started.wait(10)  # accepted and running on A
            b.start()
            kill(a)
            assert wait_until(lambda: node.link.status.broker == listed(b)[0]
                              and node.link.status.state == "connected", 5)
            node.release.set()  # the reply goes out on B
            collecting.join(25)
    finally:
        bus.close()
    assert bus.moves == 1
    assert outcomes["node-1"].status == protocol.SUCCEEDED
    assert outcomes["node-1"].result == {"pong": True}


def test_after_a_move_the_command_is_published_again(
        tmp_path: Path, pair: tuple[Broker, Broker]) -> None:
    """Published on A while the node was on B (the members are not bridged here, as a
    cluster's would be): only the copy published again after the move reaches it, and it
    runs once."""
    a, b = pair
    key = Ed25519PrivateKey.generate()
    bus = operator.connect(BrokerSettings(brokers=listed(a, b)), "lab",
                           [protocol.reply_suffix("ping")])  # on A: B is down
    b.start()
    try:
        with SlowNode(tmp_path, b, listed(b), key) as node:
            node.release.set()
            envelope = sign(key, "ping", "node:node-1", {})
            operator.publish_command(bus, "node-1", envelope)
            kill(a)
            outcomes = collect.collect(
                bus, envelope["id"], {"node-1"}, time.time(), 20,
                again=lambda _node: operator.publish_command(bus, "node-1", envelope))
            runs = node.store.get(envelope["id"])
    finally:
        bus.close()
    assert bus.moves == 1 and outcomes["node-1"].status == protocol.SUCCEEDED
    assert runs is not None and runs["status"] == protocol.SUCCEEDED


def test_watchers_of_a_share_group_each_get_a_part(tmp_path: Path, broker: Broker) -> None:
    watchers = [operator.connect(BrokerSettings(host=broker.host, port=broker.port), "test",
                                 [protocol.STATE, protocol.TELEMETRY], share="ops")
                for _ in range(2)]
    try:
        with Node(tmp_path, listed(broker)):
            assert wait_until(lambda: sum(len(w.messages) for w in watchers) >= 40, 15)
        seqs = [{(p["session"], p["seq"]) for t, p in w.messages if t.endswith("/telemetry")}
                for w in watchers]
        # both see the node's retained state; each record of telemetry reaches one of them
        assert all("state" in w.nodes()["node-1"] for w in watchers)
        assert all(seqs) and not seqs[0] & seqs[1]
        session = max(s for s, _ in seqs[0] | seqs[1])
        together = sorted(seq for s, seq in seqs[0] | seqs[1] if s == session)
        assert together == list(range(len(together)))
    finally:
        for watcher in watchers:
            watcher.close()


def fleet(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agent", "fleet", *args], capture_output=True,
                          text=True, cwd=REPO, timeout=60, check=False)


def test_fleet_takes_a_broker_list(tmp_path: Path, pair: tuple[Broker, Broker]) -> None:
    a, b = pair
    with Node(tmp_path, list(listed(a))):
        done = fleet("watch", "--once", "--settle", "0.5", "--json", "--fleet", "test",
                     "--broker", ",".join(listed(b, a)))  # B is down: A it is
        assert done.returncode == 0, done.stderr
        assert '"node": "node-1"' in done.stdout
    bad = fleet("watch", "--once", "--broker", f"{listed(a)[0]},nowhere")
    assert bad.returncode == 2
    assert bad.stderr.splitlines() == [
        f"edge-agent fleet: --broker {listed(a)[0]},nowhere: expected host:port, or up to "
        "16 of them separated by commas ([...] around an IPv6 address)"]
    down = fleet("watch", "--once", "--broker", ",".join(listed(b, b)))
    assert down.returncode == 2 and down.stderr.startswith(
        "edge-agent fleet: no broker of the list could be used: cannot reach the broker ")
    share = fleet("watch", "--once", "--share", "a/b", "--broker", listed(a)[0])
    assert share.returncode == 2 and "a share group is letters" in share.stderr


def test_fleet_speaks_mqtt_3_1_1_to_a_broker_without_5(tmp_path: Path, broker: Broker) -> None:
    """RabbitMQ's MQTT plugin before 3.13 has no MQTT 5: --protocol (or mqtt.protocol)."""
    for protocol_flag in (["--protocol", "3.1.1"], []):
        done = fleet("watch", "--once", "--settle", "0", *protocol_flag, "--broker",
                     listed(broker)[0])
        assert done.returncode == 0, done.stderr
    # Mosquitto's log names the protocol of each client: p2 is 3.1.1, p5 is 5
    operators = [line for line in broker.log().splitlines() if "as edge-operator-" in line]
    assert [line.split("(")[-1][:3] for line in operators] == ["p2,", "p5,"], operators


def test_a_command_sent_while_the_node_is_away_is_answered_once_it_is_back(
        tmp_path: Path, broker: Broker) -> None:
    """The node's session is clean: a command published while it is away (its member died,
    it has not landed on another yet) reaches no one.  Its birth on coming back is what the
    operator publishes it again on; the node answers once."""
    key = Ed25519PrivateKey.generate()
    bus = operator.connect(BrokerSettings(host=broker.host, port=broker.port), "lab",
                           [protocol.STATE, protocol.BIRTH, protocol.reply_suffix("ping")])
    outcomes: dict[str, collect.Outcome] = {}
    node = SimulatedNode("node-1", broker, tmp_path, trusted_keys(key), birth=True)
    try:
        envelope = sign(key, "ping", "node:node-1", {})
        sent_at = time.time()
        operator.publish_command(bus, "node-1", envelope)  # nobody subscribed: gone
        collecting = threading.Thread(target=lambda: outcomes.update(collect.collect(
            bus, envelope["id"], {"node-1"}, sent_at, 30,
            again=lambda _node: operator.publish_command(bus, "node-1", envelope))))
        collecting.start()
        node.start()
        collecting.join(35)
        runs = node.store.get(envelope["id"])
    finally:
        node.stop()
        bus.close()
    assert outcomes["node-1"].status == protocol.SUCCEEDED, outcomes
    assert runs is not None and runs["status"] == protocol.SUCCEEDED


def test_a_broadcast_goes_again_only_to_the_node_that_came_back(
        tmp_path: Path, broker: Broker, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sent to the whole fleet again for one node's return, a broadcast would reach every
    node once more (quadratic over a member's failover): the node that came back gets it
    on its own topic, signed for it with the same id, and the others hear it once."""
    monkeypatch.setattr(collect, "SILENT_S", 3600.0)  # its birth, not its silence, here
    key = Ed25519PrivateKey.generate()
    bus = operator.connect(BrokerSettings(host=broker.host, port=broker.port), "lab",
                           [protocol.STATE, protocol.BIRTH, protocol.reply_suffix("ping")])
    nodes = {name: SimulatedNode(name, broker, tmp_path, trusted_keys(key), birth=True)
             for name in ("node-a", "node-b", "node-c")}
    outcomes: dict[str, collect.Outcome] = {}
    try:
        for name in ("node-a", "node-b"):
            nodes[name].start()
        assert wait_until(lambda: {"node-a", "node-b"} <= set(bus.nodes()), 10)
        envelope = sign(key, "ping", "all", {})
        sent_at = time.time()
        operator.publish_command(bus, "all", envelope)
        collecting = threading.Thread(target=lambda: outcomes.update(collect.collect(
            bus, envelope["id"], set(nodes), sent_at, 30,
            again=resender(bus, key, "all", envelope))))
        collecting.start()
        assert wait_until(lambda: all(nodes[n].store.get(envelope["id"]) is not None
                                      for n in ("node-a", "node-b")), 10)
        nodes["node-c"].start()  # away when it was sent: its birth brings it again
        collecting.join(35)
    finally:
        for node in nodes.values():
            node.stop()
        bus.close()
    assert {n: o.status for n, o in outcomes.items()} == dict.fromkeys(nodes, "succeeded")
    with bus.lock:
        replies = [p for t, p in bus.messages if protocol.is_reply(t)
                   and p.get("id") == envelope["id"]]
    assert not [r for r in replies if r.get("duplicate")], "a node heard it twice"


def test_a_birth_from_a_retained_store_is_no_return(
        broker: Broker, monkeypatch: pytest.MonkeyPatch) -> None:
    """A session that subscribes to births while it collects (an operator that just
    connected, or moved) hears every node's retained birth then: an old connection, not a
    node that came back, or a broadcast would go again to each node of the member.  A live
    birth is a return."""
    monkeypatch.setattr(collect, "SILENT_S", 3600.0)  # births, not silence, here
    bus = operator.connect(BrokerSettings(host=broker.host, port=broker.port), "lab",
                           [protocol.reply_suffix("ping")])
    topic = protocol.topic(f"{protocol.fleet_root('lab')}/node-x", protocol.BIRTH)
    node = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="node-x")
    node.connect(broker.host, broker.port)
    node.loop_start()
    asked: list[str | None] = []
    try:
        node.publish(topic, json.dumps({"session": 1}), qos=1, retain=True).wait_for_publish(5)
        collecting = threading.Thread(target=collect.collect, args=(
            bus, "an-id", {"node-x"}, time.time(), 30, asked.append))
        collecting.start()
        bus.client.subscribe(topic, qos=1)
        assert wait_until(lambda: (topic, {"session": 1}) in bus.messages, 10)
        node.publish(topic, json.dumps({"session": 2}), qos=1, retain=True).wait_for_publish(5)
        assert wait_until(lambda: asked, 10)
        reply = {"id": "an-id", "node_id": "node-x", "status": protocol.SUCCEEDED}
        node.publish(protocol.topic(f"{protocol.fleet_root('lab')}/node-x",
                                    protocol.reply_suffix("ping")), json.dumps(reply), qos=1)
        collecting.join(35)  # the answer ends it
        assert not collecting.is_alive()
    finally:
        node.loop_stop()
        node.disconnect()
        bus.close()
    assert asked == ["node-x"]  # for the live birth only


def ping_all_one_deaf(broker: Broker, key: Ed25519PrivateKey,
                      nodes: dict[str, SimulatedNode]) -> tuple[str, operator.Bus,
                                                                dict[str, collect.Outcome],
                                                                list[str | None]]:
    """``node-b`` leaves the ``all`` filter out (deaf to broadcasts, as RabbitMQ 3.10 left
    some nodes); the nodes start, a ping to ``all`` is collected as ``fleet send`` does, and
    the nodes stop: the command's id, the (closed) bus, the outcomes, and what the resend
    was called with, in order."""
    bus = operator.connect(BrokerSettings(host=broker.host, port=broker.port), "lab",
                           [protocol.reply_suffix("ping")])
    deaf = nodes["node-b"].link
    deaf.subscriptions = tuple(t for t in deaf.subscriptions if "/all/" not in t)
    sent_again: list[str | None] = []
    try:
        for node in nodes.values():
            node.start()
        assert wait_until(lambda: all(n.link.status.subscribed for n in nodes.values()), 10)
        envelope = sign(key, "ping", "all", {})
        sent_at = time.time()
        operator.publish_command(bus, "all", envelope)
        resend = resender(bus, key, "all", envelope)

        def again(node: str | None) -> None:
            sent_again.append(node)
            resend(node)

        outcomes = collect.collect(bus, envelope["id"], set(nodes), sent_at, 30, again=again)
    finally:
        for node in nodes.values():
            node.stop()
        bus.close()
    return envelope["id"], bus, outcomes, sent_again


def test_a_node_deaf_to_the_broadcast_gets_it_on_its_own_topic(
        tmp_path: Path, broker: Broker) -> None:
    """A node the broker no longer delivers broadcasts to (RabbitMQ 3.10 after a member's
    clean-up; here its link leaves the ``all`` filter out) still answers: silent after
    SILENT_S, it gets the command on its own topic, signed for it, once; the node that
    answered does not hear it again."""
    key = Ed25519PrivateKey.generate()
    nodes = {name: SimulatedNode(name, broker, tmp_path, trusted_keys(key))
             for name in ("node-a", "node-b")}
    command_id, bus, outcomes, _sent_again = ping_all_one_deaf(broker, key, nodes)
    assert {n: o.status for n, o in outcomes.items()} == dict.fromkeys(nodes, "succeeded")
    late = outcomes["node-b"].ms
    assert late is not None and late >= 1000 * collect.SILENT_S  # sent again, not heard
    with bus.lock:
        replies = [p for t, p in bus.messages if protocol.is_reply(t)
                   and p.get("id") == command_id]
    assert sorted(r["node_id"] for r in replies if r.get("status") == "succeeded") == \
        ["node-a", "node-b"] and not [r for r in replies if r.get("duplicate")]


def test_the_silent_nodes_wait_until_the_replies_stop_flowing(
        tmp_path: Path, broker: Broker, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fleet still answering is sent nothing more: the resend to the silent nodes waits
    until no reply came for SILENT_S, each reply moving that on (here one node reports
    progress for twice SILENT_S while another never heard the broadcast)."""
    monkeypatch.setattr(collect, "SILENT_S", 3.0)
    key = Ed25519PrivateKey.generate()

    def slow(args: dict[str, Any], progress: Any) -> dict[str, Any]:
        for step in range(24):  # a command that works 6 s, and says so every 0.25 s
            time.sleep(0.25)
            progress(f"step {step}")
        return {"pong": True}

    nodes = {"node-a": SimulatedNode("node-a", broker, tmp_path, trusted_keys(key), ping=slow),
             "node-b": SimulatedNode("node-b", broker, tmp_path, trusted_keys(key))}
    _command_id, _bus, outcomes, sent_again = ping_all_one_deaf(broker, key, nodes)
    assert {n: o.status for n, o in outcomes.items()} == dict.fromkeys(nodes, "succeeded")
    assert sent_again == ["node-b"]
    busy, late = outcomes["node-a"].ms, outcomes["node-b"].ms
    assert busy is not None and late is not None
    assert late > busy, (busy, late)  # sent again only once node-a had gone quiet
