"""A fresh paho client for one connect: protocol, Last Will, TLS, credentials, a bound on
what it takes in, and callbacks that only append to the link thread's queues (so none of
them can raise into paho)."""

from __future__ import annotations

from collections import deque
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.subscribeoptions import SubscribeOptions

from agent.link.delivery import IN_FLIGHT
from agent.link.settings import LinkSettings, read_password
from agent.link.sockets import no_delay


class OversizedPacket(ConnectionAbortedError):
    """An incoming packet over the link's bound: the connection ends before its body is
    read (paho reports the connection lost, and the link connects again)."""


class BoundedClient(mqtt.Client):
    """paho reads a packet's header a byte at a time, then asks the socket for the whole
    remaining length at once, and keeps whatever it is: up to the 256 MB MQTT allows, from
    anyone the broker lets publish to the node's topics.  A read of more than
    ``max_packet_bytes`` is such a packet's body, refused before a byte of it is taken
    (``events`` gets ``("oversized", why)``).  MQTT 5 brokers are also told the bound at
    CONNECT, and discard such a packet instead of sending it."""

    def __init__(self, *args: Any, max_packet_bytes: int, events: deque[tuple[Any, ...]],
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_packet_bytes, self._events = max_packet_bytes, events

    def _sock_recv(self, bufsize: int) -> bytes:
        if bufsize > self.max_packet_bytes:
            message = (f"an incoming packet of {bufsize} bytes is over the link's bound of "
                       f"{self.max_packet_bytes}")
            self._events.append(("oversized", message))
            raise OversizedPacket(message)
        return super()._sock_recv(bufsize)


def connect_properties(s: LinkSettings) -> Properties | None:
    """MQTT 5's CONNECT properties: the largest packet the node takes (the broker must not
    send a larger one); None for 3.1.1, which has no such property."""
    if s.protocol != "5":
        return None
    properties = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
    properties.MaximumPacketSize = s.max_incoming_bytes
    return properties


def connect(client: mqtt.Client, s: LinkSettings, host: str, port: int) -> None:
    """TCP (and TLS) connected to ``host`` (one of the broker list) and CONNECT sent, with
    MQTT 5's bound on what comes in."""
    client.connect(host, port, s.keepalive_s, properties=connect_properties(s))
    no_delay(client.socket())


def new_client(s: LinkSettings, will_topic: str, will: bytes, events: deque[tuple[Any, ...]],
               inbox: deque[mqtt.MQTTMessage], client_id: str | None = None) -> mqtt.Client:
    """A paho client for one connection (``client_id``: another than the node's)."""
    version = MQTTProtocolVersion.MQTTv5 if s.protocol == "5" else MQTTProtocolVersion.MQTTv311
    client = BoundedClient(CallbackAPIVersion.VERSION2, client_id=client_id or s.client_id,
                           protocol=version, max_packet_bytes=s.max_incoming_bytes,
                           events=events,
                           clean_session=None if version == MQTTProtocolVersion.MQTTv5 else True)
    client.max_inflight_messages_set(IN_FLIGHT)
    client.connect_timeout = 5.0
    client.will_set(will_topic, will, qos=1, retain=s.retain)
    if s.tls:
        client.tls_set(ca_certs=s.tls_ca, certfile=s.tls_cert, keyfile=s.tls_key)
    if s.username is not None:
        client.username_pw_set(s.username, read_password(s.password_file))  # rotation
    # with the properties: a CONNACK's or DISCONNECT's may name the server to use instead
    client.on_connect = lambda c, u, flags, code, props: events.append(("connack", code, props))
    client.on_disconnect = lambda c, u, flags, code, props: events.append(("gone", code, props))
    client.on_publish = lambda c, u, mid, code, props: events.append(("ack", mid, code))
    client.on_message = lambda c, u, message: inbox.append(message)
    client.on_subscribe = lambda c, u, mid, codes, props: events.append(
        ("suback", [getattr(code, "is_failure", False) for code in codes]))
    return client


def subscribe(client: mqtt.Client, s: LinkSettings, patterns: tuple[str, ...]) -> None:
    """At QoS 1, or 0 on a broker list (a cluster's members: RabbitMQ 3.10 keeps a QoS 1
    subscription in a queue on the member it was made on, and refuses the same client id
    the same subscription elsewhere while that member is down; a command's delivery rests
    on the operator sending it again on a move and on the node's birth, and on its store).
    MQTT 5 keeps the retain flag as published, so a command sent retained is recognised
    (and refused) even when it arrives live."""
    qos = subscription_qos(s.brokers)
    options: Any = SubscribeOptions(qos=qos, retainAsPublished=True) if s.protocol == "5" \
        else qos
    client.subscribe([(pattern, options) for pattern in patterns])


def renew(client: mqtt.Client, s: LinkSettings, patterns: tuple[str, ...]) -> None:
    """The subscriptions made anew on the connection (UNSUBSCRIBE, then SUBSCRIBE: a broker
    takes them in order): a binding a cluster member lost while the SUBSCRIBE stood
    acknowledged is bound again (see agent.link.probe)."""
    client.unsubscribe(list(patterns))
    subscribe(client, s, patterns)


def subscription_qos(brokers: tuple[str, ...]) -> int:
    """The QoS to subscribe at: 0 with more than one member (see ``subscribe``)."""
    return 0 if len(brokers) > 1 else 1
