"""Failover between the members of a broker list, on real Mosquittos (no bridge between
them: what is tested is the node's side), and MQTT 5 redirects from a test-only server
(``fake_mqtt5``), as Mosquitto sends none."""

from __future__ import annotations

import itertools
import json
import logging
import random
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agent_process import start_agent, status, write_config
from fake_mqtt5 import RedirectingServer
from mqtt_helpers import Broker, Subscriber, free_port, wait_until

from agent.link.brokers import Brokers
from agent.link.mqtt import MqttLink
from agent.link.settings import LinkSettings
from agent.telemetry.outbox import Outbox
from agent.telemetry.outbox_db import Record
from agent.telemetry.records import Sequence, encode
from agent.telemetry.sampler import FunctionCollector, Sampler

ROOT = "edge/v1/test/node-1"
USE_ANOTHER_SERVER, SERVER_MOVED = 0x9C, 0x9D


def kill(broker: Broker) -> None:
    """A member dies: SIGKILL, nothing said to its clients."""
    assert broker.process is not None
    broker.process.send_signal(signal.SIGKILL)
    broker.process.wait(10)
    broker.process = None


@pytest.fixture()
def members(tmp_path: Path) -> Iterator[list[Broker]]:
    started = [Broker(tmp_path / f"member-{index}") for index in range(2)]
    for broker in started:
        broker.start()
    yield started
    for broker in started:
        broker.stop()


def in_node_order(client_id: str, wanted: list[str]) -> list[str]:
    """The list to configure so that node ``client_id`` tries ``wanted`` in that order (its
    order is a shuffle seeded by its id, whatever the names are)."""
    probe = Brokers([(f"h{index}", 1) for index in range(len(wanted))], client_id, 1, 1)
    listed = [""] * len(wanted)
    for position, member in enumerate(probe.members):
        listed[int(member.host[1:])] = wanted[position]
    return listed


class Node:
    """The link, its outbox and a 10 Hz sampler, as the service wires them; every failover
    event is kept, and every record a member acknowledged (it leaves the outbox then), by
    member."""

    def __init__(self, state: Path, brokers: list[str], **settings: Any) -> None:
        self.outbox = Outbox(state / "outbox.sqlite", max_bytes=1 << 20, max_age_s=3600)
        self.sequence = Sequence(self.outbox.bump("session"))
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.acked: dict[str, set[tuple[int, int]]] = {}
        delete = self.outbox.delete

        def deleted(records: list[Record]) -> None:
            acked = self.acked.setdefault(self.link.status.broker, set())
            acked.update(seq_of(record) for record in records)
            delete(records)

        self.outbox.delete = deleted  # type: ignore[method-assign]
        counter = itertools.count()
        options: dict[str, Any] = {"reconnect_min_s": 0.1, "reconnect_max_s": 0.5, **settings}
        self.link = MqttLink(
            LinkSettings(client_id="node-1", topic_root=ROOT, brokers=tuple(brokers),
                         **options),
            self.outbox, self.sequence,
            announce=lambda session: [(f"{ROOT}/birth", encode(
                {"schema": "birth/1", "session": session}))],
            event=lambda kind, **fields: self.events.append((kind, fields)))
        self.sampler = Sampler([FunctionCollector("count", lambda: next(counter))],
                               self.outbox, self.sequence, f"{ROOT}/telemetry", 0.1, 64 * 1024)

    def __enter__(self) -> Node:
        self.link.start()
        self.sampler.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.sampler.stop()
        self.link.stop(flush_s=2)
        self.outbox.close()


def seq_of(record: Record) -> tuple[int, int]:
    document = json.loads(record.payload)
    return (document["session"], document["seq"]) if "seq" in document else (0, -1)


def test_a_dead_member_fails_over_with_nothing_lost_or_sent_twice(
        tmp_path: Path, members: list[Broker]) -> None:
    addresses = [f"127.0.0.1:{broker.port}" for broker in members]
    watchers = [Subscriber(broker, [f"{ROOT}/#"], client_id=f"watch-{broker.port}")
                for broker in members]
    try:
        with Node(tmp_path, addresses) as node:
            link = node.link
            assert wait_until(lambda: link.status.state == "connected", 10)
            assert link.status.brokers == [link.status.broker, *(
                a for a in addresses if a != link.status.broker)]
            first = addresses.index(link.status.broker)
            a, b = members[first], members[1 - first]
            a_address, b_address = addresses[first], addresses[1 - first]
            b_watch = watchers[1 - first]
            assert wait_until(lambda: len(watchers[first].on("telemetry")) >= 10, 10)
            session = link.status.session
            # A stops answering, then dies: what it took meanwhile it never acknowledges
            assert a.process is not None
            a.process.send_signal(signal.SIGSTOP)
            sent = link.status.published
            assert wait_until(lambda: link.status.published >= sent + 5, 5)
            kill(a)
            assert wait_until(lambda: link.status.state == "connected"
                              and link.status.broker == b_address, 5), link.status
            taken = link.status.sessions_ended[session]  # the records of A's session
            acked_by_a = {seq for s, seq in node.acked[a_address] if s == session}
            assert acked_by_a and len(acked_by_a) < taken

            def on_b(of: int) -> list[int]:
                return [r["seq"] for r in b_watch.on("telemetry") if r["session"] == of]

            # what A did not acknowledge is replayed on B; live records follow
            assert wait_until(lambda: set(on_b(session)) >= set(range(taken)) - acked_by_a
                              and len(on_b(link.status.session)) >= 10, 10)
            events = list(node.events)
        b_session = max(r["session"] for r in b_watch.on("telemetry"))
    finally:
        for watcher in watchers:
            watcher.close()
    replayed = on_b(session)
    assert sorted(replayed) == sorted(set(replayed))  # none twice on B
    assert not acked_by_a & set(replayed)  # none that A acknowledged is sent again
    assert acked_by_a | set(replayed) == set(range(taken))  # and none is missing
    live = on_b(b_session)
    assert live == list(range(len(live)))  # B's session: from 0, no gap, none twice
    assert all(r["historical"] for r in b_watch.on("telemetry") if r["session"] == session)
    # state and birth are published again on B, with the Last Will registered there
    state = [s for s in b_watch.on("state") if s["session"] == b_session]
    assert state[0]["state"] == "online" and state[0]["broker"] == b_address
    assert [b["session"] for b in b_watch.on("birth")] == [b_session]
    assert events == [("broker_failover", {
        "from": a_address, "to": b_address,
        "reason": f"connection to {a_address} lost (Unspecified error)"})]
    assert link.status.failovers == 1 and link.status.to_dict()["broker"] == b_address
    assert b.process is None or b.process.poll() is None


def test_a_member_that_cannot_be_reached_is_skipped_at_once(tmp_path: Path,
                                                            broker: Broker) -> None:
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    live = f"127.0.0.1:{broker.port}"
    with Node(tmp_path, in_node_order("node-1", [dead, live]), reconnect_min_s=5,
              reconnect_max_s=10) as node:
        # the next member is tried without waiting for the dead one's backoff (5 s)
        assert wait_until(lambda: node.link.status.state == "connected", 3)
        assert node.link.status.broker == live and node.link.status.failovers == 1
        events = list(node.events)
    reason = events[0][1].pop("reason")
    assert events == [("broker_failover", {"from": dead, "to": live})]
    assert reason.startswith(f"cannot reach the broker {dead}: ")


@pytest.mark.parametrize(("reason", "at_connack"), [(USE_ANOTHER_SERVER, True),
                                                    (SERVER_MOVED, False)])
def test_a_redirect_to_a_listed_member_is_followed(
        tmp_path: Path, broker: Broker, reason: int, at_connack: bool,
        caplog: pytest.LogCaptureFixture) -> None:
    server = RedirectingServer(reason, f"127.0.0.1:{broker.port}", connack=at_connack)
    listed = in_node_order("node-1", [f"127.0.0.1:{server.port}",
                                      f"127.0.0.1:{broker.port}"])
    watch = Subscriber(broker, [f"{ROOT}/state"], client_id="redirect-watch")
    caplog.set_level(logging.INFO, "agent.link.mqtt")
    try:
        with Node(tmp_path, listed, reconnect_min_s=5, reconnect_max_s=10) as node:
            # the backoff (5 s) would hold it back: only the redirect moves it on at once
            assert wait_until(lambda: node.link.status.state == "connected"
                              and node.link.status.broker == f"127.0.0.1:{broker.port}", 3)
            assert server.connects == 1
            assert wait_until(lambda: watch.on("state"), 5)
            events = list(node.events)
    finally:
        server.close()
        watch.close()
    name = "use another server" if reason == USE_ANOTHER_SERVER else "server moved"
    assert events == [("broker_failover", {
        "from": f"127.0.0.1:{server.port}", "to": f"127.0.0.1:{broker.port}",
        "reason": f"127.0.0.1:{server.port} redirected the node to 127.0.0.1:{broker.port} "
                  f"({name})"})]
    assert f"redirects the node to 127.0.0.1:{broker.port} ({name})" in caplog.text


def test_a_redirect_to_an_unlisted_broker_is_refused(
        tmp_path: Path, broker: Broker, caplog: pytest.LogCaptureFixture) -> None:
    server = RedirectingServer(USE_ANOTHER_SERVER, f"127.0.0.1:{broker.port}")
    watch = Subscriber(broker, [f"{ROOT}/#"], client_id="unlisted-watch")
    caplog.set_level(logging.INFO, "agent.link.mqtt")
    try:
        assert wait_until(watch.subscribed.is_set)
        with Node(tmp_path, [f"127.0.0.1:{server.port}"]) as node:
            assert wait_until(lambda: server.connects >= 3, 10)  # it keeps trying its list
            assert node.link.status.state != "connected" and node.link.status.connects == 0
            assert node.link.status.broker == f"127.0.0.1:{server.port}"
            assert "refused the connection: Use another server" in (
                node.link.status.last_error or "")
    finally:
        server.close()
        watch.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert (f"mqtt: 127.0.0.1:{server.port} redirects the node (use another server); not "
            f"followed: '127.0.0.1:{broker.port}' is not another member of mqtt.brokers"
            ) in warnings
    assert watch.messages == []  # the node never went to the broker it was not given
    assert node.events == []


def test_a_redirect_is_followed_once(tmp_path: Path, broker: Broker,
                                     caplog: pytest.LogCaptureFixture) -> None:
    """A redirects to B, which redirects to C: B's is not followed (no chains, no loops)."""
    b = RedirectingServer(USE_ANOTHER_SERVER, f"127.0.0.1:{broker.port}")
    a = RedirectingServer(USE_ANOTHER_SERVER, f"127.0.0.1:{b.port}")
    listed = in_node_order("node-1", [f"127.0.0.1:{a.port}", f"127.0.0.1:{broker.port}",
                                      f"127.0.0.1:{b.port}"])
    caplog.set_level(logging.INFO, "agent.link.mqtt")
    try:
        with Node(tmp_path, listed) as node:
            assert wait_until(lambda: node.link.status.state == "connected", 10)
            assert node.link.status.broker == f"127.0.0.1:{broker.port}"
    finally:
        a.close()
        b.close()
    assert a.connects == 1 and b.connects == 1
    assert (f"mqtt: 127.0.0.1:{b.port} redirects the node (use another server); not "
            f"followed: 127.0.0.1:{b.port} was reached by a redirect, and a redirect is "
            "followed once") in caplog.text


def test_edge_agent_run_fails_over_and_names_the_member(tmp_path: Path,
                                                        members: list[Broker]) -> None:
    addresses = [f"127.0.0.1:{broker.port}" for broker in members]
    random.shuffle(addresses)
    topic = "edge/v1/lab/orin-1"
    config = write_config(tmp_path, 0, mqtt={"brokers": addresses, "local_broker": False,
                                             "reconnect": {"min_s": 0.1, "max_s": 0.5}},
                          inference={"enabled": False}, telemetry={"interval_s": 0.1})
    watchers = [Subscriber(broker, [f"{topic}/#"], client_id=f"run-{broker.port}")
                for broker in members]
    agent = start_agent(config)
    try:
        assert wait_until(lambda: any(w.on("telemetry") for w in watchers), 60), agent
        first = 0 if watchers[0].on("telemetry") else 1
        a_address = f"127.0.0.1:{members[first].port}"
        b_address = f"127.0.0.1:{members[1 - first].port}"
        b_watch = watchers[1 - first]
        assert watchers[first].on("birth")[-1]["broker"] == a_address
        assert watchers[first].on("telemetry")[-1]["metrics"]["link"]["broker"] == a_address
        kill(members[first])
        assert wait_until(lambda: b_watch.on("birth"), 5)
        birth = b_watch.on("birth")[-1]
        assert birth["broker"] == b_address
        assert b_watch.on("state")[-1]["broker"] == b_address
        assert wait_until(lambda: b_watch.on("event"), 10)
        event = b_watch.on("event")[0]
        assert (event["type"], event["from"], event["to"]) == (
            "broker_failover", a_address, b_address)
        assert event["reason"].startswith(f"connection to {a_address} lost")
        assert event["session"] == birth["session"]
        assert wait_until(lambda: any(
            r["metrics"]["link"]["broker"] == b_address for r in b_watch.on("telemetry")), 5)
        assert wait_until(lambda: status(config)[1].get("link", {}).get("failovers") == 1, 10)
        link = status(config)[1]["link"]
        assert link["broker"] == b_address and link["brokers"][1] == b_address
        agent.send_signal(signal.SIGKILL)  # its Last Will was registered on B
        agent.wait(10)
        assert wait_until(lambda: b_watch.on("state")[-1]["state"] == "offline", 10)
        assert b_watch.on("state")[-1]["broker"] == b_address
    finally:
        agent.kill()
        agent.communicate(timeout=30)
        for watcher in watchers:
            watcher.close()
