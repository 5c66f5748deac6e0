"""The edge-agent command line as a person and a script use it, in a real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from agent_process import modules_loaded_by

REPO = Path(__file__).resolve().parents[1]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agent", *args], capture_output=True,
                          text=True, cwd=REPO, timeout=60, check=False)


def test_discover_json_is_the_contract() -> None:
    result = run_cli("discover", "--json")
    assert result.returncode == 0, result.stderr
    topology = json.loads(result.stdout)
    assert topology["schema"] == "topology/1"
    for key in ("board", "cpu", "memory", "gpus", "npus", "thermal", "power_rails", "block",
                "pci", "kernel", "warnings"):
        assert key in topology
    assert topology["cpu"]["count"] == len(topology["cpu"]["online"]) + len(
        topology["cpu"]["offline"])
    assert topology["kernel"]["release"] == os.uname().release


def test_discover_summary_is_readable() -> None:
    result = run_cli("discover")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("Board")
    assert any(line.startswith("CPU") and f"{os.cpu_count()} CPUs" in line for line in lines)
    assert any(line.startswith("Kernel") and os.uname().release in line for line in lines)


def test_missing_root_is_a_one_line_error(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    result = run_cli("discover", "--root", str(missing))
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        f"edge-agent discover: --root {missing}: no such directory"]


def test_discover_does_not_import_inference_or_mqtt() -> None:
    assert modules_loaded_by("from agent.cli import main; main(['discover', '--json'])",
                             "onnxruntime", "paho", "numpy") == []


def test_loading_the_config_stays_light(tmp_path: Path) -> None:
    """run, status and config check load the config first: naming the metric groups must
    not load the collectors, nor inference or MQTT."""
    config = tmp_path / "agent.yaml"
    config.write_text("telemetry: {metrics: [cpu, inference]}\n")
    assert modules_loaded_by(f"from agent.config import load_config; "
                             f"load_config({str(config)!r})", "onnxruntime", "paho", "numpy",
                             "cryptography", "agent.telemetry.collectors") == []


@pytest.mark.parametrize(("args", "flag", "value"), [
    (["run", "--seconds", "-5"], "--seconds", "-5"),
    (["run", "--seconds", "0"], "--seconds", "0"),
    (["run", "--seconds", "nan"], "--seconds", "nan"),
    (["selftest", "--seconds", "0"], "--seconds", "0"),
    (["infer", "--seconds", "-1"], "--seconds", "-1"),
    (["infer", "--rate", "0"], "--rate", "0"),
    (["infer", "--rate", "inf"], "--rate", "inf"),
    (["fleet", "send", "all", "ping", "--key", "k.pem", "--timeout", "0"], "--timeout", "0"),
    (["fleet", "send", "all", "ping", "--key", "k.pem", "--ttl", "-60"], "--ttl", "-60"),
    (["fleet", "watch", "--seconds", "0"], "--seconds", "0"),
    (["fleet", "desired", "n1", "--key", "k.pem", "--ttl", "0"], "--ttl", "0"),
])
def test_durations_and_rates_must_be_above_zero(args: list[str], flag: str,
                                                value: str) -> None:
    result = run_cli(*args)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].endswith(
        f"error: argument {flag}: {value}: expected a number above 0")


def test_a_settle_time_may_be_zero_but_not_negative() -> None:
    result = run_cli("fleet", "watch", "--once", "--settle", "-2")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].endswith(
        "error: argument --settle: -2: expected a number 0 or above")
