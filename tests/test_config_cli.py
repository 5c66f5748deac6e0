"""``edge-agent config check``: ok, or each problem and exit 2.  The good file is checked by a
real subprocess too; the rest call the command in this process (tests/cli_helpers.py), its
output and exit status being what they check."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import edge_agent

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
BUILTIN = ", ".join(sorted(p.stem for p in (REPO / "profiles").glob("*.yaml")))


def check(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return edge_agent("config", "check", "--config", config, *args, cwd=REPO)


def check_in_a_process(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agent", "config", "check", "--config",
                           str(config), *args], capture_output=True, text=True, cwd=REPO,
                          timeout=60, check=False)


def written(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "agent.yaml"
    path.write_text(text)
    return path


def test_a_good_file_is_ok(tmp_path: Path) -> None:
    config = written(tmp_path, f"root: {FIXTURES / 'x86-edge-npu'}\nmqtt: {{protocol: 5}}\n"
                     "tuning: {profile: x86-latency}\ntelemetry: {metrics: [cpu, outbox]}\n")
    for run in (check_in_a_process, check):
        result = run(config)
        assert (result.returncode, result.stdout, result.stderr) == (0, f"{config}: ok\n", "")
    result = check(config, "--json")
    assert result.returncode == 0
    assert json.loads(result.stdout) == {"file": str(config), "ok": True, "problems": []}


@pytest.mark.parametrize(("text", "problem"), [
    ("tuning: {profile: nosuch}\n",
     f"tuning.profile: 'nosuch' is not a profile here (available: {BUILTIN})"),
    ("telemetry: {metrics: [cpu, gpu]}\n", "telemetry.metrics: ['cpu', 'gpu'] is not allowed"),
    ("tuning: {apply: yes please}\n",
     "tuning.apply: 'yes please' is not allowed: expected true or false"),
    ("mqtt: {protcol: 5}\n", "mqtt.protcol: unknown key (allowed: host, port, protocol"),
    ("root: /nonexistent/edge-root\n", "root: /nonexistent/edge-root: no such directory"),
])
def test_each_problem_is_named_and_exit_2(tmp_path: Path, text: str, problem: str) -> None:
    config = written(tmp_path, text)
    result = check(config)
    assert result.returncode == 2, result.stdout
    assert result.stdout.startswith(f"{config}: {problem}")
    assert len(result.stdout.splitlines()) == 1 and result.stderr == ""
    as_json = json.loads(check(config, "--json").stdout)
    assert as_json["ok"] is False and as_json["problems"] == [result.stdout.strip()]


def test_site_profiles_are_found_through_the_config_s_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "etc/edge-agent/profiles").mkdir(parents=True)
    (root / "etc/edge-agent/profiles/line-a.yaml").write_text("include: [balanced]\n")
    assert check(written(tmp_path, f"root: {root}\ntuning: {{profile: line-a}}\n")
                 ).returncode == 0
    result = check(written(tmp_path, f"root: {root}\ntuning: {{profile: line-b}}\n"))
    assert result.returncode == 2
    assert "'line-b' is not a profile here (available: balanced, " in result.stdout
    assert ", line-a, " in result.stdout


def test_an_unreadable_file_is_exit_2(tmp_path: Path) -> None:
    missing = tmp_path / "missing.yaml"
    result = check(missing)
    assert result.returncode == 2
    assert result.stdout.startswith(f"{missing}: cannot be read: ")


# Notepad's UTF-16 (with its byte order mark, and without), and Latin-1 bytes: what each
# command that reads the config says, in one line, instead of a UnicodeDecodeError traceback.
NOT_UTF8 = [
    ("node_id: café\n".encode("utf-16"),
     "is UTF-16 text (by its byte order mark), not UTF-8: save it as UTF-8"),
    ("node_id: café\n".encode("utf-16-le"),
     "is not UTF-8 text: NUL bytes from line 1 (UTF-16?): save it as UTF-8"),
    ("fleet: lab\nnode_id: café\n".encode("latin-1"),
     "is not UTF-8 text: byte 0xe9 on line 2: save it as UTF-8"),
]


@pytest.mark.parametrize(("data", "problem"), NOT_UTF8, ids=["utf16-bom", "utf16", "latin1"])
@pytest.mark.parametrize("command", [["config", "check"], ["status"], ["run", "--seconds", "1"]],
                         ids=["config-check", "status", "run"])
def test_a_config_that_is_not_utf8_is_one_line_and_exit_2(tmp_path: Path, command: list[str],
                                                          data: bytes, problem: str) -> None:
    config = tmp_path / "agent.yaml"
    config.write_bytes(data)
    result = edge_agent(*command, "--config", config, "--state-dir", tmp_path / "state",
                        cwd=REPO) if command[0] != "config" else check(config)
    assert result.returncode == 2
    said = result.stdout if command[0] == "config" else result.stderr
    prefix = "" if command[0] == "config" else f"edge-agent {command[0]}: "
    assert said == f"{prefix}{config}: {problem}\n"


@pytest.mark.parametrize(("text", "problem"), [
    ("fleet: lab\nmqtt:\n  host: a\nnode_id: n1\nmqtt:\n  port: 1884\n",
     "mqtt: given twice (lines 2 and 5)"),
    ("mqtt:\n  host: a\n  reconnect:\n    min_s: 1\n    max_s: 9\n    min_s: 2\n",
     "mqtt.reconnect.min_s: given twice (lines 4 and 6)"),
    ("telemetry:\n  metrics: [cpu]\nmqtt: {host: a, port: 1, host: b}\n",
     "mqtt.host: given twice (lines 3 and 3)"),
], ids=["top-level", "nested", "flow"])
def test_a_key_given_twice_is_refused_with_both_lines(tmp_path: Path, text: str,
                                                      problem: str) -> None:
    config = written(tmp_path, text)
    result = check(config)
    assert (result.returncode, result.stdout) == (2, f"{config}: {problem}\n")
    result = edge_agent("status", "--config", config, "--state-dir", tmp_path / "state",
                        cwd=REPO)
    assert (result.returncode, result.stderr) == (2, f"edge-agent status: {config}: {problem}\n")



def test_models_the_data_plane_would_refuse_are_problems_while_inference_is_on(
        tmp_path: Path) -> None:
    """``run`` starts without a model whose config.yaml has a bad key (it reports it as a
    problem of the data plane once running): config check, exit 0, used to miss it."""
    from tests import onnx_models

    repository = tmp_path / "repository"
    for name in ("good", "bad"):
        (repository / name / "1").mkdir(parents=True)
        onnx_models.mlp(repository / name / "1" / "model.onnx")
    (repository / "good" / "config.yaml").write_text("qos: {class: best_effort}\n")
    (repository / "bad" / "config.yaml").write_text("qos: {class: fast, p99_ms: 5}\n")
    (repository / "empty").mkdir()
    config = written(tmp_path, f"serve: {{repository: {repository}}}\n")
    result = check(config)
    assert result.returncode == 2, result.stdout
    assert result.stdout.splitlines() == [
        f"model bad: {repository}/bad/config.yaml: qos.class: 'fast' is not allowed: "
        "expected one of latency_critical, throughput, best_effort",
        f"model empty: {repository}/empty holds no version directory with model.onnx or "
        "model.rknn (<model>/<version>/model.onnx)"]
    (repository / "bad" / "config.yaml").write_text("qos: {class: latency_critical, "
                                                    "p99_ms: 5}\n")
    (repository / "empty").rmdir()
    assert check(config).returncode == 0
    (repository / "bad" / "config.yaml").write_text("qos: [1\n")  # PyYAML: several lines
    result = check(config)
    assert result.returncode == 2
    (line,) = result.stdout.splitlines()
    assert line.startswith(f"model bad: {repository}/bad/config.yaml: not valid YAML: ")
    off = written(tmp_path, f"serve: {{repository: {repository}}}\ninference: "
                  "{enabled: false}\n")
    assert check(off).returncode == 0  # no data plane: its models are no concern of run's
    (tmp_path / "file").write_text("")
    result = check(written(tmp_path, f"serve: {{repository: {tmp_path / 'file'}}}\n"))
    assert result.stdout.splitlines() == [  # not a line per built-in model besides
        f"{tmp_path / 'agent.yaml'}: serve.repository: {tmp_path / 'file'}: is not a "
        "directory"]
