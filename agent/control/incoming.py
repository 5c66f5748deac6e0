"""What the controller needs of an MQTT message, read without trusting it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass
class Incoming:
    """What the controller needs of an MQTT message (paho's MQTTMessage fits)."""

    topic: str
    payload: bytes
    retain: bool = False
    response_topic: str | None = None
    correlation: bytes | None = None


def incoming_of(message: Any) -> Incoming:
    if isinstance(message, Incoming):
        return message
    properties = getattr(message, "properties", None)
    return Incoming(topic=message.topic, payload=bytes(message.payload),
                    retain=bool(message.retain),
                    response_topic=getattr(properties, "ResponseTopic", None),
                    correlation=getattr(properties, "CorrelationData", None))


def loose_id(payload: bytes) -> dict[str, Any]:
    """The id of a message that failed a check, when it has one, to address the reply: read
    leniently (a NaN elsewhere does not hide it), but never raising."""
    try:
        document = json.loads(payload)
    except (ValueError, RecursionError):
        return {}
    value = document.get("id") if isinstance(document, dict) else None
    return {"id": value} if isinstance(value, str) and len(value) <= 128 else {}
