"""The RabbitMQ cluster the fleet-failover tests run on (tests/rabbit_cluster.py), and what
its MQTT plugin gives a fleet, asserted so that a RabbitMQ upgrade that changes it is noticed:
a QoS 1 message crosses members, the clients of the surviving members carry on when one is
killed, the killed member rejoins, and retained messages stay on the member they were
published on.

paho-mqtt with MQTT 3.1.1: RabbitMQ 3.10's plugin speaks no MQTT 5.
"""

from __future__ import annotations

import queue
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from mqtt_helpers import wait_until
from paho.mqtt.enums import CallbackAPIVersion
from rabbit_cluster import Member, RabbitCluster

pytestmark = pytest.mark.cluster
WAIT = 30.0  # generous: three Erlang VMs share a loaded 2-core machine


class Client:
    """A 3.1.1 client on one member: connecting, subscribing and publishing return once the
    broker has acknowledged them; what arrives is queued."""

    def __init__(self, member: Member, name: str) -> None:
        self.messages: queue.Queue[mqtt.MQTTMessage] = queue.Queue()
        self.subacks: set[int] = set()
        self.connected = threading.Event()
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2,
                                  client_id=f"{name}-{uuid.uuid4().hex[:8]}",
                                  protocol=mqtt.MQTTv311)
        self.client.on_connect = self._connected
        self.client.on_subscribe = lambda c, u, mid, codes, p: self.subacks.add(mid)
        self.client.on_message = lambda c, u, message: self.messages.put(message)
        self.client.connect(member.host, member.port, keepalive=10)
        self.client.loop_start()
        assert self.connected.wait(WAIT), f"no CONNACK from {member.name}"

    def _connected(self, client: mqtt.Client, userdata: Any, flags: Any, code: Any,
                   properties: Any) -> None:
        if not code.is_failure:
            self.connected.set()

    def subscribe(self, topic: str) -> None:
        result, mid = self.client.subscribe(topic, qos=1)
        assert result == mqtt.MQTT_ERR_SUCCESS
        assert wait_until(lambda: mid in self.subacks, WAIT), f"no SUBACK for {topic}"

    def publish(self, topic: str, payload: bytes, *, retain: bool = False) -> None:
        info = self.client.publish(topic, payload, qos=1, retain=retain)
        info.wait_for_publish(WAIT)
        assert info.is_published(), f"no PUBACK for {topic}"

    def next(self) -> mqtt.MQTTMessage:
        return self.messages.get(timeout=WAIT)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


@pytest.fixture()
def connect() -> Iterator[Callable[[Member, str], Client]]:
    """``connect(member, name)``: a Client on the member, closed when the test ends."""
    made: list[Client] = []

    def client(member: Member, name: str) -> Client:
        made.append(Client(member, name))
        return made[-1]

    yield client
    for each in made:
        each.close()


def topic(name: str) -> str:
    return f"test/{name}/{uuid.uuid4().hex[:8]}"


def test_the_members_run_as_one_cluster_on_their_own_loopback_ports(
        rabbit_cluster: RabbitCluster) -> None:
    names = {member.name for member in rabbit_cluster.members}
    assert len(names) == 3
    assert all(rabbit_cluster.running(member) == names for member in rabbit_cluster.members)
    ports = [port for member in rabbit_cluster.members
             for port in (member.port, member.amqp_port, member.dist_port)]
    assert len(set(ports)) == len(ports)
    assert {member.host for member in rabbit_cluster.members} == {"127.0.0.1"}


def test_a_qos1_message_published_on_one_member_reaches_subscribers_on_the_others(
        rabbit_cluster: RabbitCluster, connect: Callable[[Member, str], Client]) -> None:
    a, b, c = rabbit_cluster.members
    where = topic("routing")
    subscribers = [connect(b, "on-b"), connect(c, "on-c")]
    for subscriber in subscribers:
        subscriber.subscribe(where)
    connect(a, "on-a").publish(where, b"across")
    for subscriber in subscribers:
        message = subscriber.next()
        assert (message.topic, message.payload, message.qos) == (where, b"across", 1)


def test_a_retained_message_stays_on_the_member_it_was_published_on(
        rabbit_cluster: RabbitCluster, connect: Callable[[Member, str], Client]) -> None:
    """RabbitMQ 3.10 keeps retained messages per node: a node that lands on member B must
    publish its retained state there again.  Ordered, not timed: B's store delivers what it
    retains while it handles the SUBSCRIBE, before the later marker routed over from A."""
    a, b, _ = rabbit_cluster.members
    where = topic("retained")
    publisher = connect(a, "on-a")
    publisher.publish(where, b"state", retain=True)

    on_a = connect(a, "late-on-a")
    on_a.subscribe(where)
    message = on_a.next()
    assert (message.payload, message.retain) == (b"state", True)

    on_b = connect(b, "late-on-b")
    on_b.subscribe(where)
    publisher.publish(where, b"marker")
    message = on_b.next()
    assert (message.payload, message.retain) == (b"marker", False), "B had A's retained message"

    publisher.publish(where, b"", retain=True)  # clears it on A: the session's cluster is shared


def test_clients_of_the_other_members_carry_on_when_one_is_killed_and_it_rejoins(
        rabbit_cluster: RabbitCluster, connect: Callable[[Member, str], Client]) -> None:
    a, b, c = rabbit_cluster.members
    where = topic("failover")
    on_a = connect(a, "on-a")
    on_b = connect(b, "on-b")
    on_b.subscribe(where)
    publisher = connect(c, "on-c")
    rabbit_cluster.kill(a)
    try:
        assert wait_until(lambda: not on_a.client.is_connected(), WAIT)
        assert rabbit_cluster.running(b) == {b.name, c.name}
        publisher.publish(where, b"while a is down")
        assert on_b.next().payload == b"while a is down"
        connect(b, "new-on-b").publish(where, b"a new client on b")
        assert on_b.next().payload == b"a new client on b"
    finally:
        rabbit_cluster.start(a)
    assert rabbit_cluster.running(a) == {a.name, b.name, c.name}
    connect(a, "back-on-a").publish(where, b"a is back")
    assert on_b.next().payload == b"a is back"
