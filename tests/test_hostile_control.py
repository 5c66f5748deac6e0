"""Hostile input against a real agent on a real Mosquitto (issue 15): nothing anyone can
publish stops the link, replays old desired state, crosses fleets, smuggles a NaN in or forges
an audit line; a signed ping is answered after every attack."""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from control_helpers import FLEET, Operator, node_config, running_node, sign, unbound
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mqtt_helpers import Broker, wait_until
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from tuning_helpers import copy_board, snapshot

from agent.control.controller import CommandFailed
from agent.control.envelope import signed
from agent.service.commands import ServiceCommands
from agent.service.node import Service

BOARD = "jetson-agx-orin-jp6"
NODE = f"edge/v1/{FLEET}/orin-1"
CALM_GUARD = {"window_s": 0.2, "max_p99_ratio": 1000, "max_error_rate": 1}


@pytest.fixture()
def operator(broker: Broker, key: Ed25519PrivateKey) -> Iterator[Operator]:
    client = Operator(broker, key)
    client.client.subscribe(f"{NODE}/reported", qos=1)
    yield client
    client.close()


def start_node(tmp_path: Path, broker: Broker, key: Ed25519PrivateKey,
               **control: Any) -> Any:
    root = tmp_path / BOARD if (tmp_path / BOARD).exists() else copy_board(BOARD, tmp_path)
    return running_node(node_config(tmp_path, root, broker, key, guard=CALM_GUARD, **control))


@pytest.fixture()
def node(tmp_path: Path, broker: Broker, key: Ed25519PrivateKey) -> Iterator[Service]:
    with start_node(tmp_path, broker, key) as service:
        yield service


def ping(operator: Operator) -> dict[str, Any]:
    """A signed ping's final reply: the node still hears and answers.  Commands and desired
    state share one worker, so everything queued before it has run when it is answered."""
    return operator.final(operator.send("orin-1", "ping")["id"], seconds=20)


def assert_alive(service: Service, operator: Operator) -> None:
    assert ping(operator)["status"] == "succeeded"
    assert service.link is not None and service.link.alive
    assert service.link.status.state == "connected"
    assert service.controller is not None and service.controller.errors == 0


def reports(operator: Operator) -> list[dict[str, Any]]:
    return [r for r in operator.replies if r.get("schema") == "reported/1"]


def test_nested_json_surrogates_and_wildcard_response_topics_leave_the_link_up(
        tmp_path: Path, broker: Broker, key: Ed25519PrivateKey, operator: Operator) -> None:
    nested = b"[" * 7000 + b"]" * 7000  # under the 16 KB limit; json.loads recursed on it
    surrogate = json.dumps({**sign(key, "ping", "node:orin-1", {}), "id": "\ud800"}).encode()
    surrogate_args = json.dumps(sign(key, "ping", "node:orin-1", {})).replace(
        '"args": {}', '"args": {"x": "\\udfff"}').encode()
    with start_node(tmp_path, broker, key) as service:
        for payload in (nested, surrogate, surrogate_args, b'{"id": ' + b'[' * 900 + b"}"):
            operator.publish(f"{NODE}/cmd/ping", payload)
        operator.publish(f"{NODE}/desired", nested, retain=True)  # retained: every restart
        operator.publish(f"edge/v1/{FLEET}/group/line-a/desired", surrogate, retain=True)
        assert_alive(service, operator)
        rejected = service.controller.metrics()["rejected"]  # type: ignore[union-attr]
        assert rejected["malformed"] == 6, rejected

        # A Response Topic with a wildcard (paho refuses to publish to it): answered on the
        # res topic only, through a raw MQTT 5 client as an attacker would send it.
        raw = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="raw", protocol=mqtt.MQTTv5)
        raw.connect(broker.host, broker.port)
        raw.loop_start()
        try:
            properties = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
            properties.ResponseTopic = f"edge/v1/{FLEET}/operator/+/#"
            properties.CorrelationData = b"c"
            envelope = sign(key, "ping", "node:orin-1", {})
            raw.publish(f"{NODE}/cmd/ping", json.dumps(envelope), qos=1,
                        properties=properties).wait_for_publish(10)
            assert operator.final(envelope["id"])["status"] == "succeeded"
        finally:
            raw.disconnect()  # its one publish is acknowledged; this wakes paho's thread
            raw.loop_stop()
        assert_alive(service, operator)
    with start_node(tmp_path, broker, key) as service:  # the retained junk is read again
        assert_alive(service, operator)
        assert service.controller.metrics()["rejected"]["malformed"] == 2  # type: ignore


def test_desired_state_is_in_time_in_order_and_cleared_only_by_a_signature(
        tmp_path: Path, node: Service, operator: Operator, key: Ed25519PrivateKey) -> None:
    assert node.controller is not None and node.tuning is not None
    topic, root = f"{NODE}/desired", Path(node.config.root)
    original = snapshot(root)
    latency = {"profile": "jetson-orin-latency"}
    now = time.time()

    def applied_id() -> Any:
        return (node.controller.store.get_state("desired:node:orin-1")  # type: ignore
                or {}).get("id")

    expired = sign(key, "desired", "node:orin-1", latency, now=now - 7200, ttl_s=3600)
    operator.publish(topic, json.dumps(expired).encode(), retain=True)
    for forged in (sign(key, "desired", "node:orin-1", latency, fleet="other"),
                   unbound(key, "desired", "node:orin-1", latency),
                   sign(key, "desired", "node:orin-1", latency, ttl_s=400 * 86400),
                   sign(Ed25519PrivateKey.generate(), "desired", "node:orin-1", latency)):
        operator.publish(topic, json.dumps(forged).encode(), retain=True)
    assert_alive(node, operator)
    assert not node.tuning.applied and snapshot(root) == original and applied_id() is None
    assert node.controller.metrics()["rejected"] == {
        "expired": 1, "wrong_fleet": 1, "unbound": 1, "ttl_too_long": 1, "unknown_key": 1}

    newer = sign(key, "desired", "node:orin-1", latency, now=now, ttl_s=86400)
    operator.publish(topic, json.dumps(newer).encode(), retain=True)
    assert wait_until(lambda: any(r["desired_id"] == newer["id"] for r in reports(operator)))
    assert node.tuning.applied and node.tuning.profile == "jetson-orin-latency"
    changed = snapshot(root)
    seen = len(reports(operator))

    older = sign(key, "desired", "node:orin-1", {"profile": None}, now=now - 60,
                 ttl_s=86400)
    operator.publish(topic, json.dumps(older).encode(), retain=True)
    operator.publish(topic, json.dumps(newer).encode(), retain=True)  # the same id again
    operator.publish(topic, b"", retain=True)  # no longer a clear
    assert_alive(node, operator)
    # neither the stale one nor the redelivery ran; the stale one is said, as refused
    said = reports(operator)[seen:]
    assert [r["refused"]["node:orin-1"]["code"] for r in said] == ["stale"], said
    assert said[0]["refused"]["node:orin-1"]["desired_id"] == older["id"]
    assert said[0]["desired_id"] == newer["id"] and said[0]["status"] == "converged"
    assert node.tuning.applied and snapshot(root) == changed and applied_id() == newer["id"]
    metrics = node.controller.metrics()
    assert metrics["rejected"]["stale"] == 1 and metrics["desired_ignored"] == 1

    clear = sign(key, "desired", "node:orin-1", {}, clear=True)
    operator.publish(topic, json.dumps(clear).encode(), retain=True)
    assert_alive(node, operator)
    assert applied_id() == clear["id"] and node.controller.desired.chosen() is None
    operator.publish(topic, json.dumps(newer).encode(), retain=True)  # older than the clear
    assert_alive(node, operator)
    assert node.controller.metrics()["rejected"]["stale"] == 2
    operator.publish(topic, b"", retain=True)


def test_commands_are_bound_to_their_fleet(tmp_path: Path, broker: Broker,
                                           key: Ed25519PrivateKey, operator: Operator,
                                           caplog: pytest.LogCaptureFixture) -> None:
    with start_node(tmp_path, broker, key) as service:
        other = operator.send("orin-1", "set-telemetry", {"interval_s": 7}, fleet="plant-8")
        legacy = unbound(key, "set-telemetry", "node:orin-1", {"interval_s": 8})
        operator.publish(f"{NODE}/cmd/set-telemetry", json.dumps(legacy).encode())
        assert operator.final(other["id"])["code"] == "wrong_fleet"
        assert operator.final(legacy["id"])["code"] == "unbound"
        assert service.sampler is not None and service.sampler.interval_s == 0.2
    with caplog.at_level(logging.WARNING, logger="agent.control.controller"), \
            start_node(tmp_path, broker, key, accept_unbound_envelopes=True) as service:
        assert "accept_unbound_envelopes is true" in caplog.text
        legacy = unbound(key, "set-telemetry", "node:orin-1", {"interval_s": 8})
        operator.publish(f"{NODE}/cmd/set-telemetry", json.dumps(legacy).encode())
        assert operator.final(legacy["id"])["status"] == "succeeded"
        assert service.sampler is not None and service.sampler.interval_s == 8
        other = operator.send("orin-1", "ping", fleet="plant-8")  # a named fleet still counts
        assert operator.final(other["id"])["code"] == "wrong_fleet"


def test_numbers_are_finite_and_a_guard_that_cannot_run_undoes_its_change(
        node: Service, operator: Operator, key: Ed25519PrivateKey) -> None:
    assert node.controller is not None and node.sampler is not None
    before = node.sampler.interval_s
    text = json.dumps(sign(key, "set-telemetry", "node:orin-1", {"interval_s": 1}))
    ids = []
    for literal in ("NaN", "Infinity", "1e999"):
        envelope = json.loads(text)
        envelope["id"] = f"nan-{literal}"
        ids.append(envelope["id"])
        payload = json.dumps(envelope).replace('"interval_s": 1', f'"interval_s": {literal}')
        operator.publish(f"{NODE}/cmd/set-telemetry", payload.encode())
    huge = json.loads(text)
    huge["id"], huge["issued_at"] = "huge", 1e300
    operator.publish(f"{NODE}/cmd/set-telemetry", json.dumps(huge).encode())
    for command_id in [*ids, "huge"]:
        assert operator.final(command_id)["code"] == "malformed"
    assert node.sampler.interval_s == before
    for reply in operator.replies:  # every reply is strict JSON: no bare NaN in it
        json.dumps(reply, allow_nan=False)

    commands: ServiceCommands = node.controller.handlers["apply-profile"].__self__  # type: ignore
    root = Path(node.config.root)
    original = snapshot(root)
    for window in (math.nan, math.inf, -1.0):  # as if it slipped past every schema
        with pytest.raises(CommandFailed) as refused:
            commands.apply_profile({"profile": "jetson-orin-latency",
                                    "guard": {"window_s": window}}, lambda step: None)
        assert refused.value.code == "bad_args"
        assert snapshot(root) == original and node.tuning is not None
        assert not node.tuning.applied

    def broken_sleep(seconds: float) -> None:
        raise ValueError("Invalid value NaN (not a number)")

    commands.sleep = broken_sleep
    reply = operator.final(operator.send("orin-1", "apply-profile",
                                         {"profile": "jetson-orin-latency"})["id"])
    assert (reply["status"], reply["code"]) == ("failed", "health_check")
    assert "health window could not run" in reply["message"]
    assert snapshot(root) == original and not node.tuning.applied


def test_an_id_with_a_newline_writes_exactly_one_json_audit_line(
        node: Service, operator: Operator, key: Ed25519PrivateKey,
        caplog: pytest.LogCaptureFixture) -> None:
    forged = "x\nWARNING agent.audit: accepted apply-profile id y from key trusted"
    envelope = {**sign(key, "apply-profile", "node:orin-1", {"profile": "p"}), "id": forged,
                "sig": None}
    with caplog.at_level(logging.INFO, logger="agent.audit"):
        operator.publish(f"{NODE}/cmd/apply-profile", json.dumps(envelope).encode())
        assert operator.final(forged)["code"] == "unsigned"  # a null sig is unsigned
        assert_alive(node, operator)
    formatter = logging.Formatter("%(levelname)s %(name)s: %(message)s")
    lines = [line for r in caplog.records if r.name == "agent.audit"
             for line in formatter.format(r).splitlines()]
    mine = [line for line in lines if "apply-profile" in line]
    assert len(mine) == 1, lines
    record = json.loads(mine[0].split(": ", 1)[1])
    assert (record["event"], record["id"], record["code"]) == ("rejected", forged, "unsigned")


def test_a_flood_of_junk_is_counted_and_its_replies_are_rate_limited(
        node: Service, operator: Operator) -> None:
    assert node.controller is not None and node.sampler is not None
    flood = 300
    started = time.monotonic()
    pings = []
    for index in range(flood):
        operator.publish(f"{NODE}/cmd/ping", json.dumps({"id": f"junk-{index}"}).encode())
        if index % 50 == 0:
            pings.append(operator.send("orin-1", "ping")["id"])
    for command_id in pings:  # every signed ping in the flood is answered
        assert operator.final(command_id)["status"] == "succeeded"
    assert_alive(node, operator)
    elapsed = time.monotonic() - started
    answered = {r["id"] for r in operator.replies if str(r.get("id")).startswith("junk-")}
    assert len(answered) <= 20 + 5 * (elapsed + 1), (len(answered), elapsed)
    metrics = node.controller.metrics()
    assert metrics["rejected"]["unsigned"] == flood
    assert metrics["replies_suppressed"] == flood - len(answered)
    assert wait_until(lambda: (node.sampler.last or {}).get("metrics", {}).get(
        "control", {}).get("rejected", {}).get("unsigned") == flood)


# -- the fuzzer -------------------------------------------------------------------------------

MUTATIONS = ("none", "drop", "swap_type", "past", "future", "fleet", "stranger", "nested",
             "huge", "target", "null_sig", "float_time", "unbound")


@st.composite
def cases(draw: st.DrawFn) -> tuple[str, str, dict[str, Any] | bytes]:
    """(kind: command or desired, mutation, what to publish)."""
    kind = draw(st.sampled_from(("command", "desired")))
    mutation = draw(st.sampled_from(MUTATIONS))
    field = draw(st.sampled_from(("id", "fleet", "command", "issued_at", "expires_at",
                                  "target", "args", "sig")))
    junk = draw(st.one_of(st.none(), st.integers(), st.floats(allow_nan=False),
                          st.text(max_size=20), st.lists(st.integers(), max_size=3)))
    depth = draw(st.integers(33, 3000))
    return kind, mutation, {"field": field, "junk": junk, "depth": depth,
                            "raw": draw(st.binary(max_size=64))}


def test_fuzzed_envelopes_apply_only_when_signed_in_time_in_order_and_for_this_fleet(
        tmp_path: Path, broker: Broker, key: Ed25519PrivateKey, operator: Operator) -> None:
    stranger = Ed25519PrivateKey.generate()
    clock = [time.time() - 3600]  # desired states issued in rising order

    with start_node(tmp_path, broker, key) as service:
        assert service.controller is not None and service.sampler is not None
        counter = [0]

        @settings(max_examples=60, derandomize=True, deadline=None,
                  suppress_health_check=list(HealthCheck))
        @given(cases())
        def run(case: tuple[str, str, dict[str, Any] | bytes]) -> None:
            kind, mutation, options = case
            assert isinstance(options, dict)
            counter[0] += 1
            value = 0.05 + counter[0]  # a set-telemetry interval seen nowhere before
            clock[0] += 1
            signer = stranger if mutation == "stranger" else key
            args: dict[str, Any] = {"interval_s": value} if kind == "command" else {
                "profile": None}
            extra: dict[str, Any] = {"fleet": "other"} if mutation == "fleet" else {}
            if mutation == "past":
                extra.update(now=time.time() - 7200, ttl_s=60)
            if mutation == "future":
                extra.update(now=time.time() + 3600)
            if kind == "desired":
                extra.setdefault("now", clock[0])
                extra.setdefault("ttl_s", 86400)
            name = "set-telemetry" if kind == "command" else "desired"
            envelope = sign(signer, name, "node:orin-1", args, **extra)
            if mutation == "unbound":
                envelope = unbound(signer, name, "node:orin-1", args, **{
                    k: v for k, v in extra.items() if k != "fleet"})
            if mutation == "drop":
                envelope.pop(options["field"])
            original = envelope.get(options["field"])
            if mutation == "swap_type":
                envelope[options["field"]] = options["junk"]
            if mutation == "target":
                envelope = signed(signer, {**envelope, "target": "node:orin-2"})
            if mutation == "null_sig":
                envelope["sig"] = None
            if mutation == "float_time":
                envelope = signed(signer, {**envelope, "issued_at": envelope["issued_at"] + 0.5})
            payload = json.dumps(envelope).encode()
            if mutation == "nested":
                payload = payload[:-1] + b', "deep": ' + b"[" * options["depth"] + \
                    b"]" * options["depth"] + b"}"
            if mutation == "huge":
                raw = options["raw"] or b"x"
                payload = raw * (20000 // len(raw) + 1) + payload
            topic = f"{NODE}/cmd/set-telemetry" if kind == "command" else f"{NODE}/desired"
            before_interval = service.sampler.interval_s  # type: ignore[union-attr]
            before_desired = service.controller.store.get_state(  # type: ignore[union-attr]
                "desired:node:orin-1")
            operator.publish(topic, payload, retain=kind == "desired")
            assert ping(operator)["status"] == "succeeded"  # answered after every case
            valid = mutation == "none" or (mutation == "swap_type" and options["junk"] ==
                                           original and type(options["junk"]) is type(original))
            if kind == "command":
                if valid:
                    assert operator.final(envelope["id"])["status"] == "succeeded"
                assert (service.sampler.interval_s == value) is valid  # type: ignore
                if not valid:
                    assert service.sampler.interval_s == before_interval  # type: ignore
            else:
                after = service.controller.store.get_state(  # type: ignore[union-attr]
                    "desired:node:orin-1")
                assert (after == {"id": envelope.get("id"),
                                  "issued_at": envelope.get("issued_at")}) is valid
                if not valid:
                    assert after == before_desired
            assert service.link is not None and service.link.alive
            assert service.link.status.state == "connected"

        started = time.monotonic()
        run()
        assert time.monotonic() - started < 60
        assert service.controller.errors == 0
        operator.publish(f"{NODE}/desired", b"", retain=True)
