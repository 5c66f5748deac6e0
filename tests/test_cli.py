"""The edge-agent command line as a person and a script use it, in a real subprocess."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from agent_process import modules_loaded_by

from agent.cli import build_parser, common
from agent.cli.common import (
    DEFAULT_STATE_DIR,
    EXIT_STATUS,
    UsageError,
    exit_status,
    resolve_state_dir,
)

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


def _command_lines(parser: argparse.ArgumentParser, words: list[str]) -> list[list[str]]:
    """``words`` and, below it, every group and action the parser knows."""
    found = [words]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _command_lines(sub, [*words, name])
    return found


COMMAND_LINES = _command_lines(build_parser(), [])
HEAVY = ("onnxruntime", "numpy", "paho", "cryptography", "yaml", "psutil")


def test_every_group_and_action_is_walked() -> None:
    """The --help check below covers what the parser offers, new groups included."""
    assert {tuple(words) for words in COMMAND_LINES} >= {
        (), ("discover",), ("profile", "rollback"), ("infer",), ("run",), ("status",),
        ("selftest",), ("config", "check"), ("fleet", "watch"), ("overlay", "install")}


@pytest.mark.parametrize("words", COMMAND_LINES, ids=lambda words: " ".join(words) or "-")
def test_help_loads_nothing_heavy(words: list[str]) -> None:
    """Building the parser imports every group module: none may load its subsystem before
    its handler runs."""
    statement = ("import contextlib\nfrom agent.cli import main\n"
                 f"with contextlib.suppress(SystemExit):\n    main({[*words, '--help']!r})")
    assert modules_loaded_by(statement, *HEAVY) == []


def test_each_error_type_in_the_exit_table_exists() -> None:
    """The table names its types (nothing is imported before it raises): a renamed or moved
    exception must fail here, not silently fall through to a traceback."""
    for name in EXIT_STATUS:
        module, _, kind = name.rpartition(".")
        assert issubclass(getattr(importlib.import_module(module), kind), BaseException), name


def test_one_exit_status_per_kind_of_error() -> None:
    from agent.config import ConfigError
    from agent.kernel.fsroot import WriteRefused
    from agent.overlays.errors import InstallRefused, OverlayError
    from agent.tuning.engine import TuningError
    from agent.tuning.errors import ProfileError

    assert [exit_status(error) for error in (
        UsageError("x"), ConfigError("f", "k", "bad"), ProfileError("f", "k", "bad"),
        OverlayError("f", "k", "bad"),
        TuningError("x"), InstallRefused("x"), WriteRefused(13, "x"), PermissionError(13, "x"),
        BrokenPipeError(), KeyboardInterrupt(), ValueError("a bug"))] == [
        2, 2, 2, 2, 1, 1, 1, 1, 0, 130, None]


def test_the_state_directory_follows_one_rule(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from agent.cli import service

    tree = tmp_path / "board"
    tree.mkdir()
    below = f"{tree.resolve()}{DEFAULT_STATE_DIR}"
    assert resolve_state_dir(str(tmp_path / "s"), tree) == str(tmp_path / "s")
    assert resolve_state_dir(None, tree) == below
    config = tmp_path / "agent.yaml"
    config.write_text(f"root: {tree}\n")
    assert service.command_config(build_parser().parse_args(
        ["status", "--config", str(config)])).state_dir == below  # as profile and infer
    config.write_text(f"root: {tree}\nstate_dir: {tmp_path / 'mine'}\n")
    assert service.command_config(build_parser().parse_args(
        ["status", "--config", str(config)])).state_dir == str(tmp_path / "mine")

    # the host, without an agent installed and not root: a per-user directory
    monkeypatch.setattr(common, "DEFAULT_STATE_DIR", str(tmp_path / "var/lib/edge-agent"))
    monkeypatch.setattr(common.os, "access", lambda path, mode: False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert resolve_state_dir(None, "/") == str(tmp_path / "home/.local/state/edge-agent")
    (tmp_path / "var/lib/edge-agent").mkdir(parents=True)  # installed: its state is read there
    assert resolve_state_dir(None, "/") == str(tmp_path / "var/lib/edge-agent")


def test_the_units_rollback_finds_the_journal_run_writes(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """ExecStopPost names the state directory; run, as root with the default config, uses
    that same directory."""
    from agent.cli import profile, service

    unit = (REPO / "systemd" / "edge-agent.service").read_text()
    [line] = [line for line in unit.splitlines() if line.startswith("ExecStopPost=")]
    words = shlex.split(line.removeprefix("ExecStopPost="))[1:]
    rollback = build_parser().parse_args(words)
    assert (rollback.handler, rollback.action, rollback.after_failure) == (
        profile.run, "rollback", True)
    assert resolve_state_dir(rollback.state_dir, rollback.root) == DEFAULT_STATE_DIR
    monkeypatch.setattr(common.os, "access", lambda path, mode: True)  # the unit runs as root
    config = tmp_path / "agent.yaml"
    config.write_text("{}\n")
    assert service.command_config(build_parser().parse_args(
        ["run", "--config", str(config)])).state_dir == DEFAULT_STATE_DIR


def test_status_names_the_long_commands_running(tmp_path: Path) -> None:
    """A job (``build-model``) shows in ``edge-agent status`` with its last step; none, no
    line."""
    import time

    from cli_helpers import edge_agent

    from agent.link.settings import LinkStatus
    from agent.service import reports

    state = tmp_path / "state"
    state.mkdir()
    job = {"id": "c-7", "command": "build-model", "step": "checking the gate",
           "running_s": 42.5}
    for jobs, lines in (({"build": job}, ["job: build-model c-7 (build), 42.5 s: checking "
                                          "the gate"]), ({}, [])):
        reports.write_status(state, reports.status(
            "orin-1", time.monotonic(), LinkStatus(state="connected").to_dict(), {"depth": 0},
            [], [], None, jobs=jobs))
        done = edge_agent("status", "--state-dir", state)
        assert [line for line in done.stdout.splitlines() if line.startswith("job:")] == lines
        assert json.loads(edge_agent("status", "--state-dir", state, "--json").stdout
                          )["jobs"] == jobs
