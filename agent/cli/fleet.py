"""``edge-agent fleet``: keygen, send (sign, send, collect replies), desired, watch.

The operator side of fleet control.  It needs only the broker and a private key; who is in
the fleet comes from the nodes' retained ``state`` and ``birth`` messages.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from paho.mqtt.enums import CallbackAPIVersion

from agent.cli.common import UsageError, non_negative_float, positive_float
from agent.control.envelope import (
    key_id,
    load_private_key,
    private_key_pem,
    public_key_text,
    sign,
)
from agent.link.mqtt import read_password
from agent.stopping import SIGINT_EXIT, StopSignals
from agent.telemetry.records import hottest_c


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``fleet``: keygen, send, desired, watch."""
    fleet = commands.add_parser("fleet", help="operator side: keys, signed commands, desired "
                                "state, a live table of nodes")
    actions = fleet.add_subparsers(dest="fleet_action", required=True)
    key = actions.add_parser("keygen", help="create an Ed25519 operator key")
    key.add_argument("--out", default="operator.key")
    key.add_argument("--force", action="store_true")
    key.add_argument("--json", action="store_true",
                     help="print {path, key_id, public_key, trusted_key}")
    for name, text in (("send", "sign a command, send it, print each node's outcome"),
                       ("desired", "set (retained) the profile/model a node or group should "
                        "run"),
                       ("watch", "a live table of nodes from their retained topics (redrawn "
                        "on a terminal; into a pipe, one table per refresh)")):
        sub = actions.add_parser(name, help=text)
        sub.add_argument("--config", metavar="FILE", help="take broker, TLS and fleet from an "
                         "agent.yaml")
        sub.add_argument("--broker", metavar="HOST:PORT")
        sub.add_argument("--fleet")
        if name in ("send", "desired"):
            sub.add_argument("target", help="a node id, group:NAME, or all")
            sub.add_argument("--key", required=True, help="the operator's private key (PEM)")
        if name == "send":
            # not dest "command": that names the top-level command in error messages
            sub.add_argument("fleet_command", metavar="command",
                             help="ping, get-status, apply-profile, ... (README)")
            sub.add_argument("--arg", action="append", metavar="K=V",
                             help="an argument; repeat; values are JSON when they parse")
            sub.add_argument("--args-json", metavar="JSON")
            sub.add_argument("--timeout", type=positive_float, default=15.0)
            sub.add_argument("--ttl", type=positive_float, default=60.0, help="seconds it is valid")
            sub.add_argument("--json", action="store_true")
        if name == "desired":
            sub.add_argument("--profile", help="a profile name, or none to roll back")
            sub.add_argument("--model")
            sub.add_argument("--sha256")
            sub.add_argument("--clear", action="store_true", help="remove the desired state")
            sub.add_argument("--ttl", type=positive_float, default=365 * 86400.0)
            sub.add_argument("--json", action="store_true",
                             help="print {topic, target, cleared, id, issued_at, expires_at, "
                             "args}")
        if name == "watch":
            sub.add_argument("--once", action="store_true", help="print one table and exit")
            sub.add_argument("--settle", type=non_negative_float, default=2.0,
                             help="with --once: seconds to collect before printing")
            sub.add_argument("--seconds", type=positive_float, help="stop after N seconds")
            sub.add_argument("--json", action="store_true",
                             help="one JSON object per line and refresh: {ts, fleet, nodes}")
    fleet.set_defaults(handler=main_entry)


FINAL = ("succeeded", "failed", "rejected", "expired")
RETAINED_SETTLE_S = 2.0  # at most, for the retained messages after subscribing
HANDSHAKE_TIMEOUT_S = 5.0  # CONNACK and SUBACK
PUBLISH_TIMEOUT_S = 10.0  # PUBACK


class FleetError(Exception):
    """The broker took part but the operation failed (a refused publish): exit status 1."""


# -- keys -----------------------------------------------------------------------------------


def keygen(args: argparse.Namespace) -> int:
    path = Path(args.out)
    if path.exists() and not args.force:
        raise UsageError(f"{path} exists; --force replaces it (and every node must then "
                         "trust the new key)")
    key = Ed25519PrivateKey.generate()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(private_key_pem(key))
    public = key.public_key()
    entry = {"id": key_id(public), "public_key": public_key_text(public)}
    if args.json:
        print(json.dumps({"path": str(path), "key_id": entry["id"],
                          "public_key": entry["public_key"], "trusted_key": entry}, indent=2))
        return 0
    print(f"private key written to {path} (keep it secret)\n"
          "trust it on each node, in /etc/edge-agent/agent.yaml:\n"
          "control:\n  trusted_keys:\n"
          f"    - {{id: {entry['id']}, public_key: {entry['public_key']}}}")
    return 0


def _private_key(path: str) -> Ed25519PrivateKey:
    try:
        return load_private_key(Path(path).read_bytes())
    except OSError as error:
        raise UsageError(f"--key {path}: {error.strerror}") from None
    except ValueError as error:
        raise UsageError(f"--key {path}: {error}") from None


# -- broker connection ----------------------------------------------------------------------


@dataclass
class Bus:
    """An operator's MQTT session that records what arrives on the topics it watches."""

    fleet: str
    client: mqtt.Client
    lock: threading.Lock = field(default_factory=threading.Lock)
    retained: dict[str, dict[str, Any]] = field(default_factory=dict)  # topic -> payload
    messages: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    changed: threading.Event = field(default_factory=threading.Event)
    acks: dict[int, str | None] = field(default_factory=dict)  # mid -> refusal, if any

    def on_message(self, client: mqtt.Client, userdata: Any, message: mqtt.MQTTMessage) -> None:
        try:
            payload = json.loads(message.payload) if message.payload else None
        except ValueError:
            return
        with self.lock:
            if message.retain or message.topic.endswith(("/state", "/birth", "/reported")):
                if payload is None:
                    self.retained.pop(message.topic, None)
                else:
                    self.retained[message.topic] = payload
            if payload is not None:
                self.messages.append((message.topic, payload))
        self.changed.set()

    def on_publish(self, client: mqtt.Client, userdata: Any, mid: int, reason: Any,
                   properties: Any) -> None:
        with self.lock:
            self.acks[mid] = str(reason) if reason.is_failure else None

    def publish(self, topic: str, payload: bytes, retain: bool = False) -> None:
        """Publish at QoS 1 and wait for the broker's acknowledgement; FleetError if it
        refuses the message (an ACL, say) or never acknowledges it."""
        info = self.client.publish(topic, payload, qos=1, retain=retain)
        try:
            info.wait_for_publish(PUBLISH_TIMEOUT_S)
        except (RuntimeError, ValueError) as error:
            raise FleetError(f"could not publish on {topic}: {error}") from None
        if not info.is_published():
            raise FleetError(f"the broker did not acknowledge the message on {topic} "
                             f"within {PUBLISH_TIMEOUT_S:.0f} s")
        with self.lock:
            refused = self.acks.pop(info.mid, None)
        if refused:
            raise FleetError(f"the broker refused the message on {topic}: {refused}")

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()

    def nodes(self) -> dict[str, dict[str, Any]]:
        """node id -> {state, birth, reported, telemetry (the newest)} from what arrived."""
        found: dict[str, dict[str, Any]] = {}
        prefix = f"edge/v1/{self.fleet}/"
        with self.lock:
            items = list(self.retained.items()) + [
                (t, p) for t, p in self.messages if t.endswith("/telemetry")]
        for topic, payload in items:
            node, _, suffix = topic.removeprefix(prefix).partition("/")
            if node in ("all", "group") or suffix not in ("state", "birth", "reported",
                                                          "telemetry"):
                continue
            facts = found.setdefault(node, {})
            if suffix == "telemetry" and (facts.get("telemetry") or {}).get("ts", 0) > \
                    payload.get("ts", 0):
                continue  # a replayed (historical) record arriving after a live one
            facts[suffix] = payload
        return found


def _connection(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """Broker settings from --config (an agent.yaml) and --broker, and the fleet name."""
    from agent.config import ConfigError, load_config

    try:
        config = load_config(args.config) if args.config else None
    except ConfigError as error:
        raise UsageError(str(error)) from None
    settings: dict[str, Any] = {"host": "localhost", "port": 1883, "tls": None,
                                "username": None, "password_file": None}
    if config is not None:
        m = config.mqtt
        settings.update(host=m.host, port=m.port, tls=m.tls, username=m.username,
                        password_file=m.password_file)
    if args.broker:
        host, _, port = args.broker.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise UsageError(f"--broker {args.broker}: expected host:port")
        settings.update(host=host, port=int(port))
    fleet = args.fleet or (config.fleet if config is not None else "default")
    return settings, fleet


def no_delay(client: mqtt.Client) -> None:
    """A command right after an ack must not wait for Nagle and a delayed ACK (~40 ms)."""
    sock: Any = client.socket()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def connect(args: argparse.Namespace, topics: list[str]) -> Bus:
    """A session whose handshake, subscriptions and retained messages are complete.

    Every way the broker can fail us (no such host, nothing listening, TLS, a refused login,
    a handshake or subscription never answered, a subscription denied) is a UsageError that
    says which broker and why.  With no topics it only connects (``desired`` publishes)."""
    settings, fleet = _connection(args)
    where = f"{settings['host']}:{settings['port']}"
    client_id = f"edge-operator-{uuid.uuid4().hex[:12]}"
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id,
                         protocol=mqtt.MQTTv5)
    try:
        if settings["tls"] is not None:
            tls = settings["tls"]
            client.tls_set(ca_certs=tls.ca, certfile=tls.cert, keyfile=tls.key)
        if settings["username"]:
            client.username_pw_set(settings["username"],
                                   read_password(settings["password_file"]))
    except OSError as error:  # ssl.SSLError is one
        raise UsageError(f"broker {where}: {error}") from None
    bus = Bus(fleet=fleet, client=client)
    sync_topic = f"edge/v1/{fleet}/operator/{client_id}/sync"
    connected, subscribed, synced = threading.Event(), threading.Event(), threading.Event()
    refused: list[str] = []

    def on_connect(client: mqtt.Client, userdata: Any, flags: Any, reason: Any,
                   properties: Any) -> None:
        if reason.is_failure:
            refused.append(str(reason))
        connected.set()

    def on_subscribe(client: mqtt.Client, userdata: Any, mid: int, reasons: Any,
                     properties: Any) -> None:
        refused.extend(f"{topic}: {reason}"
                       for topic, reason in zip(topics_sent, reasons, strict=False)
                       if reason.is_failure)
        subscribed.set()

    def on_message(client: mqtt.Client, userdata: Any, message: mqtt.MQTTMessage) -> None:
        if message.topic == sync_topic:
            synced.set()
        else:
            bus.on_message(client, userdata, message)

    wanted = [topic.format(fleet=fleet) for topic in topics]
    topics_sent = [*wanted, sync_topic]
    client.on_connect, client.on_subscribe, client.on_message = (on_connect, on_subscribe,
                                                                 on_message)
    client.on_publish = bus.on_publish
    try:
        client.connect(settings["host"], settings["port"], keepalive=30)
    except OSError as error:  # DNS (gaierror), refused, unreachable, timeout, TLS
        raise UsageError(f"cannot reach the broker {where}: "
                         f"{error.strerror or error}") from None
    no_delay(client)
    client.loop_start()
    try:
        if not connected.wait(HANDSHAKE_TIMEOUT_S):
            raise UsageError(f"the broker {where} did not answer the MQTT handshake within "
                             f"{HANDSHAKE_TIMEOUT_S:.0f} s")
        if refused:
            raise UsageError(f"the broker {where} refused the connection: {refused[0]}")
        if wanted:
            client.subscribe([(topic, 1) for topic in topics_sent])
            if not subscribed.wait(HANDSHAKE_TIMEOUT_S):
                raise UsageError(f"the broker {where} did not confirm the subscription "
                                 f"within {HANDSHAKE_TIMEOUT_S:.0f} s")
            if refused:
                raise UsageError(f"the broker {where} refused the subscription to "
                                 f"{'; '.join(refused)}")
            # The broker sends a subscription's retained messages before anything published
            # after it on this connection: once our own marker is back, they are all here.
            client.publish(sync_topic, b"", qos=1)
            synced.wait(RETAINED_SETTLE_S)
    except BaseException:
        bus.close()
        raise
    return bus


# -- send -----------------------------------------------------------------------------------


def parse_args_list(pairs: list[str]) -> dict[str, Any]:
    """``k=v`` pairs (``guard.window_s=2`` nests); values are JSON when they parse."""
    result: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--arg {pair}: expected key=value")
        try:
            value = json.loads(text)
        except ValueError:
            value = text
        node = result
        *parents, leaf = key.split(".")
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = value
    return result


def target_of(text: str) -> tuple[str, str]:
    """(envelope target, topic scope) for ``node``, ``group:G`` or ``all``."""
    if text == "all":
        return "all", "all"
    if text.startswith("group:"):
        return text, f"group/{text.removeprefix('group:')}"
    return f"node:{text}", text


def expected_nodes(bus: Bus, target: str) -> set[str]:
    """Who should answer: the node itself, or the online members of the fleet or group."""
    if target.startswith("node:"):
        return {target.removeprefix("node:")}
    group = target.removeprefix("group:") if target.startswith("group:") else None
    found = set()
    for node, facts in bus.nodes().items():
        if (facts.get("state") or {}).get("state") not in ("online", "degraded"):
            continue
        if group is None or group in (facts.get("birth") or {}).get("groups", []):
            found.add(node)
    return found


@dataclass
class Outcome:
    node: str
    status: str = "no reply"
    code: str = ""
    message: str = ""
    ms: float | None = None
    result: Any = None
    chunks: dict[int, str] = field(default_factory=dict)


def collect(bus: Bus, command_id: str, expected: set[str], sent_at: float,
            timeout: float) -> dict[str, Outcome]:
    """Replies by node until every expected node has a final one, or the timeout."""
    outcomes = {node: Outcome(node) for node in expected}
    seen = 0
    deadline = time.monotonic() + timeout
    while True:
        with bus.lock:
            fresh, seen = bus.messages[seen:], len(bus.messages)
        for topic, reply in fresh:
            if not topic.endswith("/res") or reply.get("id") != command_id:
                continue
            outcome = outcomes.setdefault(reply.get("node_id", "?"),
                                          Outcome(reply.get("node_id", "?")))
            _absorb(outcome, reply, sent_at)
        if all(o.status in FINAL for o in outcomes.values() if o.node in expected) and (
                expected or time.monotonic() >= deadline):
            return outcomes
        if time.monotonic() >= deadline:
            return outcomes
        bus.changed.wait(0.05)
        bus.changed.clear()


def _absorb(outcome: Outcome, reply: dict[str, Any], sent_at: float) -> None:
    if "chunk" in reply:
        chunk = reply["chunk"]
        outcome.chunks[chunk["index"]] = chunk["data"]
        if len(outcome.chunks) < chunk["count"]:
            return
        reply = {**reply, "result": json.loads("".join(outcome.chunks[i]
                                                       for i in range(chunk["count"])))}
    if outcome.status in FINAL:
        return
    outcome.status = reply.get("status", "?")
    outcome.code = reply.get("code", "")
    outcome.message = reply.get("message") or reply.get("step") or ""
    outcome.result = reply.get("result")
    outcome.ms = round((time.time() - sent_at) * 1000, 1)


def render(rows: list[tuple[str, ...]]) -> str:
    """Columns padded to their widest cell; the header is the first row."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip()
                     for row in rows)


def table(outcomes: dict[str, Outcome]) -> str:
    rows: list[tuple[str, ...]] = [("NODE", "STATUS", "CODE", "MS", "MESSAGE")]
    rows += [(o.node, o.status, o.code, "" if o.ms is None else f"{o.ms:.0f}", o.message[:80])
             for o in sorted(outcomes.values(), key=lambda o: o.node)]
    return render(rows)


def send(args: argparse.Namespace) -> int:
    key = _private_key(args.key)
    arguments = parse_args_list(args.arg or [])
    if args.args_json:
        try:
            arguments.update(json.loads(args.args_json))
        except ValueError as error:
            raise UsageError(f"--args-json: {error}") from None
    target, scope = target_of(args.target)
    bus = connect(args, ["edge/v1/{fleet}/+/state", "edge/v1/{fleet}/+/birth",
                         f"edge/v1/{{fleet}}/+/cmd/{args.fleet_command}/res"])
    try:
        expected = expected_nodes(bus, target)
        if not expected:  # a node target always expects itself
            where = (f"group {target.removeprefix('group:')} of fleet {bus.fleet}"
                     if target.startswith("group:") else f"fleet {bus.fleet}")
            if args.json:
                print(json.dumps({"id": None, "results": []}, indent=2))
            print(f"edge-agent fleet send: no online nodes in {where}; nothing was sent",
                  file=sys.stderr)
            return 1
        envelope = sign(key, args.fleet_command, target, arguments, ttl_s=args.ttl)
        sent_at = time.time()
        bus.publish(f"edge/v1/{bus.fleet}/{scope}/cmd/{args.fleet_command}",
                    json.dumps(envelope).encode())
        outcomes = collect(bus, envelope["id"], expected, sent_at, args.timeout)
    finally:
        bus.close()
    if args.json:
        print(json.dumps({"id": envelope["id"], "results": [
            {"node": o.node, "status": o.status, "code": o.code, "message": o.message,
             "ms": o.ms, "result": o.result} for o in outcomes.values()]}, indent=2))
    else:
        print(f"{args.fleet_command} {envelope['id']} -> {args.target}: "
              f"{len(outcomes)} node(s)\n{table(outcomes)}")
    return 0 if outcomes and all(o.status == "succeeded" for o in outcomes.values()) else 1


# -- desired state --------------------------------------------------------------------------


def desired(args: argparse.Namespace) -> int:
    target, scope = target_of(args.target)
    if target == "all":
        raise UsageError("desired state is per node or per group, not for all")
    wanted: dict[str, Any] = {}
    if args.profile is not None:
        wanted["profile"] = None if args.profile == "none" else args.profile
    if args.model:
        wanted["model"] = args.model
    if args.sha256:
        wanted["sha256"] = args.sha256
    if not wanted and not args.clear:
        raise UsageError("give --profile and/or --model (or --clear)")
    if wanted and args.clear:
        raise UsageError("--clear takes no --profile, --model or --sha256")
    envelope = None if args.clear else sign(_private_key(args.key), "desired", target,
                                            wanted, ttl_s=args.ttl)
    bus = connect(args, [])
    topic = f"edge/v1/{bus.fleet}/{scope}/desired"
    try:
        bus.publish(topic, b"" if envelope is None else json.dumps(envelope).encode(),
                    retain=True)
    finally:
        bus.close()
    if args.json:
        print(json.dumps({"topic": topic, "target": target, "cleared": envelope is None,
                          "id": None if envelope is None else envelope["id"],
                          "issued_at": None if envelope is None else envelope["issued_at"],
                          "expires_at": None if envelope is None else envelope["expires_at"],
                          "args": None if envelope is None else envelope["args"]}, indent=2))
    else:
        print(f"{'cleared' if envelope is None else 'set'} desired state on {topic}")
    return 0


# -- watch ----------------------------------------------------------------------------------


def _profile_name(birth: dict[str, Any], telemetry: dict[str, Any]) -> str | None:
    """The profile of the newer of the two: after a rollback the telemetry says none
    (``null``), and that must not fall back to the name in an older birth."""
    tuning = (telemetry.get("metrics") or {}).get("tuning")
    if isinstance(tuning, dict) and telemetry.get("ts", 0) >= birth.get("ts", 0):
        return tuning.get("profile")
    return (birth.get("profile") or {}).get("name")


def watch_records(nodes: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per node, sorted: what the table shows and ``watch --json`` prints."""
    records = []
    for node, facts in sorted(nodes.items()):
        birth, telemetry = facts.get("birth") or {}, facts.get("telemetry") or {}
        metrics = telemetry.get("metrics") or {}
        inference = metrics.get("inference") or {}
        records.append({
            "node": node, "state": (facts.get("state") or {}).get("state"),
            "profile": _profile_name(birth, telemetry),
            "model": inference.get("model") or (birth.get("model") or {}).get("name"),
            "p99_ms": (inference.get("latency_ms") or {}).get("p99"),
            "hottest_c": hottest_c(metrics),
            "outbox_depth": (metrics.get("outbox") or {}).get("depth"),
            "telemetry_ts": telemetry.get("ts")})
    return records


def watch_rows(nodes: dict[str, dict[str, Any]]) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = [("NODE", "STATE", "PROFILE", "MODEL", "P99_MS",
                                    "HOTTEST_C", "OUTBOX")]
    for r in watch_records(nodes):
        rows.append((r["node"], r["state"] or "?", r["profile"] or "-", r["model"] or "-",
                     "-" if r["p99_ms"] is None else f"{r['p99_ms']:.2f}",
                     "-" if r["hottest_c"] is None else f"{r['hottest_c']:.1f}",
                     "-" if r["outbox_depth"] is None else str(r["outbox_depth"])))
    return rows


CLEAR_SCREEN = "\033[H\033[J"


def watch(args: argparse.Namespace) -> int:
    """A table per second: redrawn in place on a terminal; into a pipe each table once,
    after a blank line; with --json one JSON object per line and refresh.  SIGTERM ends it
    cleanly (exit 0), Ctrl-C too (exit 130)."""
    bus = connect(args, ["edge/v1/{fleet}/+/state", "edge/v1/{fleet}/+/birth",
                         "edge/v1/{fleet}/+/telemetry", "edge/v1/{fleet}/+/reported"])
    redraw = not args.once and not args.json and sys.stdout.isatty()
    try:
        with StopSignals() as stop:
            end = time.monotonic() + args.seconds if args.seconds else None
            if args.once:
                stop.event.wait(args.settle)  # collect a round of telemetry
            first = True
            while not stop.event.is_set():
                nodes = bus.nodes()
                if args.json:
                    text = json.dumps({"ts": int(time.time() * 1000), "fleet": bus.fleet,
                                       "nodes": watch_records(nodes)}) + "\n"
                else:
                    text = (CLEAR_SCREEN if redraw else "" if first else "\n") + render(
                        watch_rows(nodes)) + "\n"
                sys.stdout.write(text)
                sys.stdout.flush()  # a pipe is block-buffered: each refresh leaves at once
                first = False
                if args.once or (end is not None and time.monotonic() >= end):
                    break
                stop.event.wait(1.0)
        return SIGINT_EXIT if stop.received == signal.SIGINT else 0
    finally:
        bus.close()


def run(args: argparse.Namespace) -> int:
    return {"keygen": keygen, "send": send, "desired": desired, "watch": watch}[
        args.fleet_action](args)


def main_entry(args: argparse.Namespace) -> int:
    try:
        return run(args)
    except KeyboardInterrupt:  # Ctrl-C is how a watch ends; elsewhere it cut something short
        if args.fleet_action != "watch":
            print(f"edge-agent fleet {args.fleet_action}: interrupted", file=sys.stderr)
        return 130
    except UsageError:
        raise
    except (FleetError, OSError) as error:
        print(f"edge-agent fleet {args.fleet_action}: {error}", file=sys.stderr)
        return 1
