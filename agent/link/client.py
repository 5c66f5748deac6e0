"""A fresh paho client for one connect: protocol, Last Will, TLS, credentials, and callbacks
that only append to the link thread's queues (so none of them can raise into paho)."""

from __future__ import annotations

from collections import deque
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion

from agent.link.delivery import IN_FLIGHT
from agent.link.settings import LinkSettings, read_password


def new_client(s: LinkSettings, will_topic: str, will: bytes, events: deque[tuple[Any, ...]],
               inbox: deque[mqtt.MQTTMessage]) -> mqtt.Client:
    version = MQTTProtocolVersion.MQTTv5 if s.protocol == "5" else MQTTProtocolVersion.MQTTv311
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=s.client_id, protocol=version,
                         clean_session=None if version == MQTTProtocolVersion.MQTTv5 else True)
    client.max_inflight_messages_set(IN_FLIGHT)
    client.connect_timeout = 5.0
    client.will_set(will_topic, will, qos=1, retain=True)
    if s.tls:
        client.tls_set(ca_certs=s.tls_ca, certfile=s.tls_cert, keyfile=s.tls_key)
    if s.username is not None:
        client.username_pw_set(s.username, read_password(s.password_file))  # rotation
    client.on_connect = lambda c, u, flags, code, props: events.append(("connack", code))
    client.on_disconnect = lambda c, u, flags, code, props: events.append(("gone", code))
    client.on_publish = lambda c, u, mid, code, props: events.append(("ack", mid, code))
    client.on_message = lambda c, u, message: inbox.append(message)
    client.on_subscribe = lambda c, u, mid, codes, props: events.append(("suback",))
    return client
