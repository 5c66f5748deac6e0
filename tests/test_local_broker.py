"""``mqtt.local_broker: auto``: with no broker on this machine and nothing to start one (a
container, a CI runner), ``edge-agent run`` starts a real Mosquitto for the run and stops it
at the end; never for a remote host, when switched off, or where systemd owns the broker."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import yaml
from agent_process import agent_config, start_agent, status
from mqtt_helpers import MOSQUITTO, free_port, wait_until

from agent.service.local_broker import needed

pytestmark = pytest.mark.skipif(not Path(MOSQUITTO).exists(), reason="needs mosquitto")
STARTED = re.compile(r"no MQTT broker on 127\.0\.0\.1:(\d+); started mosquitto \(pid (\d+)\) "
                     r"for this run, stopped when it ends")


def config_file(tmp_path: Path, port: int, **mqtt: object) -> Path:
    config = agent_config(tmp_path, port)
    del config["mqtt"]["local_broker"]  # the default, as the quickstart has it
    config["mqtt"].update(mqtt)
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def run_for(config: Path, seconds: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agent", "run", "--config", str(config),
                           "--seconds", str(seconds)], capture_output=True, text=True,
                          timeout=120, check=False)


def test_run_with_no_broker_starts_one_for_the_run_and_stops_it(tmp_path: Path) -> None:
    port = free_port()
    result = run_for(config_file(tmp_path, port), 3)
    assert result.returncode == 0, result.stderr
    started = [m for m in map(STARTED.search, result.stderr.splitlines()) if m]
    assert len(started) == 1, result.stderr
    assert int(started[0].group(1)) == port
    acked, waiting = map(int, re.findall(
        r"stopped: (\d+) records acknowledged by the broker, (\d+) waiting in the outbox",
        result.stderr)[-1])
    assert acked > 0 and waiting == 0, result.stderr
    assert not psutil.pid_exists(int(started[0].group(2)))  # stopped and reaped, no orphan
    assert "cannot reach the broker" not in result.stderr


def test_sigterm_stops_the_broker_it_started(tmp_path: Path) -> None:
    config = config_file(tmp_path, free_port())
    agent = start_agent(config)
    try:
        assert wait_until(lambda: status(config)[1].get("link", {}).get("acked", 0) > 0, 60)
        children = [p for p in psutil.Process(agent.pid).children(recursive=True)
                    if p.name() == "mosquitto"]
        assert len(children) == 1
    finally:
        agent.send_signal(signal.SIGTERM)
        output, _ = agent.communicate(timeout=60)
    assert agent.returncode == 0, output
    assert f"started mosquitto (pid {children[0].pid})" in output
    assert not psutil.pid_exists(children[0].pid)


def test_switched_off_it_starts_none_and_buffers(tmp_path: Path) -> None:
    result = run_for(config_file(tmp_path, free_port(), local_broker=False), 2)
    assert result.returncode == 0, result.stderr
    assert "started mosquitto" not in result.stderr
    assert "0 records acknowledged by the broker" in result.stderr


def test_nothing_is_started_for_a_remote_host_a_listening_port_or_when_off(
        tmp_path: Path) -> None:
    port = free_port()
    bare: dict[str, str] = {}
    nowhere = tmp_path / "no-systemd"
    assert needed("auto", "127.0.0.1", port, bare, nowhere) == MOSQUITTO
    assert needed("auto", "localhost", port, bare, nowhere) == MOSQUITTO
    assert needed("auto", "192.0.2.1", port, bare, nowhere) is None  # not this machine's
    assert needed("auto", "broker.example", port, bare, nowhere) is None
    assert needed(False, "127.0.0.1", port, bare, nowhere) is None
    with socket.create_server(("127.0.0.1", 0)) as listening:
        taken = listening.getsockname()[1]
        assert needed("auto", "127.0.0.1", taken, bare, nowhere) is None


def test_nothing_is_started_under_systemd_or_when_its_unit_is_enabled(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()
    nowhere = tmp_path / "no-systemd"
    assert needed("auto", "127.0.0.1", port, {"INVOCATION_ID": "x"}, nowhere) is None
    assert needed("auto", "127.0.0.1", port, {"NOTIFY_SOCKET": "/run/x"}, nowhere) is None
    systemd = tmp_path / "run-systemd-system"
    systemd.mkdir()
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "mosquitto").symlink_to(MOSQUITTO)
    answers = tmp_path / "enabled"
    systemctl = tools / "systemctl"  # exit 0 for the verb written in `answers`
    systemctl.write_text(f'#!/bin/sh\nread -r verb < {answers}\n[ "$1" = "$verb" ]\n')
    systemctl.chmod(0o755)
    monkeypatch.setenv("PATH", str(tools))
    for enabled in ("is-enabled", "is-active"):
        answers.write_text(enabled)
        assert needed("auto", "127.0.0.1", port, {}, systemd) is None
    answers.write_text("none")  # systemd, but no mosquitto unit that will start
    assert needed("auto", "127.0.0.1", port, {}, systemd) == str(tools / "mosquitto")


def test_a_killed_agent_leaves_no_broker_behind(tmp_path: Path) -> None:
    """SIGKILL: no cleanup runs; the broker's parent-death signal ends it."""
    config = config_file(tmp_path, free_port())
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    agent = start_agent(config, TMPDIR=str(scratch))
    try:  # records acknowledged: the broker it started accepts
        assert wait_until(lambda: status(config)[1].get("link", {}).get("acked", 0) > 0, 60)
        (broker,) = [p for p in psutil.Process(agent.pid).children() if p.name() == "mosquitto"]
    finally:
        agent.kill()
        agent.communicate(timeout=60)
    try:
        assert wait_until(lambda: not broker.is_running(), 30)
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            broker.kill()  # this test's orphan, were there one
    # its private directory went when it accepted
    assert list(scratch.glob("edge-agent-mosquitto-*")) == []


def test_a_broker_that_does_not_start_is_one_line_and_exit_1(tmp_path: Path) -> None:
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "mosquitto").write_text("#!/bin/sh\necho 'Error: no such thing' >&2\nexit 3\n")
    (tools / "mosquitto").chmod(0o755)
    port = free_port()
    result = subprocess.run([sys.executable, "-m", "agent", "run", "--config",
                             str(config_file(tmp_path, port)), "--seconds", "2"],
                            capture_output=True, text=True, timeout=120, check=False,
                            env={**os.environ, "PATH": f"{tools}:{os.environ['PATH']}"})
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1] == (
        f"edge-agent run: mosquitto started for this run (no broker on 127.0.0.1:{port}) "
        "exited 3: Error: no such thing; set mqtt.local_broker: false to run without it")
    assert "Traceback" not in result.stderr
