"""The link against someone who can publish to the broker: a real agent on a real Mosquitto.

No message may stop the link thread; a thread that dies anyway says so (``dead``, degraded,
no watchdog ping) and the service starts it again; a reply to a signed command is never lost
in a burst of junk; and a fuzzer of payload bytes and MQTT 5 properties finds no message
after which the link is down, a signed ping goes unanswered or telemetry has a gap.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from control_helpers import FLEET, Operator, node_config, running_node, sign
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hostile_helpers import RawClient, junk, properties, telemetry_gaps
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mqtt_helpers import Broker, Subscriber, wait_until
from tuning_helpers import copy_board

from agent import protocol
from agent.service import health
from agent.service.node import Service

BOARD = "jetson-agx-orin-jp6"
NODE = "orin-1"
ROOT = protocol.node_root(FLEET, NODE)


def cmd_topic(name: str, scope: str = ROOT) -> str:
    return protocol.topic(scope, protocol.command_suffix(name))


@pytest.fixture()
def broker(tmp_path: Path) -> Iterator[Broker]:
    """This module's Mosquitto queues up to 20,000 messages per client: by default it keeps
    1,000 and drops the rest, signed pings among them, when a burst outruns the agent (the
    loss this suite must pin on the agent, not on the broker's configuration)."""
    server = Broker(tmp_path / "broker")
    server.config.write_text(server.config.read_text() + "max_queued_messages 20000\n")
    server.start()
    yield server
    server.stop()


@pytest.fixture()
def node(tmp_path: Path, broker: Broker, key: Ed25519PrivateKey) -> Iterator[Service]:
    config = node_config(tmp_path, copy_board(BOARD, tmp_path), broker, key, allow=["ping"])
    config["inference"] = {"enabled": False}  # the link and the controller are under test
    with running_node(config) as service:
        yield service


@pytest.fixture()
def raw(broker: Broker) -> Iterator[RawClient]:
    client = RawClient(broker, "attacker")
    yield client
    client.close()


def pinged(operator: Operator, seconds: float = 20) -> dict[str, Any]:
    """A signed ping's final reply (asserts there is one)."""
    return operator.final(operator.send(NODE, "ping")["id"], NODE, seconds)


def test_a_handler_that_raises_does_not_end_the_link(node: Service, operator: Operator,
                                                    raw: RawClient) -> None:
    link = node.link
    assert link is not None and link.on_message is not None
    handler = link.on_message

    def fragile(message: Any) -> None:
        if message.topic.endswith("/cmd/explode"):
            raise RuntimeError("injected: the handler failed")
        handler(message)

    link.on_message = fragile
    raw.publish(cmd_topic("explode"), b"{}")
    # what used to escape the controller: nesting past the recursion limit, a lone surrogate
    raw.publish(cmd_topic("ping"), b"[" * 5000 + b"]" * 5000)
    raw.publish(cmd_topic("ping"), b'{"id": "\\ud800", "command": "ping"}')
    raw.publish(protocol.topic(ROOT, protocol.DESIRED), b"{" * 3000)
    assert raw.drain()
    assert wait_until(lambda: link.status.faults.get("handler_error", 0) >= 1)
    assert pinged(operator)["status"] == "succeeded"
    assert link.alive and link.status.state == "connected"
    assert link.status.faults.get("thread_died", 0) == 0


def test_a_wildcard_response_topic_is_skipped_and_the_reply_goes_to_res(
        node: Service, operator: Operator, raw: RawClient, key: Ed25519PrivateKey) -> None:
    link = node.link
    assert link is not None
    replies = protocol.topic(protocol.operator_root(FLEET), "tester")
    raw.client.subscribe(protocol.topic(replies, "#"), qos=1)
    got: list[tuple[str, bytes | None]] = []
    raw.client.on_message = lambda c, u, m: got.append(
        (m.topic, getattr(m.properties, "CorrelationData", None)))
    bad = [protocol.topic(replies, "+"), protocol.topic(replies, "#"),
           protocol.topic(replies, "a/+/b")]
    sent = []
    for response_topic in [*bad, protocol.topic(replies, "ok")]:
        envelope = sign(key, "ping", f"node:{NODE}", {})
        sent.append(envelope["id"])
        raw.publish(cmd_topic("ping"), json.dumps(envelope).encode(),
                    properties(response_topic=response_topic, correlation=b"c-1"))
    assert raw.drain()
    for command_id in sent:  # every one answered on the node's res topic
        assert operator.final(command_id, NODE)["status"] == "succeeded"
    assert link.alive and link.status.state == "connected"
    assert pinged(operator)["status"] == "succeeded"
    # the link's own check, whatever the controller lets through: skipped and counted, and
    # the reply still goes to the res topic
    before = link.status.faults.get("unpublishable_topic", 0)
    for response_topic in bad:
        link.publish_reply(protocol.topic(ROOT, protocol.reply_suffix("ping")),
                           {"id": f"direct {response_topic}", "status": "succeeded",
                            "node_id": NODE}, response_topic, b"c-2")
    assert link.status.faults.get("unpublishable_topic", 0) == before + len(bad)
    for response_topic in bad:
        assert operator.final(f"direct {response_topic}", NODE)["status"] == "succeeded"
    assert link.alive and link.status.state == "connected"
    # the one publishable response topic got its replies, with the correlation data
    assert wait_until(lambda: len(got) >= 2)
    assert {topic for topic, _ in got} == {protocol.topic(replies, "ok")}
    assert all(correlation == b"c-1" for _, correlation in got)


def _seen_sizes(link: Any) -> list[int]:
    """The payload size of every message the link hands its handler from now on."""
    handler, sizes = link.on_message, []

    def counting(message: Any) -> None:
        sizes.append(len(message.payload))
        handler(message)

    link.on_message = counting
    return sizes


OVERSIZED = 3 << 20  # over the node's incoming bound (1 MiB: control.max_payload_kb is 16)


def test_an_oversized_packet_is_discarded_by_an_mqtt5_broker(node: Service, operator: Operator,
                                                            raw: RawClient) -> None:
    """The node tells the broker its bound at CONNECT: Mosquitto never sends the 3 MiB
    message, so the link neither reads it nor drops its connection."""
    link = node.link
    assert link is not None
    assert link.settings.max_incoming_bytes == 1 << 20
    sizes, connects = _seen_sizes(link), link.status.connects
    raw.publish(cmd_topic("ping"), b"x" * OVERSIZED)
    raw.publish(cmd_topic("ping"), b"{}")  # after it, in order: junk the controller refuses
    assert raw.drain()
    assert wait_until(lambda: 2 in sizes)
    assert pinged(operator)["status"] == "succeeded"
    assert max(sizes) < 1 << 20 and link.status.connects == connects
    assert link.status.faults.get("oversized_packet", 0) == 0
    assert link.alive and link.status.state == "connected"


def test_an_oversized_packet_ends_an_mqtt311_connection_unread(
        tmp_path: Path, broker: Broker, key: Ed25519PrivateKey, operator: Operator,
        raw: RawClient) -> None:
    """MQTT 3.1.1 cannot tell the broker a bound: the link refuses the packet's body before
    paho buffers a byte of it, counts it, connects again (backing off: a retained one would
    come back) and goes on."""
    config = node_config(tmp_path, copy_board(BOARD, tmp_path), broker, key, allow=["ping"])
    config["inference"] = {"enabled": False}
    config["mqtt"]["protocol"] = "3.1.1"
    with running_node(config) as node:
        link = node.link
        assert link is not None
        sizes, connects = _seen_sizes(link), link.status.connects
        taken: list[int] = []
        client = link._client
        assert client is not None
        receive = client._sock_recv

        def reading(bufsize: int) -> bytes:
            data = receive(bufsize)
            taken.append(len(data))
            return data

        client._sock_recv = reading  # type: ignore[method-assign]
        raw.publish(cmd_topic("ping"), b"x" * OVERSIZED)
        assert raw.drain()
        assert wait_until(lambda: link.status.faults.get("oversized_packet", 0) == 1)
        assert wait_until(lambda: link.status.connects == connects + 1 and
                          link.status.subscribed, 20)
        assert pinged(operator)["status"] == "succeeded"
        assert max(taken) < 1 << 20  # not one read of the body
        assert sizes and max(sizes) < 1 << 20
        assert link.alive and link.status.state == "connected"


def test_a_link_thread_that_dies_is_reported_and_restarted(
        node: Service, operator: Operator, broker: Broker,
        monkeypatch: pytest.MonkeyPatch) -> None:
    link = node.link
    assert link is not None
    watcher = Subscriber(broker, [protocol.topic(ROOT, protocol.STATE),
                                  protocol.topic(ROOT, protocol.EVENT)], client_id="watch")
    assert wait_until(lambda: watcher.on("state"))
    pump = link._pump
    faults = iter([True])

    def failing_pump(client: Any) -> None:
        if next(faults, False):
            raise RuntimeError("injected fault in the link thread")
        pump(client)

    monkeypatch.setattr(link, "_pump", failing_pump)
    monkeypatch.setattr(health, "LINK_RESTARTS", 0)  # first: no restart allowed
    link.wake()
    try:
        assert wait_until(lambda: not link.alive)
        status = node.tick()
        assert status["link"]["state"] == "dead"  # never "connected"
        assert any("the link thread died" in p and "injected fault" in p
                   for p in status["problems"])
        assert any("not restarted again" in p for p in status["problems"])
        assert not link.alive
        problem = node.liveness.problem()
        assert problem is not None and "MQTT link" in problem  # no WATCHDOG=1
        assert wait_until(lambda: watcher.on("state")[-1]["state"] == "offline")  # Last Will

        monkeypatch.setattr(health, "LINK_RESTARTS", 5)
        node.tick()
        assert link.alive and link.status.restarts == 1
        assert wait_until(lambda: link.status.subscribed, 20)  # a ping now reaches it
        assert link.status.state == "connected"
        assert node.liveness.problem() is None
        assert pinged(operator)["status"] == "succeeded"
        assert wait_until(lambda: any(e["type"] == "link_restarted"
                                      for e in watcher.on("event")))
        restarted = next(e for e in watcher.on("event") if e["type"] == "link_restarted")
        assert "injected fault" in restarted["error"]
        assert wait_until(lambda: watcher.on("state")[-1]["state"] == "degraded")
        assert "the link thread died" in watcher.on("state")[-1]["reason"]
        assert node.tick()["link"]["state"] == "connected"
    finally:
        watcher.close()


def test_a_junk_burst_loses_no_signed_reply(node: Service, operator: Operator,
                                            raw: RawClient, key: Ed25519PrivateKey) -> None:
    link = node.link
    assert link is not None
    flood = list(junk(key, f"node:{NODE}", 1500))
    pings = []
    for n, (_kind, payload) in enumerate(flood):
        raw.publish(cmd_topic("ping"), payload)
        if n % 50 == 0:  # 30 signed pings among the junk, sent while it is on the wire
            pings.append(operator.send(NODE, "ping")["id"])
    assert raw.drain()
    finals = {command_id: operator.final(command_id, NODE, 60)["status"]
              for command_id in pings}
    assert list(finals.values()) == ["succeeded"] * len(pings)
    assert link.alive and link.status.faults.get("thread_died", 0) == 0


# -- the fuzzer -------------------------------------------------------------------------------

TEXT = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x2FFF,
                             blacklist_categories=("Cs", "Cc")), max_size=40)
NASTY = [b"", b"null", b"[]", b"{}", b"[" * 5000, b"{\"a\":" * 3000, b'"\\ud800"',
         b'{"id": "\\udfff", "command": "ping", "sig": null}', b"NaN", b"1e99999",
         b'{"command": "ping", "args": {"n": Infinity}}', b"\xff\xfe\x00", b"\x00" * 100]
PAYLOADS = st.one_of(st.binary(max_size=3000), st.sampled_from(NASTY),
                     st.recursive(st.none() | st.booleans() | st.integers() | TEXT,
                                  lambda inner: st.lists(inner, max_size=4)
                                  | st.dictionaries(TEXT, inner, max_size=4),
                                  max_leaves=20).map(lambda v: json.dumps(v).encode()))
TOPICS = st.sampled_from([cmd_topic("ping"), cmd_topic("apply-profile"), cmd_topic("x"),
                          cmd_topic("ping", protocol.scope_root(FLEET, protocol.ALL)),
                          protocol.topic(ROOT, protocol.DESIRED),
                          protocol.topic(protocol.scope_root(FLEET, "group/line-a"),
                                         protocol.DESIRED)])
RESPONSE_TOPICS = st.one_of(st.none(), TEXT, st.sampled_from(
    ["+", "#", f"{protocol.operator_root(FLEET)}/+/r", f"{protocol.operator_root(FLEET)}/#",
     f"{protocol.operator_root(FLEET)}/ok", f"{protocol.operator_root(FLEET)}/" + "y" * 300]))


def test_fuzzed_payloads_and_properties_never_silence_the_node(
        node: Service, operator: Operator, raw: RawClient, broker: Broker) -> None:
    link = node.link
    assert link is not None
    telemetry = Subscriber(broker, [protocol.topic(ROOT, protocol.TELEMETRY)],
                           client_id="telemetry")

    @settings(max_examples=60, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(topic=TOPICS, payload=PAYLOADS, response_topic=RESPONSE_TOPICS,
           correlation=st.none() | st.binary(max_size=64),
           user=st.lists(st.tuples(TEXT, TEXT), max_size=3),
           content_type=st.none() | TEXT)
    def case(topic: str, payload: bytes, response_topic: str | None,
             correlation: bytes | None, user: list[tuple[str, str]],
             content_type: str | None) -> None:
        raw.publish(topic, payload, properties(response_topic, correlation, user, content_type))
        assert raw.drain(20)
        assert pinged(operator)["status"] == "succeeded"  # after the case: answered
        assert link.alive and link.status.state == "connected"

    try:
        case()
        assert link.status.faults.get("thread_died", 0) == 0
        assert wait_until(lambda: len(telemetry.on("telemetry")) >= 5)
        records = telemetry.on("telemetry")
    finally:
        telemetry.close()
    assert telemetry_gaps(records) == {}
    assert len({r["session"] for r in records}) == 1  # the link never reconnected
