"""``build-model`` through a real Mosquitto with real signed commands, on a whole agent whose
build is the test's own (agent.modelbuild's core is tested on its own): a job beside the
command worker, installed through the canary with its build.json; and set-model judging a
build.json beside the file it installs."""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest.mock import ANY

import numpy as np
import onnx
import pytest
from control_helpers import Operator, node_config, running_node
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from mqtt_helpers import Broker, wait_until
from tuning_helpers import copy_board

from agent.control.controller import Progress
from agent.inference.demo_model import DEMO_MODEL_PATH
from agent.service.builds import BuildSpec
from agent.service.node import Service

BOARD = "jetson-agx-orin-jp6"
CALM_GUARD = {"max_p99_ratio": 1000, "max_error_rate": 1}  # a canary noise cannot fail
PASSED = {"passed": True, "reason": "int8 per-channel met the gate", "target": "cpu",
          "precision": "int8", "gate": {"top1": 1.0, "cosine": 0.9995, "speed": 1.8}}
REFUSED = {"passed": False, "reason": "no variant met the gate", "target": "cpu",
           "precision": "int8", "variants": [
               {"name": "int8 per-tensor", "refused": "cosine 0.91 below 0.999"},
               {"name": "int8 per-channel", "refused": "top1 0.95 below 0.99"}]}


@dataclass
class FakeReport:
    passed: bool
    reason: str
    model_file: Path | None
    document: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return self.document


@dataclass
class FakeBuilder:
    """Builds by the source's name: ``good`` passes, ``weak`` fails its gate, ``broken``
    raises, ``slow`` waits for the agent to stop.  ``release`` holds ``good`` until set."""

    release: threading.Event = field(default_factory=threading.Event)
    started: threading.Event = field(default_factory=threading.Event)
    workdirs: list[Path] = field(default_factory=list)

    def __call__(self, spec: BuildSpec, workdir: Path, progress: Progress,
                 cancel: threading.Event) -> FakeReport:
        self.workdirs.append(workdir)
        kind = spec.source.stem
        if kind == "broken":
            raise RuntimeError("the quantizer fell over")
        progress("calibrating int8 per-channel")
        if kind == "slow":
            self.started.set()
            cancel.wait()  # the agent stops: the real core's subprocess would be killed
        elif kind == "good":
            self.started.set()
            assert self.release.wait(60)
        progress("checking the gate")
        shutil.copy(spec.source, workdir / "model.onnx")
        document = PASSED if kind in ("good", "slow") else REFUSED
        (workdir / "build.json").write_text(json.dumps(document))
        return FakeReport(document["passed"], document["reason"], workdir / "model.onnx",
                          document)


@pytest.fixture()
def builder() -> Iterator[FakeBuilder]:
    made = FakeBuilder()
    yield made
    made.release.set()


@pytest.fixture()
def node(tmp_path: Path, broker: Broker, key: Ed25519PrivateKey,
         builder: FakeBuilder) -> Iterator[Service]:
    config = node_config(tmp_path, copy_board(BOARD, tmp_path), broker, key,
                         guard={"window_s": 0.5, "canary_s": 0.5})
    with running_node(config, builder) as service:
        yield service


def models_dir(node: Service, *names: str) -> Path:
    """``<state_dir>/models`` (a model directory by default) with the demo model under each
    name."""
    directory = Path(node.config.state_dir) / "models"
    directory.mkdir(exist_ok=True)
    for name in names:
        shutil.copy(DEMO_MODEL_PATH, directory / name)
    return directory


def steps(operator: Operator, command_id: str) -> list[str]:
    return [r["step"] for r in operator.for_id(command_id) if r["status"] == "in_progress"]


def test_a_build_runs_beside_other_commands_and_installs_with_its_report(
        node: Service, operator: Operator, builder: FakeBuilder) -> None:
    models = models_dir(node, "good.onnx")
    build = operator.send("orin-1", "build-model", {"source": str(models / "good.onnx"),
                                                    "guard": CALM_GUARD})
    assert builder.started.wait(30)
    ping = operator.send("orin-1", "ping")
    assert operator.final(ping["id"])["status"] == "succeeded"
    status = operator.final(operator.send("orin-1", "get-status")["id"])
    assert status["status"] == "succeeded", status
    job = status["result"]["jobs"]["build"]  # what runs, and where it is
    assert (job["id"], job["command"], job["step"]) == (
        build["id"], "build-model", "calibrating int8 per-channel")
    assert node.status()["jobs"] == {"build": {**job, "running_s": ANY}}
    again = operator.send("orin-1", "build-model", {"source": str(models / "good.onnx")})
    busy = operator.final(again["id"])
    assert (busy["status"], busy["code"]) == ("failed", "busy")
    assert busy["result"] == {"running": build["id"]} and build["id"] in busy["message"]
    assert not [r for r in operator.for_id(build["id"]) if r["status"] != "in_progress"
                and r["status"] != "accepted"]  # the build still runs
    builder.release.set()
    final = operator.final(build["id"], seconds=60)
    assert final["status"] == "succeeded", final
    result = final["result"]
    assert (result["model"], result["version"], result["canary"]) == ("demo", 2, "passed")
    assert result["report"] == PASSED and result["build"] == PASSED
    assert result["files"] == ["build.json", "model.onnx"]
    assert steps(operator, build["id"]) == ["building demo for cpu (int8)",
                                            "calibrating int8 per-channel",
                                            "checking the gate", "installing"]
    version = Path(node.config.state_dir) / "repository/demo/2"
    assert sorted(p.name for p in version.iterdir()) == ["build.json", "model.onnx"]
    assert json.loads((version / "build.json").read_text()) == PASSED
    assert result["path"] == str(version / "model.onnx")  # the work directory is gone
    assert node.status()["jobs"] == {}
    assert not builder.workdirs[0].exists()
    assert wait_until(lambda: {"name": "demo", "versions": ["2"]}
                      in node.inference.served_models(), 10)  # type: ignore[union-attr]


def test_refused_builds_install_nothing_and_the_controller_goes_on(
        node: Service, operator: Operator, builder: FakeBuilder) -> None:
    models = models_dir(node, "weak.onnx", "broken.onnx", "slow.onnx")
    repository = Path(node.config.state_dir) / "repository" / "demo"

    def final(args: dict[str, Any]) -> dict[str, Any]:
        return operator.final(operator.send("orin-1", "build-model", args)["id"], seconds=60)

    outside = final({"source": "/etc/model.onnx"})
    assert (outside["status"], outside["code"]) == ("failed", "not_allowed")
    calibration = final({"source": str(models / "weak.onnx"), "calibration": "/etc"})
    assert calibration["code"] == "not_allowed" and "calibration /etc" in calibration["message"]
    elsewhere = final({"source": str(models / "weak.onnx"), "target": "rknn:rk3588"})
    assert elsewhere["code"] == "bad_args" and "this node runs cpu" in elsewhere["message"]
    assert builder.workdirs == []  # refused before any build

    weak = final({"source": str(models / "weak.onnx")})
    assert (weak["status"], weak["code"]) == ("failed", "gate_failed")
    assert weak["message"] == "demo: no variant met the gate; nothing installed"
    assert weak["result"]["report"]["variants"] == REFUSED["variants"]
    broken = final({"source": str(models / "broken.onnx")})
    assert (broken["status"], broken["code"]) == ("failed", "error")
    assert broken["message"] == "the quantizer fell over"
    assert operator.final(operator.send("orin-1", "ping")["id"])["status"] == "succeeded"
    assert not repository.exists()
    assert not [d for d in builder.workdirs if d.exists()]

    slow = operator.send("orin-1", "build-model", {"source": str(models / "slow.onnx")})
    assert builder.started.wait(30)
    node.stop(flush_s=0)  # cancels the build at its next step: never installed
    stopped = operator.final(slow["id"])
    assert (stopped["status"], stopped["code"]) == ("failed", "cancelled")
    assert "installing" not in steps(operator, slow["id"])
    assert not repository.exists()
    assert not [d for d in builder.workdirs if d.exists()]


def test_set_model_judges_the_build_report_beside_the_file(
        tmp_path: Path, node: Service, operator: Operator) -> None:
    def built(name: str, report: dict[str, Any]) -> Path:
        directory = Path(node.config.state_dir) / "models" / name
        directory.mkdir(parents=True)
        shutil.copy(DEMO_MODEL_PATH, directory / "model.onnx")
        (directory / "build.json").write_text(json.dumps(report))
        return directory / "model.onnx"

    def set_model(model: Path) -> dict[str, Any]:
        sent = operator.send("orin-1", "set-model", {"model": str(model), "guard": CALM_GUARD})
        return operator.final(sent["id"], seconds=60)

    failed = set_model(built("failed", REFUSED))
    assert (failed["status"], failed["code"]) == ("failed", "gate_failed")
    assert "the build failed its gate (no variant met the gate)" in failed["message"]
    assert failed["result"]["build"]["passed"] is False
    rk3588 = set_model(built("rk3588", {**PASSED, "target": "rknn:rk3588"}))
    assert rk3588["code"] == "gate_failed"
    assert "built for target 'rknn:rk3588'; this node runs cpu" in rk3588["message"]
    unreadable = built("unreadable", PASSED)
    (unreadable.parent / "build.json").write_text("{not json")
    assert set_model(unreadable)["code"] == "model_rejected"
    repository = Path(node.config.state_dir) / "repository" / "demo"
    assert not repository.exists()

    passed = set_model(built("passed", PASSED))
    assert passed["status"] == "succeeded", passed
    assert passed["result"]["build"] == PASSED and passed["result"]["version"] == 2
    version = repository / "2"
    assert sorted(p.name for p in version.iterdir()) == ["build.json", "model.onnx"]
    assert json.loads((version / "build.json").read_text()) == PASSED


def test_a_start_removes_a_version_whose_install_did_not_finish(
        tmp_path: Path, broker: Broker, key: Ed25519PrivateKey) -> None:
    config = node_config(tmp_path, copy_board(BOARD, tmp_path), broker, key)
    repository = Path(config["state_dir"]) / "repository" / "demo"
    for left in ("2", ".3.partial"):  # died in its canary; died while writing its files
        (repository / left).mkdir(parents=True)
        shutil.copy(DEMO_MODEL_PATH, repository / left / "model.onnx")
    (repository / "2" / ".installing").touch()
    (repository / "4").mkdir()  # a finished version stays
    shutil.copy(DEMO_MODEL_PATH, repository / "4" / "model.onnx")
    with running_node(config) as node:
        assert sorted(p.name for p in repository.iterdir()) == ["4"]
        assert wait_until(lambda: {"name": "demo", "versions": ["4"]}
                          in node.inference.served_models(), 10)  # type: ignore[union-attr]


def test_a_build_with_the_real_core_installs_the_int8_model_it_judged(
        tmp_path: Path, broker: Broker, key: Ed25519PrivateKey, operator: Operator) -> None:
    """agent.modelbuild's own build (no injected builder) on the demo CNN, calibrated on
    .npy batches under the model directory; the speed is not judged (speed=0), so the
    outcome does not depend on this machine's load."""
    config = node_config(tmp_path, copy_board(BOARD, tmp_path), broker, key,
                         guard={"window_s": 0.5, "canary_s": 0.5})
    with running_node(config) as service:
        models = models_dir(service, "demo-copy.onnx")
        inputs = models / "inputs"
        inputs.mkdir()
        rng = np.random.default_rng(3)
        for i in range(8):
            np.save(inputs / f"{i}.npy", rng.standard_normal((1, 3, 64, 64), np.float32))
        sent = operator.send("orin-1", "build-model", {
            "source": str(models / "demo-copy.onnx"), "calibration": str(inputs),
            "gate": {"top1": 0.5, "cosine": 0.95, "speed": 0}, "guard": CALM_GUARD})
        final = operator.final(sent["id"], seconds=120)
        assert final["status"] == "succeeded", final
        report = final["result"]["report"]
        assert report["chosen"] == "u8s8-per-channel" and report["inputs"] == {
            "calibration": 4, "heldout": 4}
        assert final["result"]["build"]["chosen"] == "u8s8-per-channel"
        assert steps(operator, sent["id"]) == [
            "building demo for cpu (int8)", "reading the original model",
            f"reading the inputs in {inputs}", "running the original on 4 held-out inputs",
            "preparing the model for quantization", "building u8s8-per-channel",
            "checking u8s8-per-channel on the held-out inputs", "installing"]
        version = Path(service.config.state_dir) / "repository/demo/2"
        installed = json.loads((version / "build.json").read_text())
        assert installed["passed"] is True and installed["source"]["path"] == str(
            models / "demo-copy.onnx")
        ops = {node.op_type for node in onnx.load(str(version / "model.onnx")).graph.node}
        assert "QuantizeLinear" in ops
