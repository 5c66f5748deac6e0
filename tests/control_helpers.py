"""Fleet-control test parts: an operator, simulated nodes and a whole agent on a fixture copy.

A simulated node is the real link and the real controller with a ping handler, and nothing
else (no inference, no sampler), so hundreds fit in one test process.
"""

from __future__ import annotations

import resource
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from agent_process import agent_config
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from mqtt_helpers import Broker, wait_until

from agent import protocol
from agent.config import from_dict
from agent.control import envelope, operator
from agent.control.controller import Controller, Identity
from agent.control.envelope import TrustedKeys, key_id, public_key_text
from agent.control.operator import BrokerSettings
from agent.control.store import CommandStore
from agent.link.mqtt import MqttLink
from agent.link.settings import LinkSettings
from agent.service.builds import Builder
from agent.service.node import Service
from agent.telemetry.outbox import Outbox
from agent.telemetry.records import Sequence, encode

FLEET = "lab"


def sign(key: Ed25519PrivateKey, command: str, target: str, args: dict[str, Any],
         **options: Any) -> dict[str, Any]:
    """The product's signing, for fleet ``lab`` unless ``fleet`` says otherwise."""
    return envelope.sign(key, command, target, args, **{"fleet": FLEET, **options})


def unbound(key: Ed25519PrivateKey, command: str, target: str, args: dict[str, Any],
            **options: Any) -> dict[str, Any]:
    """An envelope as signed before fleets were: no ``fleet`` field, a valid signature."""
    legacy = sign(key, command, target, args, **options)
    del legacy["fleet"]
    return envelope.signed(key, legacy)


def trusted(key: Ed25519PrivateKey) -> list[dict[str, str]]:
    public = key.public_key()
    return [{"id": key_id(public), "public_key": public_key_text(public)}]


def trusted_keys(key: Ed25519PrivateKey) -> TrustedKeys:
    """What a node trusts when its config lists ``trusted(key)``."""
    control = from_dict({"control": {"trusted_keys": trusted(key)}}).control
    return TrustedKeys.from_config(control.trusted_keys)


def raise_file_limit() -> None:
    """Hundreds of nodes hold a socket and two SQLite files each."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


class Operator:
    """The product's operator client on the fleet's res topics, recording every reply; its raw
    publish also sends what a real operator never would (malformed, retained, replayed)."""

    def __init__(self, broker: Broker, key: Ed25519PrivateKey, *,
                 brokers: tuple[str, ...] = (), protocol_version: str = "5") -> None:
        """``brokers``: a broker list to roam over, in place of ``broker``;
        ``protocol_version``: "3.1.1" for a broker without MQTT 5."""
        self.key = key
        self.bus = operator.connect(BrokerSettings(host=broker.host, port=broker.port,
                                                   brokers=brokers, protocol=protocol_version),
                                    FLEET, [protocol.reply_suffix("+")])
        self.client = self.bus.client  # to watch more topics

    @property
    def replies(self) -> list[dict[str, Any]]:
        with self.bus.lock:
            return [payload for _topic, payload in self.bus.messages]

    def _by_id(self, command_id: str | None) -> list[dict[str, Any]]:
        """Under the bus lock."""
        return [payload for _topic, payload in self.bus.messages
                if payload.get("id") == command_id]

    def publish(self, topic: str, payload: bytes, retain: bool = False) -> None:
        self.bus.publish(topic, payload, retain=retain)

    def send(self, scope: str, command: str, args: dict[str, Any] | None = None,
             **sign_options: Any) -> dict[str, Any]:
        """Sign and send; ``scope`` is a node id, ``group:<g>`` or ``all``."""
        target, topic_scope = protocol.target_of(scope)
        signed = sign(self.key, command, target, args or {}, **sign_options)
        operator.publish_command(self.bus, topic_scope, signed)
        return signed

    def for_id(self, command_id: str | None) -> list[dict[str, Any]]:
        with self.bus.lock:
            return self._by_id(command_id)

    def wait_finals(self, command_id: str, count: int, seconds: float) -> dict[str, str]:
        """node -> final status, once ``count`` nodes have one (or the time is up).  Each
        wake reads only the replies that arrived since the last: a rescan of every reply on
        each of a broadcast's thousand wakes held the GIL the simulated nodes of the same
        process needed (quadratic in the fleet's size)."""
        finals: dict[str, str] = {}
        read = 0

        def done() -> bool:  # under the bus lock
            nonlocal read
            for _topic, reply in self.bus.messages[read:]:
                if reply.get("id") == command_id and reply["status"] in protocol.FINAL:
                    finals[reply["node_id"]] = reply["status"]
            read = len(self.bus.messages)
            return len(finals) >= count

        with self.bus.arrived:  # woken by each reply, not polling
            self.bus.arrived.wait_for(done, seconds)
            return dict(finals)

    def final(self, command_id: str | None, node: str | None = None,
              seconds: float = 20) -> dict[str, Any]:
        def found() -> dict[str, Any] | None:
            return next((r for r in self._by_id(command_id) if r["status"] in protocol.FINAL
                         and (node is None or r["node_id"] == node)), None)

        with self.bus.arrived:  # woken by each reply: no polling delay in a round trip
            result = found() if self.bus.arrived.wait_for(
                lambda: found() is not None, seconds) else None
        assert result is not None, self.replies[-5:]
        return result

    def close(self) -> None:
        self.bus.close()


class SimulatedNode:
    """The real link and controller of one node, answering ping (``ping``: how)."""

    def __init__(self, name: str, broker: Broker, state: Path, keys: TrustedKeys,
                 groups: tuple[str, ...] = (), *, brokers: tuple[str, ...] = (),
                 ping: Callable[..., dict[str, Any]] | None = None,
                 birth: bool = False, protocol_version: str = "5") -> None:
        """``brokers``: a broker list to fail over between, in place of ``broker``;
        ``birth``: announce a (minimal) birth on each connect, as the service does;
        ``protocol_version``: "3.1.1" for a broker without MQTT 5 (RabbitMQ 3.10)."""
        identity = Identity(FLEET, name, groups)
        self.outbox = Outbox(state / f"{name}.outbox", 1 << 20, 3600)
        self.store = CommandStore(state / f"{name}.commands")
        self.controller = Controller(
            identity, keys, {"ping"}, self.store,
            {"ping": ping or (lambda args, progress: {"pong": True})}, self._reply)
        self.link = MqttLink(
            LinkSettings(client_id=name, topic_root=identity.root, host=broker.host,
                         port=broker.port, brokers=brokers, protocol=protocol_version,
                         reconnect_min_s=0.2,
                         reconnect_max_s=2),
            self.outbox, Sequence(self.outbox.bump("session")),
            lambda session: [(protocol.topic(identity.root, protocol.BIRTH), encode(
                {"schema": "birth/1", "node_id": name, "session": session}))] if birth else [],
            on_message=self.controller.on_message,
            subscriptions=self.controller.subscriptions())

    def _reply(self, topic: str, body: dict[str, Any], response_topic: str | None,
               correlation: bytes | None, droppable: bool = False) -> None:
        self.link.publish_reply(topic, body, response_topic, correlation, droppable=droppable)

    def start(self) -> None:
        self.controller.start()
        self.link.start()

    def stop(self) -> None:
        self.controller.stop()
        self.link.stop(flush_s=0, timeout=5)
        self.outbox.close()
        self.store.close()


@contextmanager
def simulated_fleet(broker: Broker, state: Path, keys: TrustedKeys,
                    count: int) -> Iterator[list[SimulatedNode]]:
    raise_file_limit()
    nodes = [SimulatedNode(f"sim-{i:04d}", broker, state, keys) for i in range(count)]
    for node in nodes:
        node.start()
    try:
        # subscribed: the broker confirmed the subscriptions, so a command now reaches them
        assert wait_until(lambda: all(n.link.status.subscribed for n in nodes), 60)
        yield nodes
    finally:
        for node in nodes:
            node.stop()


def node_config(tmp_path: Path, root: Path, broker: Broker, key: Ed25519PrivateKey,
                **control: Any) -> dict[str, Any]:
    return agent_config(tmp_path, broker.port, root, groups=["line-a"],
                        control={"trusted_keys": trusted(key), **control})


@contextmanager
def running_node(config: dict[str, Any], builder: Builder | None = None) -> Iterator[Service]:
    """``builder``: build-model's build in place of agent.modelbuild's."""
    service = Service(from_dict(config), builder=builder)
    service.start()
    try:
        assert wait_until(lambda: service.link is not None
                          and service.link.status.subscribed, 30)
        yield service
    finally:
        service.stop(flush_s=0)
