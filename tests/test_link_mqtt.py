"""The MQTT link with its outbox against a real Mosquitto on a free loopback port."""

from __future__ import annotations

import itertools
import json
import threading
from pathlib import Path
from typing import Any

import pytest
from mqtt_helpers import Broker, Subscriber, TlsFiles, make_test_ca, wait_until

from agent.link import delivery
from agent.link.mqtt import MqttLink
from agent.link.settings import LinkSettings, LinkStatus, backoff_delay
from agent.telemetry.outbox import Outbox
from agent.telemetry.records import Sequence, encode
from agent.telemetry.sampler import FunctionCollector, Sampler

ROOT = "edge/v1/test/node-1"


class Agent:
    """The link, outbox and a sampler as the service wires them, without the rest."""

    def __init__(self, state: Path, broker: Broker, interval_s: float = 0.1,
                 **settings: Any) -> None:
        self.outbox = Outbox(state / "outbox.sqlite", max_bytes=1 << 20, max_age_s=3600)
        self.sequence = Sequence(self.outbox.bump("session"))
        self.counter = itertools.count()
        options: dict[str, Any] = {"host": broker.host, "port": broker.port,
                                   "reconnect_min_s": 0.1, "reconnect_max_s": 0.5, **settings}
        self.link = MqttLink(LinkSettings(client_id="node-1", topic_root=ROOT, **options),
                             self.outbox, self.sequence,
                             announce=lambda session: [(f"{ROOT}/birth", encode(
                                 {"schema": "birth/1", "session": session}))])
        self.sampler = Sampler([FunctionCollector("count", lambda: next(self.counter))],
                               self.outbox, self.sequence, f"{ROOT}/telemetry", interval_s,
                               64 * 1024)

    def start(self) -> None:
        self.link.start()
        self.sampler.start()

    def stop(self) -> None:
        self.sampler.stop()
        self.link.stop(flush_s=2)
        self.outbox.close()


def by_session(records: list[dict[str, Any]]) -> dict[int, list[int]]:
    """seq numbers per session in arrival order, duplicates removed (first copy kept)."""
    seen: set[tuple[int, int]] = set()
    result: dict[int, list[int]] = {}
    for record in records:
        key = (record["session"], record["seq"])
        if key not in seen:
            seen.add(key)
            result.setdefault(record["session"], []).append(record["seq"])
    return result


def test_birth_state_and_rising_telemetry(tmp_path: Path, broker: Broker) -> None:
    watcher = Subscriber(broker, [f"{ROOT}/#"])
    agent = Agent(tmp_path, broker)
    agent.start()
    try:
        assert wait_until(lambda: len(watcher.on("telemetry")) >= 10)
        state, birth = watcher.on("state")[0], watcher.on("birth")[0]
        assert state["state"] == "online" and state["schema"] == "state/1"
        assert birth["session"] == state["session"] == agent.link.status.session
        telemetry = [r for r in watcher.on("telemetry") if r["session"] == state["session"]]
        seqs = [r["seq"] for r in telemetry]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # +1 each, no gap
        assert all(r["historical"] is False for r in telemetry)
        assert telemetry[-1]["metrics"]["count"] > telemetry[0]["metrics"]["count"]
        late = Subscriber(broker, [f"{ROOT}/state", f"{ROOT}/birth"], client_id="late")
        assert wait_until(lambda: late.on("state") and late.on("birth"))
        assert [retained for _, _, retained in late.messages] == [True, True]
        late.close()
    finally:
        agent.stop()
        watcher.close()
    after = Subscriber(broker, [f"{ROOT}/state"], client_id="after")
    assert wait_until(lambda: after.on("state"))
    assert after.on("state")[-1]["state"] == "stopped"  # a clean stop, not the Last Will
    after.close()


def test_outage_loses_nothing_and_replays_in_order(tmp_path: Path, broker: Broker) -> None:
    watcher = Subscriber(broker, [f"{ROOT}/telemetry"], client_id="outage-watch", clean=False)
    agent = Agent(tmp_path, broker, interval_s=0.025)  # 40 Hz
    agent.start()
    try:
        assert wait_until(lambda: len(watcher.on("telemetry")) >= 10)
        session = agent.link.status.session
        broker.stop()
        # the outage lasts until 50 records wait in the outbox (about 1.3 s at 40 Hz)
        assert wait_until(lambda: agent.outbox.depth >= 50, 30)
        broker.start()
        assert wait_until(lambda: agent.link.status.session > session, 10)
        taken = agent.link.status.sessions_ended[session]  # records the session took
        assert wait_until(lambda: len(by_session(watcher.on("telemetry")).get(session, []))
                          >= taken, 15)
    finally:
        agent.stop()
        records = watcher.on("telemetry")
        watcher.close()
    seqs = by_session(records)[session]
    assert seqs == list(range(taken))  # every seq once, in order, after de-duplication
    historical = {r["seq"] for r in records if r["session"] == session and r["historical"]}
    assert len(historical) >= 45  # the 50 records taken without a broker were replayed
    assert seqs[-1] in historical
    live = [r for r in records if r["session"] > session]
    assert live and not any(r["historical"] for r in live)


def test_a_restart_delivers_what_the_outbox_kept(tmp_path: Path, broker: Broker) -> None:
    offline = Outbox(tmp_path / "outbox.sqlite", max_bytes=1 << 20, max_age_s=3600)
    sequence = Sequence(offline.bump("session"))
    sampler = Sampler([FunctionCollector("n", lambda: 1)], offline, sequence,
                      f"{ROOT}/telemetry", 1.0, 64 * 1024)
    for _ in range(25):
        sampler.sample_once()
    session = sequence.session
    offline.close()
    watcher = Subscriber(broker, [f"{ROOT}/telemetry"])
    assert wait_until(watcher.subscribed.is_set)
    agent = Agent(tmp_path, broker, interval_s=10)
    agent.start()
    try:
        assert wait_until(lambda: len(by_session(watcher.on("telemetry")).get(session, []))
                          == 25, 10)
    finally:
        agent.stop()
        watcher.close()
    replayed = [r for r in watcher.on("telemetry") if r["session"] == session]
    assert [r["seq"] for r in replayed][:25] == list(range(25))
    assert all(r["historical"] for r in replayed)


def test_tls_with_client_certificates(tmp_path: Path) -> None:
    tls: TlsFiles = make_test_ca(tmp_path / "ca")
    server = Broker(tmp_path / "tls-broker", tls=tls)
    server.start()
    try:
        watcher = Subscriber(server, [f"{ROOT}/#"], tls=tls)
        agent = Agent(tmp_path, server, tls=True, tls_ca=str(tls.ca),
                      tls_cert=str(tls.client_cert), tls_key=str(tls.client_key))
        agent.start()
        assert wait_until(lambda: len(watcher.on("telemetry")) >= 3)
        agent.stop()
        watcher.close()
    finally:
        server.stop()


def test_a_wrong_password_is_reported_and_retried(tmp_path: Path) -> None:
    server = Broker(tmp_path / "auth-broker", users={"node-1": "right"})
    server.start()
    secret = tmp_path / "password"
    secret.write_text("wrong\n")
    agent = Agent(tmp_path, server, username="node-1", password_file=str(secret))
    agent.start()
    try:
        assert wait_until(lambda: agent.link.status.last_error is not None
                          and "refused" in agent.link.status.last_error)
        error = agent.link.status.last_error
        assert "mqtt.username and mqtt.password_file" in str(error)
        assert agent.link.status.connects == 0
        secret.write_text("right\n")  # read again on every attempt: a fix needs no restart
        assert wait_until(lambda: agent.link.status.state == "connected", 10)
        assert agent.link.status.last_error is None
    finally:
        agent.stop()
        server.stop()


def test_backoff_grows_with_jitter_and_stays_bounded() -> None:
    delays = [backoff_delay(attempt, 0.5, 30) for attempt in range(12)]
    assert 0.25 <= delays[0] <= 0.5
    assert all(15 <= d <= 30 for d in delays[7:])
    spread = {round(backoff_delay(3, 0.5, 30), 6) for _ in range(20)}
    assert len(spread) > 10 and all(2 <= d <= 4 for d in spread)


def test_a_record_above_the_payload_limit_is_refused(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path / "o.sqlite", max_bytes=1 << 20, max_age_s=3600)
    sampler = Sampler([FunctionCollector("blob", lambda: "x" * 2000)], outbox, Sequence(1),
                      f"{ROOT}/telemetry", 1.0, max_payload_bytes=1024)
    record = sampler.sample_once()
    assert record["seq"] == 0 and sampler.oversized == 1 and outbox.depth == 0
    outbox.close()


class RecordingClient:
    """What ``Delivery.fill`` publishes: (record's seq-session, historical) in order."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, bool]] = []
        self.mid = itertools.count(1)

    def publish(self, topic: str, payload: bytes, qos: int) -> Any:
        document = json.loads(payload)
        self.sent.append((document["session"], document["historical"]))
        return type("Info", (), {"mid": next(self.mid)})()


def test_a_connect_marks_the_backlog_between_two_records_never_inside_one(
        tmp_path: Path) -> None:
    """The sampler numbers a record and queues it as one step, and a connect switches the
    session and marks its backlog under the same lock: a record numbered in the ended
    session is always in the backlog (replayed as historical), one of the new session never
    is.  Seen under QEMU: a connect between a record's numbering and its queueing sent a
    record of the new session marked historical."""
    numbered, connected = threading.Event(), threading.Event()

    class HeldOutbox(Outbox):
        def put(self, topic: str, payload: bytes) -> int:
            numbered.set()
            connected.wait(1.0)  # the connect is held back until this record is queued
            return super().put(topic, payload)

    outbox = HeldOutbox(tmp_path / "o.sqlite", max_bytes=1 << 20, max_age_s=3600)
    sequence = Sequence(1)
    sampler = Sampler([FunctionCollector("n", lambda: 1)], outbox, sequence,
                      f"{ROOT}/telemetry", 1.0, max_payload_bytes=1 << 16)
    link = delivery.Delivery(LinkSettings(client_id="node-1", topic_root=ROOT), outbox,
                             LinkStatus())

    def connect() -> None:
        sequence.begin(2, link.begin)
        connected.set()

    sampling = threading.Thread(target=sampler.sample_once)
    sampling.start()
    assert numbered.wait(10)
    connecting = threading.Thread(target=connect)
    connecting.start()
    sampling.join(10)
    connecting.join(10)
    assert sampler.last is not None and sampler.last["session"] == 1
    sampler.sample_once()  # session 2's first record: live, not replayed
    assert wait_until(lambda: outbox.last_id() == 2)
    client = RecordingClient()
    assert wait_until(lambda: (link.fill(client, 10),  # type: ignore[arg-type]
                               len(client.sent) == 2)[1])  # the replay as its rate allows
    assert client.sent == [(2, False), (1, True)]  # live first, then the backlog, historical
    outbox.close()


def test_mqtt_3_1_1_works_the_same(tmp_path: Path, broker: Broker) -> None:
    watcher = Subscriber(broker, [f"{ROOT}/#"])
    agent = Agent(tmp_path, broker, protocol="3.1.1")
    agent.start()
    try:
        assert wait_until(lambda: len(watcher.on("telemetry")) >= 3)
        assert watcher.on("state")[0]["state"] == "online" and watcher.on("birth")
    finally:
        agent.stop()
        watcher.close()


def test_an_ack_with_nothing_else_in_flight_leaves_the_outbox_at_once(
        tmp_path: Path, broker: Broker, monkeypatch: pytest.MonkeyPatch) -> None:
    """At 1 Hz the record a second must not show as waiting after its PUBACK: acks are
    batched only while more are in flight (a batch window of 30 s would show it here)."""
    monkeypatch.setattr(delivery, "ACK_BATCH_S", 30.0)
    agent = Agent(tmp_path, broker, interval_s=3600.0)  # the first sample, then none
    agent.start()
    try:
        assert wait_until(lambda: agent.link.status.acked >= 1)
        assert wait_until(lambda: agent.outbox.depth == 0, 10)
    finally:
        agent.stop()
