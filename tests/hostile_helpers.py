"""What someone who can publish to the broker sends: a raw MQTT 5 client that publishes as
fast as paho allows (no wait per message), junk of every kind, and the telemetry gap check.

Shared by tests/test_hostile_link.py and bench/control.py.
"""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Iterator
from typing import Any

import paho.mqtt.client as mqtt
from control_helpers import sign
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from mqtt_helpers import Broker, wait_until
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties


class RawClient:
    """An MQTT 5 client with its own network thread; ``publish`` queues and returns."""

    def __init__(self, broker: Broker, client_id: str) -> None:
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id,
                                  protocol=mqtt.MQTTv5)
        self.client.max_queued_messages_set(0)  # unlimited: the flood is queued in full
        self.connected = threading.Event()
        self.client.on_connect = lambda c, u, f, code, p: self.connected.set()
        self.client.connect(broker.host, broker.port, keepalive=30)
        self.client.loop_start()
        assert self.connected.wait(10)
        self.infos: list[mqtt.MQTTMessageInfo] = []

    def publish(self, topic: str, payload: bytes, properties: Properties | None = None,
                retain: bool = False) -> None:
        self.infos.append(self.client.publish(topic, payload, qos=1, retain=retain,
                                              properties=properties))

    def drain(self, seconds: float = 60) -> bool:
        """Every message published so far acknowledged by the broker."""
        return wait_until(lambda: all(i.is_published() for i in self.infos), seconds, 0.05)

    def close(self) -> None:
        """What loop_stop() alone waited for, every publish acknowledged while the link is
        up, then a disconnect, which wakes paho's network thread so that it ends at once
        (loop_stop() alone waits out the thread's one-second select)."""
        wait_until(lambda: not self.client.is_connected()
                   or all(i.is_published() for i in self.infos), 60)
        self.client.disconnect()
        self.client.loop_stop()


def properties(response_topic: str | None = None, correlation: bytes | None = None,
               user: list[tuple[str, str]] | None = None,
               content_type: str | None = None) -> Properties:
    props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    if response_topic is not None:
        props.ResponseTopic = response_topic
    if correlation is not None:
        props.CorrelationData = correlation
    if user:
        props.UserProperty = user
    if content_type is not None:
        props.ContentType = content_type
    return props


JUNK_KINDS = ("unsigned", "malformed", "deep", "bad_signature", "unknown_key")


def junk(key: Ed25519PrivateKey, target: str, count: int) -> Iterator[tuple[str, bytes]]:
    """``count`` (kind, payload) for a ping command, cycling through JUNK_KINDS; nothing a
    node may run: no signature, not an envelope, nested past any parser's recursion limit,
    a signature that does not match, or one by a key the node does not trust."""
    template = sign(key, "ping", target, {})
    stranger = sign(Ed25519PrivateKey.generate(), "ping", target, {})
    for n, kind in zip(range(count), itertools.cycle(JUNK_KINDS), strict=False):
        tag = f"junk-{n}"
        if kind == "unsigned":
            body: Any = {k: v for k, v in template.items() if k != "sig"} | {"id": tag}
        elif kind == "malformed":
            yield kind, f'{{"id": "{tag}", "command": "ping", '.encode()
            continue
        elif kind == "deep":
            yield kind, b"[" * 5000 + b"]" * 5000
            continue
        elif kind == "bad_signature":
            body = {**template, "id": tag}  # the signature covers the id
        else:
            body = {**stranger, "id": tag}
        yield kind, json.dumps(body).encode()


def telemetry_gaps(records: list[dict[str, Any]]) -> dict[int, list[int]]:
    """session -> the seq numbers missing between its first and last record seen."""
    seen: dict[int, set[int]] = {}
    for record in records:
        seen.setdefault(record["session"], set()).add(record["seq"])
    return {session: sorted(set(range(min(seqs), max(seqs) + 1)) - seqs)
            for session, seqs in seen.items()
            if set(range(min(seqs), max(seqs) + 1)) - seqs}
