"""A model's ``qos:`` set from the fleet, through a real Mosquitto into a running agent: the
signed ``set-qos`` command and desired state's ``models`` write the model's config.yaml (the
original kept for ``model tune --rollback``), the data plane serves the new objective, and
what cannot be set is refused with its reason."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from control_helpers import FLEET, Operator, node_config, running_node, sign
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from mqtt_helpers import Broker, wait_until
from onnx_models import mlp
from tuning_helpers import copy_board

from agent.control import schemas
from agent.modeltune import configfile
from agent.service.node import Service
from agent.serving import settings

BOARD = "jetson-agx-orin-jp6"
REPO = Path(__file__).resolve().parents[1]
# an operator's file: the keys set-qos does not touch must come through as they were
ORIGINAL = b"# tuned by hand\nmax_batch_size: 0\ninstances:\n- {count: 1, threads: 1}\n"
LATENCY = {"class": "latency_critical", "p99_ms": 20}


@pytest.fixture()
def node(tmp_path: Path, broker: Broker, key: Ed25519PrivateKey) -> Iterator[Service]:
    version = tmp_path / "state" / "repository" / "m" / "1"
    version.mkdir(parents=True)
    mlp(version / "model.onnx")
    (version.parent / "config.yaml").write_bytes(ORIGINAL)
    config = node_config(tmp_path, copy_board(BOARD, tmp_path), broker, key)
    with running_node(config) as service:
        assert service.inference is not None
        assert wait_until(lambda: {"name": "m", "versions": ["1"]}
                          in service.inference.served_models(), 60)  # type: ignore[union-attr]
        yield service


def model_dir(node: Service) -> Path:
    return Path(node.config.state_dir) / "repository" / "m"


def served_parameters(node: Service, model: str) -> dict[str, str]:
    """The data plane's config view of ``model``: its parameters (``qos.*`` among them)."""
    assert node.inference is not None
    status, _, body = node.inference.supervisor.client().request(
        "GET", f"/v2/models/{model}/config")
    assert status == 200, body
    parameters = json.loads(body)["parameters"]
    return {key: value["string_value"] for key, value in parameters.items()}


def file_identity(path: Path) -> tuple[int, int, bytes]:
    info = os.stat(path)
    return info.st_ino, info.st_mtime_ns, path.read_bytes()


def test_set_qos_writes_the_key_the_data_plane_serves_it_and_null_removes_it(
        node: Service, operator: Operator) -> None:
    directory = model_dir(node)
    assert not any(key.startswith("qos.") for key in served_parameters(node, "m"))
    reply = operator.final(operator.send("orin-1", "set-qos",
                                         {"model": "m", "qos": LATENCY})["id"], seconds=60)
    assert reply["status"] == "succeeded", reply
    assert reply["result"] == {"model": "m", "file": str(directory / "config.yaml"),
                               "before": None, "after": LATENCY, "written": True,
                               "reloaded": True}
    written = yaml.safe_load((directory / "config.yaml").read_text())
    assert written == {"max_batch_size": 0, "instances": [{"count": 1, "threads": 1}],
                       "qos": LATENCY}
    assert (directory / configfile.PREVIOUS).read_bytes() == ORIGINAL  # kept for rollback
    parameters = served_parameters(node, "m")
    assert (parameters["qos.class"], float(parameters["qos.p99_ms"])) == ("latency_critical",
                                                                          20.0)
    assert "qos.min_rps" not in parameters

    # the same again: nothing written, nothing loaded
    before = file_identity(directory / "config.yaml")
    again = operator.final(operator.send("orin-1", "set-qos",
                                         {"model": "m", "qos": LATENCY})["id"], seconds=60)
    assert again["status"] == "succeeded", again
    assert (again["result"]["written"], again["result"]["reloaded"]) == (False, False)
    assert again["result"]["before"] == again["result"]["after"] == LATENCY
    assert file_identity(directory / "config.yaml") == before

    # a class the schema does not know: refused with the key and the allowed values
    bad = operator.final(operator.send("orin-1", "set-qos", {
        "model": "m", "qos": {"class": "fastest", "p99_ms": 5}})["id"])
    assert (bad["status"], bad["code"]) == ("rejected", "bad_args"), bad
    assert "qos.class must be one of ['latency_critical', 'throughput', 'best_effort']" in \
        bad["message"]
    assert file_identity(directory / "config.yaml") == before

    # null: no objective any more; the rest of the file stays
    removed = operator.final(operator.send("orin-1", "set-qos",
                                           {"model": "m", "qos": None})["id"], seconds=60)
    assert removed["status"] == "succeeded", removed
    assert (removed["result"]["before"], removed["result"]["after"]) == (LATENCY, None)
    assert removed["result"]["written"] and removed["result"]["reloaded"]
    assert yaml.safe_load((directory / "config.yaml").read_text()) == {
        "max_batch_size": 0, "instances": [{"count": 1, "threads": 1}]}
    assert not any(key.startswith("qos.") for key in served_parameters(node, "m"))
    # model tune --rollback puts back the operator's file byte for byte, comment and all
    configfile.rollback(directory)
    assert (directory / "config.yaml").read_bytes() == ORIGINAL


def test_set_qos_refuses_a_built_in_model_and_an_unknown_one_and_writes_nothing(
        node: Service, operator: Operator) -> None:
    repository = model_dir(node).parent
    builtin = operator.final(operator.send("orin-1", "set-qos",
                                           {"model": "demo", "qos": LATENCY})["id"])
    assert (builtin["status"], builtin["code"]) == ("failed", "builtin_model"), builtin
    assert "model demo: built in" in builtin["message"]
    assert "no config.yaml to set qos in" in builtin["message"]
    unknown = operator.final(operator.send("orin-1", "set-qos",
                                           {"model": "nope", "qos": None})["id"])
    assert (unknown["status"], unknown["code"]) == ("failed", "not_found"), unknown
    assert sorted(p.name for p in repository.iterdir()) == ["m"]  # no directory made
    assert not any(key.startswith("qos.") for key in served_parameters(node, "demo"))


def test_a_broken_config_yaml_is_refused_naming_its_key_and_left_as_it_is(
        node: Service, operator: Operator) -> None:
    path = model_dir(node) / "config.yaml"
    broken = b"qos: {class: fast}\n" + ORIGINAL + b"precision: fp64\n"  # not only qos: the
    # other key is named (it named qos, which the command mends, when qos came first)
    path.write_bytes(broken)
    reply = operator.final(operator.send("orin-1", "set-qos",
                                         {"model": "m", "qos": LATENCY})["id"])
    assert (reply["status"], reply["code"]) == ("failed", "bad_config"), reply
    assert f"{path}: precision: 'fp64' is not allowed" in reply["message"]
    assert path.read_bytes() == broken
    assert not (path.parent / configfile.PREVIOUS).exists()


def test_a_mistyped_qos_in_the_file_is_mended_by_set_qos(node: Service,
                                                       operator: Operator) -> None:
    """What an operator wrote by hand and the data plane refuses, when qos is all that is
    wrong: the command that sets qos replaces it (it said 'fix it first' before)."""
    path = model_dir(node) / "config.yaml"
    path.write_bytes(ORIGINAL + b"qos: {class: fast, p99_ms: 20}\n")
    reply = operator.final(operator.send("orin-1", "set-qos",
                                         {"model": "m", "qos": LATENCY})["id"], seconds=60)
    assert reply["status"] == "succeeded", reply
    result = reply["result"]
    assert (result["before"], result["after"], result["written"]) == (None, LATENCY, True)
    assert f"{path}: qos.class: 'fast' is not allowed" in result["invalid_before"], result
    assert yaml.safe_load(path.read_text())["qos"] == LATENCY
    assert served_parameters(node, "m")["qos.class"] == "latency_critical"
    # removing it mends it as well
    path.write_bytes(ORIGINAL + b"qos: {class: throughput, p99_ms: -1}\n")
    removed = operator.final(operator.send("orin-1", "set-qos",
                                           {"model": "m", "qos": None})["id"], seconds=60)
    assert removed["status"] == "succeeded" and removed["result"]["written"], removed
    assert "qos" not in yaml.safe_load(path.read_text())

    # a model its mistyped qos kept from serving serves once mended
    late = path.parent.parent / "late"
    shutil.copytree(path.parent, late, ignore=shutil.ignore_patterns("config.yaml*"))
    (late / "config.yaml").write_bytes(b"qos: {class: throughput, p99_ms: 0}\n")
    assert node.inference is not None
    client = node.inference.supervisor.client()
    [row] = [e for e in client.index() if e.name == "late"]
    assert row.state == "UNAVAILABLE" and "qos.p99_ms" in row.reason, row
    mended = operator.final(operator.send("orin-1", "set-qos",
                                          {"model": "late", "qos": None})["id"], seconds=60)
    assert mended["status"] == "succeeded" and mended["result"]["reloaded"], mended
    assert [e.state for e in client.index() if e.name == "late"] == ["READY"]


@pytest.mark.parametrize("kind", ["FIFO", "directory"])
def test_a_fifo_or_directory_in_place_of_config_yaml_is_refused_and_hangs_nothing(
        node: Service, operator: Operator, kind: str) -> None:
    """open(2) on a FIFO blocks until a writer comes: the command worker hung there (every
    later command only 'accepted'), and so did each data plane that scanned the repository.
    A directory was a raw IsADirectoryError, code 'error', with a traceback."""
    path = model_dir(node) / "config.yaml"
    path.unlink()
    if kind == "FIFO":
        os.mkfifo(path)
    else:
        path.mkdir()
    reply = operator.final(operator.send("orin-1", "set-qos",
                                         {"model": "m", "qos": LATENCY})["id"])
    assert (reply["status"], reply["code"]) == ("failed", "bad_config"), reply
    article = "a FIFO" if kind == "FIFO" else "a directory"
    assert reply["message"] == (f"{path}: is {article}, not a file; fix it first (nothing "
                                "written)")
    assert not (path.parent / configfile.PREVIOUS).exists()
    pong = operator.final(operator.send("orin-1", "ping", {})["id"])
    assert pong["status"] == "succeeded", pong  # the command worker is not stuck
    with pytest.raises(settings.ModelSettingsError, match=f"cannot read it: is {article}"):
        settings.read_settings(path)  # what the data plane's scan meets: no hang either


def test_a_config_yaml_linked_out_of_the_model_is_refused_in_an_operators_words(
        node: Service, operator: Operator, tmp_path: Path) -> None:
    """The file, where it links and what that leaves; it read '/config.yaml: resolves to
    /tmp/x.yaml, outside .../config.yaml' before."""
    path = model_dir(node) / "config.yaml"
    elsewhere = tmp_path / "shared.yaml"
    elsewhere.write_bytes(ORIGINAL)
    path.unlink()
    path.symlink_to(elsewhere)
    reply = operator.final(operator.send("orin-1", "set-qos",
                                         {"model": "m", "qos": LATENCY})["id"])
    assert (reply["status"], reply["code"]) == ("failed", "bad_config"), reply
    assert reply["message"] == (f"{path}: a link to {elsewhere}, which leaves the model "
                                f"directory {path.parent}; fix it first (nothing written)")
    assert elsewhere.read_bytes() == ORIGINAL and path.is_symlink()


def reported_for(operator: Operator, desired_id: str) -> dict[str, Any]:
    def found() -> dict[str, Any] | None:
        return next((r for r in operator.replies if r.get("schema") == "reported/1"
                     and r.get("desired_id") == desired_id), None)

    assert wait_until(lambda: found() is not None, 60), operator.replies[-3:]
    result = found()
    assert result is not None
    return result


def test_desired_state_applies_a_models_qos_and_applying_it_again_writes_nothing(
        node: Service, operator: Operator, key: Ed25519PrivateKey) -> None:
    directory = model_dir(node)
    topic = f"edge/v1/{FLEET}/orin-1/desired"
    operator.client.subscribe(f"edge/v1/{FLEET}/orin-1/reported", qos=1)
    wanted = {"class": "throughput", "p99_ms": 50, "min_rps": 100}
    try:
        first = sign(key, "desired", "node:orin-1", {"models": {"m": {"qos": wanted}}},
                     ttl_s=3600)
        operator.publish(topic, json.dumps(first).encode(), retain=True)
        reported = reported_for(operator, first["id"])
        assert reported["status"] == "converged", reported["message"]
        assert reported["models"] == {"m": {"qos": wanted, "written": True}}
        assert yaml.safe_load((directory / "config.yaml").read_text())["qos"] == wanted
        parameters = served_parameters(node, "m")
        assert (parameters["qos.class"], float(parameters["qos.min_rps"])) == ("throughput",
                                                                               100.0)
        before = file_identity(directory / "config.yaml")
        previous = file_identity(directory / configfile.PREVIOUS)

        # the same state again, newly signed: converged, nothing written
        second = sign(key, "desired", "node:orin-1", {"models": {"m": {"qos": wanted}}},
                      ttl_s=3600, now=first["issued_at"] / 1000 + 1)  # ordered after it
        operator.publish(topic, json.dumps(second).encode(), retain=True)
        again = reported_for(operator, second["id"])
        assert again["status"] == "converged", again["message"]
        assert again["models"] == {"m": {"qos": wanted, "written": False}}
        assert file_identity(directory / "config.yaml") == before
        assert file_identity(directory / configfile.PREVIOUS) == previous

        # a built-in model cannot hold one: the state fails with the reason, m stays
        third = sign(key, "desired", "node:orin-1", {"models": {"demo": {"qos": wanted}}},
                     ttl_s=3600, now=first["issued_at"] / 1000 + 2)
        operator.publish(topic, json.dumps(third).encode(), retain=True)
        failed = reported_for(operator, third["id"])
        assert failed["status"] == "failed" and "model demo: built in" in failed["message"]
        assert "models" not in failed
        assert file_identity(directory / "config.yaml") == before
    finally:
        operator.publish(topic, b"", retain=True)


def test_a_desired_state_one_of_whose_models_cannot_take_its_qos_changes_nothing(
        node: Service, operator: Operator, key: Ed25519PrivateKey) -> None:
    """Every model's qos is checked before the profile, the model or any file changes: a
    state naming a model the node lacks and one whose file is broken writes no model's."""
    directory = model_dir(node)
    broken = directory.parent / "broken"
    shutil.copytree(directory, broken)
    (broken / "config.yaml").write_text("max_batch_size: many\n")
    before = file_identity(directory / "config.yaml")
    topic = f"edge/v1/{FLEET}/orin-1/desired"
    operator.client.subscribe(f"edge/v1/{FLEET}/orin-1/reported", qos=1)
    wanted = {"class": "best_effort", "min_rps": 1}
    try:
        state = sign(key, "desired", "node:orin-1", {
            "profile": "jetson-orin-latency",
            "models": {"a-missing": {"qos": wanted}, "broken": {"qos": wanted},
                       "m": {"qos": wanted}}}, ttl_s=3600)
        operator.publish(topic, json.dumps(state).encode(), retain=True)
        reported = reported_for(operator, state["id"])
        assert reported["status"] == "failed", reported
        message = reported["message"]
        assert "model 'a-missing' is not in the repository" in message, message
        assert f"{broken / 'config.yaml'}: max_batch_size" in message, message
        assert message.endswith("none of the 3 models' qos was written"), message
        assert "models" not in reported and reported["profile"] is None
        assert not node.tuning.applied
        assert file_identity(directory / "config.yaml") == before
        assert not (directory / configfile.PREVIOUS).exists()
    finally:
        operator.publish(topic, b"", retain=True)


def test_a_desired_state_whose_reload_fails_puts_back_every_qos_it_wrote(
        node: Service, operator: Operator, key: Ed25519PrivateKey) -> None:
    """Whole or not at all, past the checks: n's file reads well but names a device this
    board lacks, so the data plane refuses to load it again once written.  m's qos, written
    before it, goes back too (it stayed written, found by a new operator's review)."""
    assert node.inference is not None
    directory = model_dir(node)
    other = directory.parent / "n"
    shutil.copytree(directory, other, ignore=shutil.ignore_patterns("config.yaml*"))
    node.inference.supervisor.client().load("n")
    bad = b"instances: [{device: 'dla:7'}]\n"  # served as it was before this was written
    (other / "config.yaml").write_bytes(bad)
    before = (directory / "config.yaml").read_bytes()
    topic = f"edge/v1/{FLEET}/orin-1/desired"
    operator.client.subscribe(f"edge/v1/{FLEET}/orin-1/reported", qos=1)
    wanted = {"class": "best_effort", "min_rps": 1}
    try:
        state = sign(key, "desired", "node:orin-1",
                     {"models": {"m": {"qos": wanted}, "n": {"qos": wanted}}}, ttl_s=3600)
        operator.publish(topic, json.dumps(state).encode(), retain=True)
        reported = reported_for(operator, state["id"])
        assert reported["status"] == "failed", reported
        assert "did not load n again" in reported["message"], reported["message"]
        assert reported["message"].endswith("the qos written put back (2 file(s))"), \
            reported["message"][-300:]
        assert "models" not in reported
        assert (directory / "config.yaml").read_bytes() == before
        assert (other / "config.yaml").read_bytes() == bad
        for marker in (configfile.PREVIOUS, configfile.ABSENT, configfile.WRITTEN):
            assert not (directory / marker).exists() and not (other / marker).exists()
        assert not any(key.startswith("qos.") for key in served_parameters(node, "m"))
    finally:
        operator.publish(topic, b"", retain=True)


def test_a_desired_state_failing_after_its_model_step_takes_the_new_version_back(
        node: Service, operator: Operator, key: Ed25519PrivateKey) -> None:
    """Whole or not at all, the model step too: the state installs a new version of the
    default model, then n's qos is written but n cannot be loaded again.  The new version
    goes, and the one before it serves as before.  Before, the node went on serving the new
    version under a state reported failed."""
    inference = node.inference
    assert inference is not None
    default, path_before = inference.default, inference.model_path
    versions_before = [m for m in inference.served_models() if m["name"] == default]
    models = Path(node.config.state_dir) / "models"
    models.mkdir(exist_ok=True)
    mlp(models / "other.onnx")
    other = model_dir(node).parent / "n"
    shutil.copytree(model_dir(node), other, ignore=shutil.ignore_patterns("config.yaml*"))
    inference.supervisor.client().load("n")
    (other / "config.yaml").write_bytes(b"instances: [{device: 'dla:7'}]\n")
    topic = f"edge/v1/{FLEET}/orin-1/desired"
    operator.client.subscribe(f"edge/v1/{FLEET}/orin-1/reported", qos=1)
    try:
        state = sign(key, "desired", "node:orin-1", {
            "model": str(models / "other.onnx"),
            "models": {"n": {"qos": {"class": "best_effort", "min_rps": 1}}}}, ttl_s=3600)
        operator.publish(topic, json.dumps(state).encode(), retain=True)
        reported = reported_for(operator, state["id"])
        assert reported["status"] == "failed", reported
        message = reported["message"]
        assert "did not load n again" in message, message
        installed = inference.repository / default
        assert message.endswith(f"; the qos written put back (1 file(s)); {default} "
                                f"version 2 taken back"), message[-300:]
        assert reported["model"] == path_before == inference.model_path
        assert not (installed / "2").exists()
        assert wait_until(lambda: [m for m in inference.served_models()  # type: ignore[union-attr]
                                   if m["name"] == default] == versions_before, 30)
    finally:
        operator.publish(topic, b"", retain=True)


def test_a_signed_desired_state_the_node_refuses_is_said_in_reported(
        node: Service, operator: Operator, key: Ed25519PrivateKey) -> None:
    """Not only in the node's audit: ``reported`` keeps the state it converged to and runs,
    and says which signed one it refused and why; a forged one is not said there."""
    topic = f"edge/v1/{FLEET}/orin-1/desired"
    operator.client.subscribe(f"edge/v1/{FLEET}/orin-1/reported", qos=1)
    wanted = {"class": "throughput", "p99_ms": 50}

    def refusal_of(desired_id: str) -> dict[str, Any] | None:
        return next((r for r in operator.replies if r.get("schema") == "reported/1" and
                     (r.get("refused") or {}).get("node:orin-1", {}).get("desired_id")
                     == desired_id), None)

    try:
        good = sign(key, "desired", "node:orin-1", {"models": {"m": {"qos": wanted}}},
                    ttl_s=3600)
        operator.publish(topic, json.dumps(good).encode(), retain=True)
        assert reported_for(operator, good["id"])["status"] == "converged"
        bad = sign(key, "desired", "node:orin-1", {"models": {"m": {"qos": {"class": "fast"}}}},
                   ttl_s=3600, now=good["issued_at"] / 1000 + 1)
        operator.publish(topic, json.dumps(bad).encode(), retain=True)
        assert wait_until(lambda: refusal_of(bad["id"]) is not None, 60)
        said = refusal_of(bad["id"])
        assert said is not None
        assert (said["desired_id"], said["status"]) == (good["id"], "converged")
        refused = said["refused"]["node:orin-1"]
        assert refused["code"] == "malformed", said
        assert "qos.class must be one of ['latency_critical'" in refused["message"]
        # one older than the state applied (an operator's clock behind): said, as stale
        old = sign(key, "desired", "node:orin-1", {"models": {"m": {"qos": None}}},
                   ttl_s=3600, now=good["issued_at"] / 1000 - 60)
        operator.publish(topic, json.dumps(old).encode(), retain=True)
        assert wait_until(lambda: refusal_of(old["id"]) is not None, 60)
        stale = refusal_of(old["id"])
        assert stale is not None and stale["refused"]["node:orin-1"]["code"] == "stale"
        # the group's own refusal is kept beside the node's, not in its place
        group = f"edge/v1/{FLEET}/group/line-a/desired"
        theirs = sign(key, "desired", "group:line-a", {"models": {"m": {"qos": {
            "class": "fast"}}}}, ttl_s=3600)
        operator.publish(group, json.dumps(theirs).encode(), retain=True)
        assert wait_until(lambda: any(
            (r.get("refused") or {}).get("group:line-a", {}).get("desired_id") == theirs["id"]
            for r in operator.replies), 60)
        both = next(r for r in operator.replies
                    if "group:line-a" in (r.get("refused") or {}))
        assert both["refused"]["node:orin-1"]["desired_id"] == old["id"]
        assert yaml.safe_load((model_dir(node) / "config.yaml").read_text())["qos"] == wanted

        forged = sign(Ed25519PrivateKey.generate(), "desired", "node:orin-1",
                      {"models": {"m": {"qos": {"class": "fast"}}}}, ttl_s=3600,
                      now=good["issued_at"] / 1000 + 2)
        operator.publish(topic, json.dumps(forged).encode(), retain=True)
        later = sign(key, "desired", "node:orin-1", {"models": {"m": {"qos": None}}},
                     ttl_s=3600, now=good["issued_at"] / 1000 + 3)
        operator.publish(topic, json.dumps(later).encode(), retain=True)
        after = reported_for(operator, later["id"])  # handled after the forged one
        assert after["status"] == "converged" and "refused" not in after, after
        assert refusal_of(forged["id"]) is None
    finally:
        operator.publish(topic, b"", retain=True)
        operator.publish(f"edge/v1/{FLEET}/group/line-a/desired", b"", retain=True)


def test_the_commands_qos_schema_has_the_bounds_a_config_yaml_has() -> None:
    """control.schemas repeats settings' classes and bounds (it sits below that layer)."""
    rule = schemas.QOS_OR_NONE["properties"]
    assert tuple(rule["class"]["enum"]) == settings.QOS_CLASSES
    for key, bounds in (("p99_ms", settings.QOS_P99_MS), ("min_rps", settings.QOS_MIN_RPS)):
        assert (rule[key]["minimum"], rule[key]["maximum"]) == bounds
        for value, fits in ((bounds[0], True), (bounds[1], True), (bounds[0] / 2, False),
                            (bounds[1] * 2, False)):
            qos = {"class": "best_effort", key: value}
            assert (schemas.check("set-qos", {"model": "m", "qos": qos}) is None) is fits
            try:
                settings.parse_settings({"qos": qos}, "config.yaml")
                accepted = True
            except settings.ModelSettingsError:
                accepted = False
            assert accepted is fits
    assert "set-qos" in schemas.COMMANDS


def test_the_operator_cli_sets_qos_with_its_arg_form(tmp_path: Path, node: Service,
                                                      broker: Broker, key: Ed25519PrivateKey
                                                      ) -> None:
    """The README's ``fleet send NODE set-qos --arg model=M --arg qos.class=...`` as run."""
    from agent.control.envelope import private_key_pem

    key_file = tmp_path / "operator.key"
    key_file.write_bytes(private_key_pem(key))
    sent = subprocess.run(
        [sys.executable, "-m", "agent", "fleet", "send", "orin-1", "set-qos", "--key",
         str(key_file), "--arg", "model=m", "--arg", "qos.class=best_effort", "--arg",
         "qos.min_rps=2.5", "--broker", f"{broker.host}:{broker.port}", "--fleet", FLEET,
         "--json"], capture_output=True, text=True, cwd=REPO, timeout=120, check=False)
    assert sent.returncode == 0, sent.stdout + sent.stderr
    [result] = json.loads(sent.stdout)["results"]
    assert result["status"] == "succeeded", result
    assert result["result"]["after"] == {"class": "best_effort", "min_rps": 2.5}
    assert yaml.safe_load((model_dir(node) / "config.yaml").read_text())["qos"] == {
        "class": "best_effort", "min_rps": 2.5}
    assert served_parameters(node, "m")["qos.class"] == "best_effort"
