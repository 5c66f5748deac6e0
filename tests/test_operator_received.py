"""What an operator session keeps of the nodes' telemetry, on a real Mosquitto: a copy of a
record (same node, session and seq: at-least-once delivery, a replay after a failover) is
dropped; the newest record per node stands; a watch keeps no log however long it runs."""

from __future__ import annotations

import json
from typing import Any

import paho.mqtt.client as mqtt
from mqtt_helpers import Broker, wait_until
from paho.mqtt.enums import CallbackAPIVersion

from agent import protocol
from agent.control import operator
from agent.control.operator import BrokerSettings
from agent.control.received import Telemetry

FLEET = "lab"


def record(session: int, seq: int, ts: int, historical: bool = False) -> dict[str, Any]:
    return {"schema": "telemetry/1", "session": session, "seq": seq, "ts": ts,
            "mono_ms": ts, "clock_synced": True, "historical": historical, "metrics": {}}


def publish(broker: Broker, items: list[tuple[str, Any]]) -> None:
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="test-node-publisher")
    client.connect(broker.host, broker.port)
    client.loop_start()
    try:
        for node, payload in items:
            body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
            client.publish(f"edge/v1/{FLEET}/{node}/telemetry", body, qos=1).wait_for_publish(10)
    finally:
        client.disconnect()
        client.loop_stop()


def test_copies_are_dropped_and_the_newest_record_per_node_stands(broker: Broker) -> None:
    bus = operator.connect(BrokerSettings(host=broker.host, port=broker.port), FLEET,
                           [protocol.TELEMETRY])
    try:
        items: list[tuple[str, Any]] = [
            ("a", record(1, 0, 100)), ("a", record(1, 1, 200)),
            ("a", record(1, 1, 200)),  # the copy a failover's replay makes
            ("b", record(7, 0, 150)),
            ("a", record(2, 0, 300)),  # a new session numbers from 0 again: not a copy
            ("a", record(1, 2, 250, historical=True)),  # replayed after a live one
            ("a", b"[1, 2]"), ("a", b"not json"),  # hostile: no crash, nothing kept
            ("b", record(7, 1, 160))]
        publish(broker, items)
        assert wait_until(lambda: len(bus.messages) >= 6, 10), bus.messages
        with bus.lock:
            keys = [(t.split("/")[3], p["session"], p["seq"]) for t, p in bus.messages]
        assert keys == [("a", 1, 0), ("a", 1, 1), ("b", 7, 0), ("a", 2, 0), ("a", 1, 2),
                        ("b", 7, 1)]
        assert bus.telemetry.duplicates == 1
        nodes = bus.nodes()
        assert nodes["a"]["telemetry"]["seq"] == 0 and nodes["a"]["telemetry"]["session"] == 2
        assert nodes["b"]["telemetry"]["seq"] == 1
    finally:
        bus.close()


def test_a_watch_keeps_the_newest_per_node_and_no_log(broker: Broker) -> None:
    bus = operator.connect(BrokerSettings(host=broker.host, port=broker.port), FLEET,
                           [protocol.TELEMETRY])
    bus.log = False  # as fleet watch sets it
    try:
        publish(broker, [(f"n{i % 5}", record(1, i // 5, 1000 + i)) for i in range(500)])
        assert wait_until(lambda: len(bus.nodes()) == 5 and all(
            facts["telemetry"]["seq"] == 99 for facts in bus.nodes().values()), 10), \
            bus.nodes()
        assert bus.messages == []
    finally:
        bus.close()


def test_what_is_kept_is_bounded_per_node_and_in_nodes() -> None:
    kept = Telemetry(recent=4, max_nodes=2)
    assert all(kept.take("t/a", record(1, seq, seq)) for seq in range(10))
    assert kept.take("t/a", record(1, 3, 3))  # past the window: not recognised, kept
    assert not kept.take("t/a", record(1, 9, 9))
    assert kept.take("t/b", record(1, 0, 0))
    assert not kept.take("t/c", record(1, 0, 0)) and kept.untracked == 1
    assert set(kept.newest) == {"t/a", "t/b"} and kept.newest["t/a"]["seq"] == 9
