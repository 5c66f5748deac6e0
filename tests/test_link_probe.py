"""The delivery probe on a broker list (agent.link.probe): a member that acknowledges the
node's subscriptions but delivers nothing on them (RabbitMQ 3.10 with a queue left by a
member that died; here a Mosquitto whose ACL lets the node subscribe to its commands but
never read them) is left within PROBE_S for the next member, where the probe passes and the
node stays; the probe never reaches the controller."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mqtt_helpers import Broker, Subscriber, wait_until
from test_link_failover import in_node_order

from agent.link import probe
from agent.link.mqtt import MqttLink
from agent.link.probe import DeliveryProbe
from agent.link.settings import LinkSettings
from agent.telemetry.outbox import Outbox
from agent.telemetry.records import Sequence

ROOT = "edge/v1/test/node-1"


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


LIST = LinkSettings(client_id="node-1", topic_root=ROOT, brokers=("a:1", "b:1"),
                    protocol="3.1.1")
ONE = LinkSettings(client_id="node-1", topic_root=ROOT, brokers=("a:1",))
FILTERS = (f"{ROOT}/cmd/+", "edge/v1/test/all/cmd/+")


class Sent:
    """A paho client's sending half: what went out, in order."""

    def __init__(self) -> None:
        self.published: list[tuple[str, bytes]] = []
        self.packets: list[tuple[str, Any]] = []

    def publish(self, topic: str, payload: bytes, qos: int) -> None:
        self.published.append((topic, payload))
        self.packets.append(("publish", topic))

    def unsubscribe(self, topics: list[str]) -> None:
        self.packets.append(("unsubscribe", tuple(topics)))

    def subscribe(self, topics: list[tuple[str, int]]) -> None:
        self.packets.append(("subscribe", tuple(topic for topic, _qos in topics)))


class Message:
    def __init__(self, topic: str, payload: bytes) -> None:
        self.topic, self.payload = topic, payload


def test_the_probe_passes_when_its_nonce_comes_back_and_fails_after_probe_s() -> None:
    clock, client = Clock(), Sent()
    check = DeliveryProbe(f"{ROOT}/cmd/_link-probe", LIST, clock)
    check.start(client)
    ((topic, nonce),) = client.published
    assert topic == f"{ROOT}/cmd/_link-probe" and len(nonce) == 16
    assert not check.take(Message(f"{ROOT}/cmd/ping", nonce))  # a command: the handler's
    assert check.take(Message(topic, b"someone else's"))  # a probe, not ours: swallowed
    clock.now += probe.PROBE_S
    assert check.take(Message(topic, nonce))
    assert check.failed("a:1") is None and not check.broken
    assert check.client_id("node-1") == "node-1"
    check.reset()
    check.start(client)
    clock.now += probe.PROBE_S - 0.1
    assert check.failed("a:1") is None
    clock.now += 0.2
    why = check.failed("a:1")
    assert why is not None and why.startswith("a:1 acknowledged the subscriptions but "
                                              "delivered nothing") and check.broken
    assert check.failed("a:1") is None  # said once
    assert check.client_id("node-1") == "node-1~1"  # from now on, and another for each loss
    check.reset()
    check.start(client)
    clock.now += probe.PROBE_S
    assert check.failed("a:1") is not None and check.client_id("node-1") == "node-1~2"
    one = DeliveryProbe("t", ONE, clock)  # one broker: no probe
    one.start(client)
    assert len(client.published) == 3 and one.failed("a:1") is None


def test_later_probes_follow_the_subscriptions_and_one_lost_then_ends_the_connection() -> None:
    """A member's clean-up can take the bindings after the first probe passed: a probe
    goes again at each of AGAIN_S after the subscriptions, and the one that does not come
    back ends the connection; after the last, one every EVERY_S."""
    clock, client = Clock(), Sent()
    check = DeliveryProbe(f"{ROOT}/cmd/_link-probe", LIST, clock, lambda: 0.0)
    check.start(client)
    assert check.take(Message(*client.published[-1]))
    for again in probe.AGAIN_S:
        clock.now = 100.0 + again - 0.1
        assert check.failed("a:1", client) is None and len(client.published) == 1 + \
            probe.AGAIN_S.index(again)
        clock.now = 100.0 + again
        assert check.failed("a:1", client) is None  # sent now
        topic, nonce = client.published[-1]
        assert topic == f"{ROOT}/cmd/_link-probe" and nonce != client.published[-2][1]
        assert check.take(Message(topic, nonce))
    clock.now = 100.0 + probe.AGAIN_S[-1] + probe.EVERY_S - 0.1
    assert check.failed("a:1", client) is None and len(client.published) == 3
    clock.now += 0.1  # and from then on every EVERY_S
    assert check.failed("a:1", client) is None and len(client.published) == 4
    assert check.take(Message(*client.published[-1]))
    check.reset()
    clock.now = 100.0
    check.start(client)
    assert check.take(Message(*client.published[-1]))
    clock.now = 100.0 + probe.AGAIN_S[0]
    assert check.failed("a:1", client) is None
    clock.now += probe.PROBE_S  # the second probe never came back
    why = check.failed("a:1", client)
    assert why is not None and "delivered nothing" in why and check.broken
    # the next connect waits for what the lost connection leaves behind to go
    assert all(probe.PAUSE_S <= check.delay(0.1) <= 2 * probe.PAUSE_S for _ in range(20))
    assert check.delay(30.0) == 30.0
    clock.now += 1000
    assert check.failed("a:1", client) is None and len(client.published) == 6
    check.reset()
    assert check.delay(0.1) == 0.1


def test_later_probes_are_spread_and_a_probe_waiting_in_the_inbox_came_back() -> None:
    """The nodes of a dead member land on the others together: each stretches its later
    probes by its own share of SPREAD, so they never probe in waves.  A node busy with
    replies reads its socket but dispatches later: the nonce already in its inbox counts."""
    clock, client = Clock(), Sent()
    check = DeliveryProbe(f"{ROOT}/cmd/_link-probe", LIST, clock, lambda: 0.5)
    check.start(client)
    assert check.take(Message(*client.published[-1]))
    stretched = probe.AGAIN_S[0] * (1 + probe.SPREAD / 2)
    clock.now = 100.0 + stretched - 0.1
    assert check.failed("a:1", client) is None and len(client.published) == 1
    clock.now = 100.0 + stretched
    assert check.failed("a:1", client) is None and len(client.published) == 2
    topic, nonce = client.published[-1]
    clock.now += probe.PROBE_S
    inbox = [Message(f"{ROOT}/cmd/ping", b"{}"), Message(topic, b"an old one")]
    assert check.failed("a:1", client, inbox) is not None and check.broken  # not there
    check.reset()
    clock.now = 100.0
    check.start(client)
    topic, nonce = client.published[-1]
    clock.now += probe.PROBE_S
    assert check.failed("a:1", client, [*inbox, Message(topic, nonce)]) is None
    assert not check.broken and check.failed("a:1", client) is None  # came back: settled


def test_each_later_probe_follows_the_subscriptions_made_anew() -> None:
    """A shared filter (``all``, a group) cannot be probed without reaching every node; a
    RabbitMQ 3.10 member's clean-up left nodes deaf to ``all`` alone.  So before each later
    probe the link renews every subscription, in order on the connection, and the probe
    after it checks its own; the renewal's SUBACK starts no new round of probes."""
    clock, client = Clock(), Sent()
    check = DeliveryProbe(f"{ROOT}/cmd/_link-probe", LIST, clock, lambda: 0.0)
    assert check.acknowledged(client, "a:1", FILTERS, [False, False]) is None
    assert client.packets == [("publish", f"{ROOT}/cmd/_link-probe")]
    assert check.take(Message(*client.published[-1]))
    clock.now = 100.0 + probe.AGAIN_S[0]
    assert check.failed("a:1", client) is None
    assert client.packets[1:] == [("unsubscribe", FILTERS), ("subscribe", FILTERS),
                                  ("publish", f"{ROOT}/cmd/_link-probe")]
    assert check.acknowledged(client, "a:1", FILTERS, [False, False]) is None  # renewed
    assert len(client.packets) == 4  # no probe more: the one in flight checks it
    assert check.take(Message(*client.published[-1]))
    clock.now = 100.0 + probe.AGAIN_S[1]
    assert check.failed("a:1", client) is None and len(client.packets) == 7
    clock.now += probe.PROBE_S  # that one is lost: the renewal did not bring delivery back
    assert check.failed("a:1", client) is not None and check.broken


def test_a_refused_subscription_is_said_and_ends_the_connection_on_a_list() -> None:
    clock, client = Clock(), Sent()
    check = DeliveryProbe(f"{ROOT}/cmd/_link-probe", LIST, clock)
    filters = FILTERS
    assert check.acknowledged(client, "a:1", filters, [False, False]) is None
    assert len(client.published) == 1 and not check.broken  # all granted: the probe goes
    check.reset()
    why = check.acknowledged(client, "a:1", filters, [False, True])
    assert why == "a:1 refused the subscription to edge/v1/test/all/cmd/+"
    assert check.broken and check.client_id("node-1") == "node-1~1"  # as a lost probe
    assert len(client.published) == 1  # no probe on a connection that is ending
    one = DeliveryProbe("t", ONE, clock)  # one broker: said, and nothing to move to
    assert one.acknowledged(client, "a:1", filters, [True, False]) is not None
    assert not one.broken and one.client_id("node-1") == "node-1"


@pytest.fixture()
def deaf_and_good(tmp_path: Path) -> Iterator[tuple[Broker, Broker]]:
    deaf, good = Broker(tmp_path / "deaf"), Broker(tmp_path / "good")
    acl = tmp_path / "deaf.acl"
    acl.write_text("topic readwrite edge/v1/test/node-1/state\n"
                   "topic readwrite edge/v1/test/node-1/birth\n"
                   "topic write edge/v1/test/node-1/cmd/#\n"  # subscribed, never delivered
                   "topic readwrite edge/v1/test/node-1/telemetry\n")
    deaf.config.write_text(deaf.config.read_text() + f"acl_file {acl}\n")
    deaf.start()
    good.start()
    yield deaf, good
    deaf.stop()
    good.stop()


@pytest.fixture()
def short_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe's timers for a loopback Mosquitto, whose probe comes back in milliseconds:
    lost after 3 s (10 s is for a loaded cluster member), the next connect 2-4 s later (5-10
    s: a dying member's clean-up).  The tests wait for them and watch past them through
    ``probe.PROBE_S`` and ``probe.PAUSE_S``, so the same behaviour takes a third of the
    time."""
    monkeypatch.setattr(probe, "PROBE_S", 3.0)
    monkeypatch.setattr(probe, "PAUSE_S", 2.0)


@pytest.mark.usefixtures("short_probe")
def test_a_member_that_delivers_nothing_is_left_for_one_that_does(
        tmp_path: Path, deaf_and_good: tuple[Broker, Broker]) -> None:
    deaf, good = deaf_and_good
    listed = in_node_order("node-1", [f"127.0.0.1:{deaf.port}", f"127.0.0.1:{good.port}"])
    handled: list[Any] = []
    outbox = Outbox(tmp_path / "outbox.sqlite", max_bytes=1 << 20, max_age_s=3600)
    link = MqttLink(LinkSettings(client_id="node-1", topic_root=ROOT, brokers=tuple(listed),
                                 reconnect_min_s=0.1, reconnect_max_s=0.5),
                    outbox, Sequence(outbox.bump("session")), announce=lambda session: [],
                    on_message=handled.append, subscriptions=(f"{ROOT}/cmd/+",))
    link.start()
    try:
        assert wait_until(lambda: link.status.broker == f"127.0.0.1:{deaf.port}"
                          and link.status.subscribed, 10)
        # the probe is lost: from then until the next member accepts, nothing is subscribed
        assert wait_until(lambda: "delivered nothing" in (link.status.last_error or ""),
                          probe.PROBE_S + 10), link.status
        assert not link.status.subscribed, link.status
        assert wait_until(lambda: link.status.broker == f"127.0.0.1:{good.port}"
                          and link.status.subscribed, 2 * probe.PAUSE_S + 10), link.status
        assert link.status.failovers == 1
        # under a client id of its own: a clean-up deleting by the node's name misses it
        assert " as node-1 " in deaf.log() and " as node-1~1 " in good.log(), good.log()
        connects = link.status.connects
        # on the good member the probe comes back: it stays there (past another PROBE_S);
        # a lost probe unsubscribes at once, and reconnects only PAUSE_S later
        assert not wait_until(lambda: link.status.connects != connects
                              or not link.status.subscribed, probe.PROBE_S + 2), link.status
        assert handled == [], "a probe reached the handler"
    finally:
        link.stop(flush_s=0)
        outbox.close()


@pytest.mark.usefixtures("short_probe")
def test_renewed_subscriptions_keep_delivering_on_a_real_broker(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The later probes' renewals on a real Mosquitto: UNSUBSCRIBE and SUBSCRIBE of every
    filter go out, the probe after each comes back (no reconnect), and a command on the
    shared filter still reaches the node."""
    monkeypatch.setattr(probe, "AGAIN_S", (1.0, 2.0))
    monkeypatch.setattr(probe, "SPREAD", 0.0)
    first, second = Broker(tmp_path / "a"), Broker(tmp_path / "b")
    for broker in (first, second):
        broker.config.write_text(broker.config.read_text() + "log_type subscribe\n"
                                 "log_type unsubscribe\n")
        broker.start()
    listed = in_node_order("node-1", [f"127.0.0.1:{first.port}", f"127.0.0.1:{second.port}"])
    handled: list[Any] = []
    outbox = Outbox(tmp_path / "outbox.sqlite", max_bytes=1 << 20, max_age_s=3600)
    shared = "edge/v1/test/all/cmd/+"
    link = MqttLink(LinkSettings(client_id="node-1", topic_root=ROOT, brokers=tuple(listed)),
                    outbox, Sequence(outbox.bump("session")), announce=lambda session: [],
                    on_message=handled.append, subscriptions=(f"{ROOT}/cmd/+", shared))
    link.start()
    try:
        assert wait_until(lambda: link.status.subscribed, 10)
        assert wait_until(lambda: first.log().count(f"node-1 {shared}") >= 2, 10), \
            first.log()  # UNSUBSCRIBE's line: both renewals went out
        connects = link.status.connects
        assert wait_until(lambda: first.log().count(f"node-1 0 {shared}") == 3, 5), \
            first.log()
        # both renewals' probes came back: no reconnect past another PROBE_S
        assert not wait_until(lambda: link.status.connects != connects, probe.PROBE_S + 1)
        assert link.status.subscribed and link.status.broker == f"127.0.0.1:{first.port}"
        sender = Subscriber(first, [], client_id="sender")
        try:
            sender.client.publish("edge/v1/test/all/cmd/ping", b"{}", qos=1).wait_for_publish(5)
        finally:
            sender.close()
        assert wait_until(lambda: [m.topic for m in handled] ==
                          ["edge/v1/test/all/cmd/ping"], 5), handled
    finally:
        link.stop(flush_s=0)
        outbox.close()
        first.stop()
        second.stop()
