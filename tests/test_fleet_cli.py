"""``edge-agent fleet`` as an operator runs it: a real process against a real Mosquitto."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from agent_process import sigint_at_default
from control_helpers import FLEET, SimulatedNode, node_config, running_node, trusted, trusted_keys
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from mqtt_helpers import Broker, Subscriber, wait_until
from tuning_helpers import copy_board

from agent.cli.fleet import keygen, watch_rows
from agent.cli.fleet_replies import shorten
from agent.config import from_dict
from agent.control.envelope import (
    key_id,
    load_private_key,
    private_key_pem,
    public_key_text,
)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture()
def key_file(tmp_path: Path, key: Ed25519PrivateKey) -> Path:
    path = tmp_path / "operator.key"
    path.write_bytes(private_key_pem(key))
    return path


def fleet(broker: Broker | None, *words: str, timeout: float = 60,
          ) -> subprocess.CompletedProcess[str]:
    where = [] if broker is None else ["--broker", f"{broker.host}:{broker.port}",
                                       "--fleet", FLEET]
    return subprocess.run([sys.executable, "-m", "agent", "fleet", *words, *where],
                          capture_output=True, text=True, cwd=REPO, timeout=timeout,
                          check=False)


def retained(broker: Broker, topic: str) -> list[dict[str, Any]]:
    """The retained message(s) a new subscriber to ``topic`` gets.  A marker published after
    the subscription travels the same connection, so once it is back every retained message
    has arrived: no waiting out a guess."""
    marker = f"test/marker/{uuid.uuid4().hex}"
    subscriber = Subscriber(broker, [topic, marker], client_id=f"reader-{uuid.uuid4().hex}")
    try:
        assert subscriber.subscribed.wait(10)
        subscriber.client.publish(marker, b"{}", qos=1)
        assert wait_until(lambda: subscriber.on(marker.rsplit("/", 1)[1]), 10)
        with subscriber.lock:
            return [p for t, p, kept in subscriber.messages if t == topic and kept]
    finally:
        subscriber.close()


# -- keygen ---------------------------------------------------------------------------------


def test_keygen_json_is_the_key_and_its_trusted_keys_entry(tmp_path: Path) -> None:
    path = tmp_path / "operator.key"
    done = fleet(None, "keygen", "--out", str(path), "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    public = load_private_key(path.read_bytes()).public_key()
    entry = {"id": key_id(public), "public_key": public_key_text(public)}
    assert report == {"path": str(path), "key_id": entry["id"],
                      "public_key": entry["public_key"], "trusted_key": entry}
    assert path.stat().st_mode & 0o777 == 0o600
    again = fleet(None, "keygen", "--out", str(path), "--json")
    assert again.returncode == 2 and again.stdout == ""
    assert "exists; --force replaces it" in again.stderr


def test_keygen_prints_an_entry_that_reads_back_as_it_was_made(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A key id of hex digits that are all decimal ones (about 1 key in 1,800) is printed
    quoted: unquoted, YAML read it as an integer and the node's config refused it."""
    import agent.control.operator as operator

    public = public_key_text(Ed25519PrivateKey.generate().public_key())
    entry = {"id": "0123456789012345", "public_key": public}
    monkeypatch.setattr(operator, "generate_key", lambda path: dict(entry))
    assert keygen(argparse.Namespace(out=str(tmp_path / "k"), force=False, json=False)) == 0
    printed = capsys.readouterr().out
    snippet = yaml.safe_load(printed[printed.index("control:"):])
    assert snippet == {"control": {"trusted_keys": [entry]}}
    assert from_dict(snippet).control.trusted_keys[0].id == entry["id"]


# -- desired --------------------------------------------------------------------------------


def test_desired_publishes_a_signed_retained_state_and_a_signed_clear_replaces_it(
        broker: Broker, key: Ed25519PrivateKey, key_file: Path) -> None:
    topic = f"edge/v1/{FLEET}/orin-9/desired"
    done = fleet(broker, "desired", "orin-9", "--profile", "jetson-orin-latency",
                 "--key", str(key_file))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"set desired state on {topic}"

    [envelope] = retained(broker, topic)
    assert trusted_keys(key).verify(envelope) == trusted(key)[0]["id"]
    assert envelope["command"] == "desired" and envelope["target"] == "node:orin-9"
    assert envelope["fleet"] == FLEET
    assert envelope["args"] == {"profile": "jetson-orin-latency"}
    assert envelope["expires_at"] - envelope["issued_at"] == 365 * 86400 * 1000

    cleared = fleet(broker, "desired", "orin-9", "--clear", "--key", str(key_file))
    assert cleared.returncode == 0, cleared.stderr
    assert cleared.stdout.strip() == f"cleared desired state on {topic}"
    # the clear is signed and retained in the state's place: a node offline now hears of it
    [clear] = retained(broker, topic)
    assert trusted_keys(key).verify(clear) == trusted(key)[0]["id"]
    assert (clear["clear"], clear["args"], clear["fleet"]) == (True, {}, FLEET)
    assert clear["issued_at"] >= envelope["issued_at"] and clear["id"] != envelope["id"]
    unkeyed = fleet(broker, "desired", "orin-9", "--clear")
    assert unkeyed.returncode == 2 and "--key" in unkeyed.stderr  # no clear without a key


def test_desired_json_names_what_it_published(broker: Broker, key_file: Path) -> None:
    topic = f"edge/v1/{FLEET}/group/line-a/desired"
    done = fleet(broker, "desired", "group:line-a", "--model", "/opt/models/v7.onnx",
                 "--sha256", "ab" * 32, "--ttl", "600", "--key", str(key_file), "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    [envelope] = retained(broker, topic)
    assert report == {"topic": topic, "target": "group:line-a", "cleared": False,
                      "id": envelope["id"], "issued_at": envelope["issued_at"],
                      "expires_at": envelope["expires_at"],
                      "args": {"model": "/opt/models/v7.onnx", "sha256": "ab" * 32}}
    assert report["expires_at"] - report["issued_at"] == 600_000
    cleared = json.loads(fleet(broker, "desired", "group:line-a", "--clear", "--key",
                               str(key_file), "--json").stdout)
    [clear] = retained(broker, topic)
    assert cleared == {"topic": topic, "target": "group:line-a", "cleared": True,
                       "id": clear["id"], "issued_at": clear["issued_at"],
                       "expires_at": clear["expires_at"], "args": {}}
    assert clear["clear"] is True


def test_desired_qos_names_models_by_their_whole_name_and_refuses_what_is_not_json(
        broker: Broker, key_file: Path) -> None:
    topic = f"edge/v1/{FLEET}/orin-9/desired"
    done = fleet(broker, "desired", "orin-9", "--key", str(key_file), "--qos",
                 'det.v2={"class": "latency_critical", "p99_ms": 20}', "--qos", "old=null")
    assert done.returncode == 0, done.stderr
    [envelope] = retained(broker, topic)
    assert envelope["args"] == {"models": {
        "det.v2": {"qos": {"class": "latency_critical", "p99_ms": 20}},
        "old": {"qos": None}}}
    for bad, why in (("det", "expected MODEL=JSON"),
                     ("det=fast", "--qos det=fast: the value is not JSON"),
                     ("det=NaN", "NaN is not a finite number"),
                     # what every node's schema refuses, with what it accepts: never retained
                     ('det={"class": "fast"}', "the desired state: models.det.qos.class must "
                      "be one of ['latency_critical', 'throughput', 'best_effort']"),
                     ('det={"class": "throughput", "p99_ms": "20"}',
                      "models.det.qos.p99_ms must be number (expected a number "
                      "0.01..3600000); nothing was sent"),
                     ('det={"class": "throughput", "extra": 1}', "models.det.qos: unknown "
                      "key extra (expected an object with keys class (required), p99_ms, "
                      "min_rps; or null)"),
                     ('det={"p99_ms": 5}', "models.det.qos: class missing"),
                     ('bad/name=null', "models: 'bad/name' is not a name allowed here "
                      "(expected each name a string matching")):
        refused = fleet(broker, "desired", "orin-9", "--key", str(key_file), "--qos", bad)
        assert refused.returncode == 2 and why in refused.stderr, refused.stderr
    twice = fleet(broker, "desired", "orin-9", "--key", str(key_file), "--qos", "det=null",
                  "--qos", 'det={"class": "throughput"}')
    assert twice.returncode == 2 and "model det was given a qos already" in twice.stderr
    both = fleet(broker, "desired", "orin-9", "--key", str(key_file), "--clear", "--qos",
                 "det=null")
    assert both.returncode == 2 and "--clear takes no" in both.stderr
    assert retained(broker, topic) == [envelope]  # nothing refused was published


# -- a broker that cannot be used --------------------------------------------------------------


def acl_broker(directory: Path, acl: str) -> Broker:
    """Mosquitto with user ``operator`` (password ``secret``) confined by ``acl``."""
    server = Broker(directory, users={"operator": "secret"})
    (directory / "acl").write_text(acl)
    with server.config.open("a") as config:
        config.write(f"acl_file {directory / 'acl'}\n")
    server.start()
    return server


def operator_config(tmp_path: Path, broker: Broker, password: str) -> Path:
    (tmp_path / "password").write_text(password + "\n")
    config = tmp_path / "operator.yaml"
    config.write_text(json.dumps({"fleet": FLEET, "mqtt": {
        "host": broker.host, "port": broker.port, "username": "operator",
        "password_file": str(tmp_path / "password")}}))
    return config


@pytest.mark.parametrize("action", [["watch", "--once"], ["send", "orin-1", "ping"],
                                    ["desired", "orin-1", "--profile", "x"]])
def test_an_unreachable_broker_is_one_line_and_exit_2(
        action: list[str], key_file: Path) -> None:
    from mqtt_helpers import free_port

    key = ["--key", str(key_file)] if action[0] != "watch" else []
    for broker, why in ((f"127.0.0.1:{free_port()}", "Connection refused"),
                        ("no-such-host.invalid:1883", "")):
        done = subprocess.run([sys.executable, "-m", "agent", "fleet", *action, *key,
                               "--broker", broker], capture_output=True, text=True, cwd=REPO,
                              timeout=60, check=False)
        assert done.returncode == 2, done.stderr
        [line] = done.stderr.splitlines()
        assert line.startswith(f"edge-agent fleet: cannot reach the broker {broker}: "), line
        assert why in line


def test_a_broker_that_never_answers_the_handshake_is_exit_2() -> None:
    import socket

    with socket.socket() as silent:  # the kernel accepts; nobody ever answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "agent", "fleet", "watch", "--once",
                               "--broker", f"127.0.0.1:{port}"], capture_output=True,
                              text=True, cwd=REPO, timeout=60, check=False)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"edge-agent fleet: the broker 127.0.0.1:{port} did not answer the MQTT handshake "
        "within 5 s"]
    assert time.monotonic() - started < 30


def test_a_refused_login_is_exit_2(tmp_path: Path) -> None:
    server = acl_broker(tmp_path / "broker", "user operator\ntopic readwrite edge/v1/#\n")
    try:
        wrong = subprocess.run([sys.executable, "-m", "agent", "fleet", "watch", "--once",
                                "--config", str(operator_config(tmp_path, server, "guess"))],
                               capture_output=True, text=True, cwd=REPO, timeout=60,
                               check=False)
        assert wrong.returncode == 2
        [line] = wrong.stderr.splitlines()
        # Mosquitto 2.0 answers a wrong password with "Not authorized", later ones with
        # "Bad user name or password"
        assert line.startswith(f"edge-agent fleet: the broker {server.host}:{server.port} "
                               "refused the connection: "), line
        assert line.endswith(("Not authorized", "Bad user name or password")), line
        right = subprocess.run([sys.executable, "-m", "agent", "fleet", "watch", "--once",
                                "--settle", "0", "--config",
                                str(operator_config(tmp_path, server, "secret"))],
                               capture_output=True, text=True, cwd=REPO, timeout=60,
                               check=False)
        assert right.returncode == 0, right.stderr
    finally:
        server.stop()


# -- watch ----------------------------------------------------------------------------------


def test_watch_shows_the_profile_of_the_newer_of_birth_and_telemetry() -> None:
    birth = {"ts": 1000, "profile": {"name": "jetson-orin-latency", "applied": True}}
    rolled_back = {"ts": 2000, "metrics": {"tuning": {"profile": None, "applied": False}}}
    assert watch_rows({"n": {"birth": birth, "telemetry": rolled_back}})[1][2] == "-"
    older = {"ts": 500, "metrics": {"tuning": {"profile": "jetson-orin", "applied": False}}}
    assert watch_rows({"n": {"birth": birth, "telemetry": older}})[1][2] == \
        "jetson-orin-latency"
    assert watch_rows({"n": {"birth": birth}})[1][2] == "jetson-orin-latency"


def test_a_replayed_telemetry_record_does_not_hide_the_live_one() -> None:
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion

    from agent.control.operator import Bus

    bus = Bus(fleet=FLEET, client=mqtt.Client(CallbackAPIVersion.VERSION2))
    for ts, historical in ((2000, False), (1000, True)):  # the replay comes in second
        message = mqtt.MQTTMessage(topic=f"edge/v1/{FLEET}/orin-1/telemetry".encode())
        message.payload = json.dumps({"ts": ts, "historical": historical,
                                      "metrics": {}}).encode()
        bus.on_message(bus.client, None, message)
    assert bus.nodes()["orin-1"]["telemetry"]["ts"] == 2000


@pytest.fixture()
def online_node(tmp_path: Path, broker: Broker, key: Ed25519PrivateKey) -> Iterator[str]:
    """One node (the real link and controller, answering ping), online in group line-a."""
    node = SimulatedNode("sim-1", broker, tmp_path, trusted_keys(key),
                         groups=("line-a",))
    node.start()
    try:
        assert wait_until(lambda: node.link.status.state == "connected", 30)
        yield "sim-1"
    finally:
        node.stop()


def test_watch_into_a_pipe_prints_each_table_once_without_screen_codes(
        broker: Broker, online_node: str) -> None:
    done = fleet(broker, "watch", "--seconds", "2.5")
    assert done.returncode == 0, done.stderr
    assert "\033" not in done.stdout
    tables = done.stdout.rstrip("\n").split("\n\n")
    assert len(tables) >= 3  # one a second, and one more at the end
    for text in tables:
        header, *rows = text.splitlines()
        assert header.split() == ["NODE", "STATE", "PROFILE", "MODEL", "P99_MS", "HOTTEST_C",
                                  "OUTBOX"]
        assert [row.split()[:2] for row in rows] == [[online_node, "online"]]


def test_watch_json_is_one_object_per_line_and_refresh(broker: Broker,
                                                       online_node: str) -> None:
    done = fleet(broker, "watch", "--json", "--seconds", "1.5")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) >= 2
    for line in lines:
        refresh = json.loads(line)
        assert refresh["fleet"] == FLEET and isinstance(refresh["ts"], int)
        [record] = refresh["nodes"]
        assert record["node"] == online_node and record["state"] == "online"
        assert set(record) == {"node", "state", "profile", "model", "p99_ms", "hottest_c",
                               "outbox_depth", "telemetry_ts"}
    once = fleet(broker, "watch", "--json", "--once", "--settle", "0")
    assert once.returncode == 0, once.stderr
    [line] = once.stdout.splitlines()
    assert [r["node"] for r in json.loads(line)["nodes"]] == [online_node]


@pytest.mark.parametrize(("fleet_name", "target", "where"), [
    ("empty", "all", "fleet empty"),  # a fleet nobody is in
    (FLEET, "group:line-b", f"group line-b of fleet {FLEET}")])  # sim-1 is in line-a only
def test_send_to_nobody_online_says_so_at_once(broker: Broker, key_file: Path,
                                               online_node: str, fleet_name: str,
                                               target: str, where: str) -> None:
    started = time.monotonic()
    empty = subprocess.run([sys.executable, "-m", "agent", "fleet", "send", target, "ping",
                            "--key", str(key_file), "--timeout", "30", "--fleet", fleet_name,
                            "--broker", f"{broker.host}:{broker.port}"],
                           capture_output=True, text=True, cwd=REPO, timeout=60, check=False)
    assert empty.returncode == 1
    assert empty.stderr.splitlines() == [
        f"edge-agent fleet send: no online nodes in {where}; nothing was sent"]
    assert empty.stdout == ""
    assert time.monotonic() - started < 15  # not the 30 s timeout


def test_send_refuses_args_every_node_would_refuse_before_anything_is_sent(
        broker: Broker, key_file: Path) -> None:
    """Checked against the command's schema here, with what it accepts; a command this
    client does not know goes to the nodes, which judge it (and answer it unknown)."""
    for words, why in ((("set-qos", "--arg", "model=m", "--arg", "qos.class=fast"),
                        "set-qos's args: qos.class must be one of ['latency_critical', "
                        "'throughput', 'best_effort']; nothing was sent"),
                       (("apply-profile", "--arg", "profile=x", "--arg", "bogus=1"),
                        "apply-profile's args: unknown key bogus (expected an object with "
                        "keys profile (required), force, guard)"),
                       (("ping", "--arg", "x=1"), "ping's args: takes no arguments"),
                       (("set-qos", "--arg", "model=123", "--arg", "qos=null"),
                        "model must be string (expected a string matching "
                        "^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,63}$) (--arg reads 123, true and null "
                        "as JSON: quote a text that looks like one, KEY='\"123\"')"),
                       (("apply-profile", "--arg", "profile=Bad.Name"), "profile must "
                        "match pattern ^[a-z0-9][a-z0-9_-]{0,63}$; nothing was sent"),
                       (("set-telemetry", "--arg", "interval_s=0"),
                        "interval_s must be bigger than or equal to 0.05 (expected a number "
                        "0.05..86400)")):
        refused = fleet(broker, "send", "orin-9", *words, "--key", str(key_file))
        assert refused.returncode == 2, refused.stderr
        assert why in refused.stderr, refused.stderr
    for words, why in ((("--arg", "qos=null", "--arg", "qos.class=best_effort"),
                        "--arg qos.class=best_effort: qos was given a value already, so it has "
                        "no keys to set"),
                       (("--arg", "qos.class=best_effort", "--arg", "qos=null"),
                        "--arg qos=null: qos was given keys already (qos.KEY=...); give one "
                        "or the other")):  # a traceback, and a key dropped without a word
        refused = fleet(broker, "send", "orin-9", "set-qos", "--arg", "model=m", *words,
                        "--key", str(key_file))
        assert refused.returncode == 2, refused.stderr
        assert refused.stderr.splitlines()[-1].endswith(why), refused.stderr
    merged = fleet(broker, "send", "orin-9", "set-qos", "--arg", "model=m", "--arg",
                   "qos.class=fast", "--args-json", '{"qos": {"p99_ms": 5}}', "--key",
                   str(key_file))  # merged at depth: the class is judged, not lost
    assert "qos.class must be one of ['latency_critical'" in merged.stderr, merged.stderr
    newer = fleet(broker, "send", "orin-9", "reboot-into-orbit", "--key", str(key_file),
                  "--timeout", "1")
    assert "nothing was sent" not in newer.stderr, newer.stderr  # sent, to nobody online


def test_ctrl_c_and_sigterm_end_watch_and_send_cleanly(
        broker: Broker, key_file: Path, online_node: str) -> None:
    where = ["--broker", f"{broker.host}:{broker.port}", "--fleet", FLEET]
    for signum, code in ((signal.SIGINT, 130), (signal.SIGTERM, 0)):
        watch = subprocess.Popen(
            sigint_at_default(sys.executable, "-m", "agent", "fleet", "watch", *where),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
        assert watch.stdout is not None
        assert watch.stdout.readline().startswith("NODE")  # it is watching
        watch.send_signal(signum)
        _, errors = watch.communicate(timeout=30)
        assert watch.returncode == code
        assert errors == ""

    listener = Subscriber(broker, [f"edge/v1/{FLEET}/ghost/cmd/ping"], client_id="listener")
    try:
        assert listener.subscribed.wait(10)
        send = subprocess.Popen(
            sigint_at_default(sys.executable, "-m", "agent", "fleet", "send", "ghost", "ping",
                              "--key", str(key_file), "--timeout", "60", *where),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
        assert wait_until(lambda: listener.on("ping"), 30)  # sent: now waiting for replies
        send.send_signal(signal.SIGINT)
        _, errors = send.communicate(timeout=30)
    finally:
        listener.close()
    assert send.returncode == 130
    assert errors.splitlines() == ["edge-agent fleet send: interrupted"]


# -- send: what a person reads ----------------------------------------------------------------


def test_send_shows_each_result_and_whole_reasons_to_a_person(
        tmp_path: Path, broker: Broker, key: Ed25519PrivateKey, key_file: Path) -> None:
    root = copy_board("jetson-agx-orin-jp6", tmp_path)
    config = {**node_config(tmp_path, root, broker, key, allow=["get-status", "apply-profile"]),
              "tuning": {"profile": "jetson-orin-latency", "apply": True}}
    with running_node(config) as service:
        assert wait_until(lambda: service.last is not None and "inference" in
                          service.last["metrics"], 30)
        done = fleet(broker, "send", "orin-1", "get-status", "--key", str(key_file))
        refused = fleet(broker, "send", "orin-1", "apply-profile", "--arg",
                        "profile=no-such-profile", "--key", str(key_file))
    assert done.returncode == 0, done.stderr
    head, _, body = done.stdout.partition("\n\n")
    assert head.splitlines()[-1].split() == ["orin-1", "succeeded", "ok", head.split()[-1]]
    lines = body.splitlines()
    assert lines[0] == "orin-1:"
    assert lines[1].startswith("  connected s") and " | outbox " in lines[1]
    assert lines[2].startswith("  up ") and lines[2].endswith(f", pid {os.getpid()}")
    assert any(line.startswith("  profile: jetson-orin-latency (applied, ") and
               line.endswith(", drift 0)") for line in lines)
    assert "  model: demo version 1 on onnxruntime cpu fp32" in lines
    assert any(line.startswith("  data plane: ready, http 127.0.0.1:") for line in lines)
    assert "{" not in body  # laid out, not a dict

    assert refused.returncode == 1
    reason = ("profile: no profile named 'no-such-profile' (available: balanced, jetson-orin, "
              "jetson-orin-latency, latency, powersave, realtime, rk3588, rk3588-latency, "
              "x86, x86-latency)")
    head, _, body = refused.stdout.partition("\n\n")
    row = head.splitlines()[-1]
    assert row.split()[:3] == ["orin-1", "failed", "invalid_profile"]
    shown = row.split(None, 4)[4]
    assert shown.endswith("…") and len(shown) <= 80
    kept = shown[:-1]
    assert reason.startswith(kept) and reason[len(kept):].startswith((" ", ", "))  # whole words
    assert " ".join(body.split()) == f"orin-1: message: {reason}"  # the whole, wrapped


@pytest.mark.parametrize(("text", "width", "expected"), [
    ("short enough", 80, "short enough"),
    ("one two three four", 12, "one two…"),
    ("one two, three", 13, "one two…"),  # no dangling comma before the ellipsis
    ("a/path/without/spaces/that/is/long", 10, "a/path/wi…"),  # one word: cut inside
    ("two\nlines", 80, "two lines")])
def test_a_message_is_cut_after_a_whole_word(text: str, width: int, expected: str) -> None:
    assert shorten(text, width) == expected
    assert len(shorten(text, width)) <= width
