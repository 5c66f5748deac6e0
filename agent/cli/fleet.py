"""``edge-agent fleet``: keygen, send (sign, send, collect replies), desired, watch.

Argument handling and rendering only: the broker session, signing, sending and collecting
replies are the operator client's (agent.control.operator), imported when a command runs so
that building the parser stays cheap.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent import protocol
from agent.cli.common import UsageError, non_negative_float, positive_float, render_table
from agent.cli.fleet_broker import connect, share_group
from agent.stopping import SIGINT_EXIT, StopSignals
from agent.telemetry.records import hottest_c

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey


DEFAULT_TIMEOUT_S = 15.0
LONG_TIMEOUTS_S = {"build-model": 1800.0}  # commands that run as a job for minutes


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``fleet``: keygen, send, desired, watch."""
    fleet = commands.add_parser("fleet", help="operator side: keys, signed commands, desired "
                                "state, a live table of nodes")
    actions = fleet.add_subparsers(dest="action", required=True)
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
        sub.add_argument("--broker", metavar="HOST:PORT[,HOST:PORT...]",
                         help="a broker, or a cluster's members to fail over between")
        sub.add_argument("--protocol", choices=("5", "3.1.1"),
                         help="the MQTT version (default: --config's mqtt.protocol, else 5)")
        sub.add_argument("--fleet")
        if name in ("send", "desired"):
            sub.add_argument("target", help="a node id, group:NAME, or all")
            sub.add_argument("--key", required=True, help="the operator's private key (PEM)")
        if name == "send":
            # not dest "command": that names the top-level command in error messages
            sub.add_argument("fleet_command", metavar="command",
                             help="ping, get-status, apply-profile, set-model, build-model, "
                             "... (README)")
            sub.add_argument("--arg", action="append", metavar="K=V",
                             help="an argument; repeat; values are JSON when they parse")
            sub.add_argument("--args-json", metavar="JSON")
            sub.add_argument("--timeout", type=positive_float,
                             help=f"seconds to wait for the replies (default "
                             f"{DEFAULT_TIMEOUT_S:g}; build-model "
                             f"{LONG_TIMEOUTS_S['build-model']:g})")
            sub.add_argument("--ttl", type=positive_float, default=60.0, help="seconds it is valid")
            sub.add_argument("--json", action="store_true")
        if name == "desired":
            sub.add_argument("--profile", help="a profile name, or none to roll back")
            sub.add_argument("--model")
            sub.add_argument("--sha256")
            sub.add_argument("--qos", action="append", metavar="MODEL=JSON",
                             help='a model\'s qos {"class", "p99_ms", "min_rps"}, or null: none')
            sub.add_argument("--clear", action="store_true", help="remove the desired state "
                             "(a signed clear, retained in its place)")
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
            sub.add_argument("--share", metavar="GROUP", type=share_group,
                             help="telemetry through an MQTT 5 shared subscription: the "
                             "watchers of one group each get a part")
    fleet.set_defaults(handler=main_entry)


# -- keys -----------------------------------------------------------------------------------


def keygen(args: argparse.Namespace) -> int:
    import yaml

    from agent.control.operator import generate_key

    path = Path(args.out)
    if path.exists() and not args.force:
        raise UsageError(f"{path} exists; --force replaces it (and every node must then "
                         "trust the new key)")
    entry = generate_key(path)
    if args.json:
        print(json.dumps({"path": str(path), "key_id": entry["id"],
                          "public_key": entry["public_key"], "trusted_key": entry}, indent=2))
        return 0
    # through YAML's own quoting: an id of 16 hex digits that are all decimal ones would
    # otherwise read back as an integer, which the node's config then refuses
    snippet = yaml.safe_dump({"control": {"trusted_keys": [entry]}}, sort_keys=False,
                             default_flow_style=None)
    print(f"private key written to {path} (keep it secret)\n"
          f"trust it on each node, in /etc/edge-agent/agent.yaml:\n{snippet}", end="")
    return 0


def _private_key(path: str) -> Ed25519PrivateKey:
    from agent.control.envelope import load_private_key

    try:
        return load_private_key(Path(path).read_bytes())
    except OSError as error:
        raise UsageError(f"--key {path}: {error.strerror}") from None
    except ValueError as error:
        raise UsageError(f"--key {path}: {error}") from None


# -- send -----------------------------------------------------------------------------------


def _fits(schema: str, arguments: dict[str, Any], what: str) -> None:
    """UsageError for what every node would refuse (the schema it checks), before it is
    signed: a refusal would reach the operator as a reply at best, and a desired state is
    retained on the broker over the last good one."""
    from agent.control import schemas

    if schema not in schemas.ARGS and schema != "desired":
        return  # a command newer than this client: the node judges it
    problem = schemas.check(schema, arguments)
    if problem:
        key = problem.removeprefix("data").removeprefix(".").removeprefix(":").lstrip()
        hint = (" (--arg reads 123, true and null as JSON: quote a text that looks like "
                "one, KEY='\"123\"')" if "must be string" in problem else "")
        raise UsageError(f"{what}: {key}{hint}; nothing was sent")


class NotFinite(ValueError):
    """NaN or Infinity in a value: a node refuses them, so the CLI never sends one."""


def _no_constant(name: str) -> Any:
    raise NotFinite(f"{name} is not a finite number")


def finite_json(text: str) -> Any:
    """JSON without NaN or Infinity (1e999 is one too); NotFinite says which."""
    from agent.control.envelope import finite

    value = json.loads(text, parse_constant=_no_constant)
    if not finite(value):
        raise NotFinite(f"{text!r} holds a number beyond a float's range")
    return value


def parse_args_list(pairs: list[str]) -> dict[str, Any]:
    """``k=v`` pairs (``guard.window_s=2`` nests); values are JSON when they parse."""
    result: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--arg {pair}: expected key=value")
        try:
            value = finite_json(text)
        except NotFinite as error:
            raise UsageError(f"--arg {pair}: {error}") from None
        except ValueError:
            value = text
        node = result
        *parents, leaf = key.split(".")
        for depth, parent in enumerate(parents):
            node = node.setdefault(parent, {})
            if not isinstance(node, dict):  # qos=null, then qos.class=...
                raise UsageError(f"--arg {pair}: {'.'.join(parents[:depth + 1])} was given "
                                 "a value already, so it has no keys to set")
        if isinstance(node.get(leaf), dict):  # qos.class=..., then qos=null
            raise UsageError(f"--arg {pair}: {key} was given keys already ({key}.KEY=...); "
                             "give one or the other")
        node[leaf] = value
    return result


def _merge(into: dict[str, Any], extra: dict[str, Any]) -> None:
    """``--args-json`` over ``--arg``: an object's keys merged, at any depth (qos.class from
    --arg keeps its place beside --args-json's qos.p99_ms); anything else replaced."""
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def send(args: argparse.Namespace) -> int:
    from agent.cli.fleet_replies import details, table
    from agent.control.collect import collect
    from agent.control.envelope import sign
    from agent.control.operator import expected_nodes, publish_command
    from agent.control.resend import resender

    key = _private_key(args.key)
    arguments = parse_args_list(args.arg or [])
    if args.args_json:
        try:
            extra = finite_json(args.args_json)
        except ValueError as error:
            raise UsageError(f"--args-json: {error}") from None
        if not isinstance(extra, dict):
            raise UsageError("--args-json: expected a JSON object")
        _merge(arguments, extra)
    _fits(args.fleet_command, arguments, f"{args.fleet_command}'s args")
    target, scope = protocol.target_of(args.target)
    bus = connect(args, [protocol.STATE, protocol.BIRTH,
                         protocol.reply_suffix(args.fleet_command)])
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
        envelope = sign(key, args.fleet_command, target, arguments, fleet=bus.fleet,
                        ttl_s=args.ttl)
        sent_at = time.time()
        publish_command(bus, scope, envelope)
        timeout = args.timeout or LONG_TIMEOUTS_S.get(args.fleet_command, DEFAULT_TIMEOUT_S)
        outcomes = collect(bus, envelope["id"], expected, sent_at, timeout,
                           again=resender(bus, key, scope, envelope))
    finally:
        bus.close()
    if args.json:
        print(json.dumps({"id": envelope["id"], "results": [
            {"node": o.node, "status": o.status, "code": o.code, "message": o.message,
             "ms": o.ms, "result": o.result} for o in outcomes.values()]}, indent=2))
    else:
        by_node = sorted(outcomes.values(), key=lambda o: o.node)
        more = details(by_node)
        print(f"{args.fleet_command} {envelope['id']} -> {args.target}: "
              f"{len(outcomes)} node(s)\n{table(by_node)}" + (f"\n\n{more}" if more else ""))
    return 0 if outcomes and all(o.status == protocol.SUCCEEDED
                                 for o in outcomes.values()) else 1


# -- desired state --------------------------------------------------------------------------


def desired(args: argparse.Namespace) -> int:
    from agent.control.envelope import sign
    from agent.control.operator import publish_desired

    target, scope = protocol.target_of(args.target)
    if target == protocol.ALL:
        raise UsageError("desired state is per node or per group, not for all")
    wanted: dict[str, Any] = {}
    if args.profile is not None:
        wanted["profile"] = None if args.profile == "none" else args.profile
    if args.model:
        wanted["model"] = args.model
    if args.sha256:
        wanted["sha256"] = args.sha256
    for item in args.qos or []:  # MODEL=JSON: a model name may hold dots, so not --arg's form
        name, sep, text = item.partition("=")
        if not sep or not name:
            raise UsageError(f"--qos {item}: expected MODEL=JSON")
        if name in wanted.get("models", {}):
            raise UsageError(f"--qos {item}: model {name} was given a qos already")
        try:
            wanted.setdefault("models", {})[name] = {"qos": finite_json(text)}
        except NotFinite as error:
            raise UsageError(f"--qos {item}: {error}") from None
        except ValueError as error:
            raise UsageError(f"--qos {item}: the value is not JSON ({error})") from None
    if not wanted and not args.clear:
        raise UsageError("give --profile, --model and/or --qos (or --clear)")
    if wanted and args.clear:
        raise UsageError("--clear takes no --profile, --model, --sha256 or --qos")
    if wanted:
        _fits("desired", wanted, "the desired state")
    key = _private_key(args.key)
    bus = connect(args, [])
    try:
        envelope = sign(key, "desired", target, wanted, fleet=bus.fleet, ttl_s=args.ttl,
                        clear=args.clear)
        topic = publish_desired(bus, scope, envelope)
    finally:
        bus.close()
    if args.json:
        print(json.dumps({"topic": topic, "target": target, "cleared": args.clear,
                          "id": envelope["id"], "issued_at": envelope["issued_at"],
                          "expires_at": envelope["expires_at"], "args": envelope["args"]},
                         indent=2))
    else:
        print(f"{'cleared' if args.clear else 'set'} desired state on {topic}")
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
    bus = connect(args, [protocol.STATE, protocol.BIRTH, protocol.TELEMETRY,
                         protocol.REPORTED], share=args.share)
    bus.log = False  # a table of the newest per node: a watch of days must not keep the rest
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
                    text = (CLEAR_SCREEN if redraw else "" if first else "\n") + render_table(
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


def main_entry(args: argparse.Namespace) -> int:
    """The action; its errors end as agent.cli.common's table says, but Ctrl-C, which is how
    a watch ends, is said only where it cut something short."""
    try:
        return {"keygen": keygen, "send": send, "desired": desired, "watch": watch}[
            args.action](args)
    except KeyboardInterrupt:
        if args.action != "watch":
            print(f"edge-agent fleet {args.action}: interrupted", file=sys.stderr)
        return SIGINT_EXIT
