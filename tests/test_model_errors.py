"""A model file that is no ONNX model, as an operator meets it: ``infer`` and ``run`` name the
file and say what is wrong with it, in one line."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from agent_process import start_agent, status, write_config
from mqtt_helpers import Broker, Subscriber, wait_until

from agent.inference.demo_model import DEMO_MODEL_PATH

WORKTREE = Path(__file__).resolve().parent.parent
NOT_ONNX = "not an ONNX model (onnxruntime: "


def junk(tmp_path: Path) -> Path:
    path = tmp_path / "m.onnx"
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 8)  # a picture, say
    return path


def truncated(tmp_path: Path) -> Path:
    path = tmp_path / "cut.onnx"
    model = DEMO_MODEL_PATH.read_bytes()
    path.write_bytes(model[: len(model) * 2 // 3])  # a download that stopped
    return path


def infer(tmp_path: Path, model: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agent", "infer", "--model", str(model),
                           "--seconds", "1", "--state-dir", str(tmp_path / "state")],
                          cwd=WORKTREE, capture_output=True, text=True, timeout=60,
                          check=False)


def test_infer_names_a_file_that_is_no_onnx_model(tmp_path: Path) -> None:
    for model in (junk(tmp_path), truncated(tmp_path)):
        result = infer(tmp_path, model)
        assert result.returncode == 1, result.stderr
        (line,) = result.stderr.splitlines()  # one line, no warning about the cache
        assert line.startswith(f"edge-agent infer: {model}: {NOT_ONNX}"), line
        assert result.stdout == ""


def test_infer_names_a_missing_file_the_same_way(tmp_path: Path) -> None:
    absent = tmp_path / "absent.onnx"
    result = infer(tmp_path, absent)
    assert result.returncode == 1
    assert result.stderr == f"edge-agent infer: {absent}: cannot read it: No such file or " \
                            "directory\n"


def test_run_reports_the_same_message_as_its_problem(tmp_path: Path, broker: Broker) -> None:
    model = junk(tmp_path)
    # the data plane names the entry inference.model made (after the file: m), its version
    # and the file
    expected = f"data plane: model m version 1: {model}: {NOT_ONNX}"
    watcher = Subscriber(broker, ["edge/v1/lab/orin-1/state"])
    config = write_config(tmp_path, broker.port, inference={"model": str(model)})
    agent = start_agent(config)
    try:
        # degraded from the start ("data plane: starting"), then for the model's reason
        assert wait_until(lambda: watcher.on("state") and watcher.on("state")[-1].get(
            "reason", "").startswith(expected), 60), (agent.stdout, watcher.on("state"))
        assert watcher.on("state")[-1]["state"] == "degraded"
        assert wait_until(lambda: status(config)[1].get("problems"), 30)
        (problem,) = status(config)[1]["problems"]
        assert problem.startswith(expected) and problem.endswith(")")
        assert problem == watcher.on("state")[-1]["reason"]
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.communicate(timeout=30)
        watcher.close()
    assert agent.returncode == 0
