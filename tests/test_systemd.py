"""The production service: systemd unit, sd_notify and watchdog, signals, installer, selftest."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from agent_process import start_agent, status, write_config
from mqtt_helpers import Broker, Subscriber, wait_until
from tuning_helpers import copy_board, snapshot

from agent.service.systemd import Notifier, watchdog_interval_s

REPO = Path(__file__).resolve().parents[1]
UNIT = REPO / "systemd" / "edge-agent.service"
BOARD = "jetson-agx-orin-jp6"


def test_the_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    """Verified as installed: install.sh rewrites /opt/edge-agent to the prefix."""
    unit = tmp_path / "edge-agent.service"
    unit.write_text(UNIT.read_text().replace("/opt/edge-agent/bin/edge-agent",
                                             str(Path(sys.executable).with_name("edge-agent"))))
    result = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    text = UNIT.read_text()
    for line in ("Type=notify", "NotifyAccess=main", "WatchdogSec=30", "Restart=on-failure",
                 "After=network-online.target",
                 # the data plane raises its soft limit to this hard one (serving/connections)
                 "LimitNOFILE=1024:65536",
                 "ExecStopPost=/opt/edge-agent/bin/edge-agent profile rollback "
                 "--after-failure"):
        assert line in text
    # the agent's own unit is not delegated: the data plane's limits are a slice's properties
    assert "\nDelegate=" not in text


def test_the_data_plane_slice_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    slice_unit = tmp_path / "edge_agent.slice"
    slice_unit.write_text((REPO / "systemd" / "edge_agent.slice").read_text())
    result = subprocess.run(["systemd-analyze", "verify", str(slice_unit)],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr


def test_notify_sequence_ready_status_watchdog_stopping(tmp_path: Path,
                                                         broker: Broker) -> None:
    address = str(tmp_path / "notify.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(address)
    listener.settimeout(0.2)
    messages: list[str] = []

    def receive_until(predicate: Any, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                messages.extend(listener.recv(4096).decode().splitlines())
            if predicate():
                return True
        return False

    agent = start_agent(write_config(tmp_path, broker.port, copy_board(BOARD, tmp_path)),
                  NOTIFY_SOCKET=address, WATCHDOG_USEC="1000000")
    try:
        assert receive_until(lambda: messages.count("WATCHDOG=1") >= 2, 60), messages
        agent.send_signal(signal.SIGTERM)
        assert receive_until(lambda: "STOPPING=1" in messages, 30), messages
        assert agent.wait(30) == 0
    finally:
        agent.kill()
        listener.close()
    first = {m: messages.index(m) for m in ("READY=1", "WATCHDOG=1", "STOPPING=1")}
    assert any(m.startswith("EXTEND_TIMEOUT_USEC=") for m in messages[:first["READY=1"]])
    assert first["READY=1"] < first["WATCHDOG=1"] < first["STOPPING=1"]
    assert any(m.startswith("STATUS=") for m in messages[:first["READY=1"]])


def test_notifier_sends_utf8_through_sdnotify_and_logs_failures(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """sdnotify carries the messages; systemd drops a STATUS= that is not
    UTF-8 (sdnotify itself encodes Latin-1), and a vanished socket is logged, not raised."""
    import sdnotify

    address = str(tmp_path / "notify.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(address)
    listener.settimeout(10)
    monkeypatch.setenv("NOTIFY_SOCKET", address)
    notifier = Notifier()
    assert isinstance(notifier._notifier, sdnotify.SystemdNotifier)
    notifier.notify(READY=1, STATUS="hottest 47.2 °C")
    assert listener.recv(4096) == "READY=1\nSTATUS=hottest 47.2 °C".encode()
    listener.close()
    os.unlink(address)
    notifier.notify(WATCHDOG=1)  # nobody listens any more: logged
    assert any("sd_notify to" in r.getMessage() for r in caplog.records)
    assert not Notifier(enabled=False).enabled
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "missing.sock"))
    assert not Notifier().enabled
    assert any("cannot reach systemd" in r.getMessage() for r in caplog.records)


def test_watchdog_interval_is_half_of_watchdog_usec() -> None:
    assert watchdog_interval_s({"WATCHDOG_USEC": "30000000"}) == 15.0
    assert watchdog_interval_s({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}) is None
    assert watchdog_interval_s({}) is None


def test_sigterm_restores_the_tuned_tree(tmp_path: Path, broker: Broker) -> None:
    root = copy_board(BOARD, tmp_path)
    original = snapshot(root)
    config = write_config(tmp_path, broker.port, root,
                         tuning={"profile": "jetson-orin-latency", "apply": True})
    agent = start_agent(config)
    try:
        assert wait_until(lambda: ((status(config)[1].get("last_sample") or {}).get("metrics")
                                   or {}).get("tuning", {}).get("applied") is True, 60)
        assert snapshot(root) != original
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(60) == 0
    finally:
        agent.kill()
    assert snapshot(root) == original


def test_sighup_reloads_and_a_broken_config_keeps_the_old(tmp_path: Path,
                                                          broker: Broker) -> None:
    config = write_config(tmp_path, broker.port, copy_board(BOARD, tmp_path))
    good = config.read_text()
    events = Subscriber(broker, ["edge/v1/lab/orin-1/event"])
    agent = start_agent(config)
    try:
        assert events.subscribed.wait(30)
        assert wait_until(lambda: status(config)[1].get("link", {}).get("state") == "connected",
                          60)
        config.write_text("mqtt: {port: not-a-port}\n")
        agent.send_signal(signal.SIGHUP)
        # the rejection is an event, published by the link the old configuration keeps up
        assert wait_until(lambda: [e for e in events.on("event")
                                   if e.get("type") == "config_rejected"], 30), events.messages
        assert agent.poll() is None
        assert status(config)[1]["link"]["state"] == "connected"
        session = status(config)[1]["link"]["session"]
        config.write_text(good.replace("interval_s: 0.2", "interval_s: 0.3"))
        agent.send_signal(signal.SIGHUP)
        # The reloaded service connects again: a new session says the reload is done.
        assert wait_until(lambda: status(config)[1].get("link", {}).get("session", 0)
                          > session, 30)
        agent.send_signal(signal.SIGTERM)
        output, _ = agent.communicate(timeout=60)
    finally:
        agent.kill()
        events.close()
    assert agent.returncode == 0
    assert "reload: " in output and "mqtt.port: 'not-a-port' is not allowed" in output
    assert "the running configuration stays" in output
    assert "event config_reloaded" in output


def installed_files(root: Path) -> dict[str, bytes]:
    """Everything the installer wrote, but the venv's own Python files."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and "/lib/" not in str(p) and "/bin/" not in str(p)
            and "pyvenv.cfg" not in p.name}


@pytest.mark.timeout(1200)  # two installs and an uninstall, each under a 600 s timeout of its own
def test_install_twice_uninstall_and_purge(tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    # PIP_NO_DEPS: the installer's files are what this test is about, not its dependencies;
    # the onnxruntime it then checks for (an install without one fails) is a stand-in
    # without package metadata, so pip never sees it
    stand_in = tmp_path / "stand-in/onnxruntime"
    stand_in.mkdir(parents=True)
    (stand_in / "__init__.py").write_text(
        "__version__ = '0'\n\ndef get_available_providers():\n"
        "    return ['CPUExecutionProvider']\n")
    env = {**os.environ, "DESTDIR": str(dest), "PIP_NO_DEPS": "1",
           "PYTHONPATH": str(stand_in.parent)}

    def install(*options: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(REPO / "install.sh"), *options], capture_output=True,
                              text=True, timeout=600, env=env, check=False)

    first = install("--no-start")
    assert first.returncode == 0, first.stderr
    unit = (dest / "etc/systemd/system/edge-agent.service").read_text()
    assert "ExecStart=/opt/edge-agent/bin/edge-agent run" in unit
    config = dest / "etc/edge-agent/agent.yaml"
    assert "profile:" in config.read_text()
    assert (dest / "opt/edge-agent/profiles/jetson-orin.yaml").exists()
    before = installed_files(dest)
    assert install("--no-start").returncode == 0
    assert installed_files(dest) == before  # a second run changes nothing
    staged = dest / "opt/edge-agent"  # nor does it bring back a staging path (a .pyc's)
    assert not [p for p in staged.rglob("*") if p.is_file() and not p.is_symlink()
                and str(staged).encode() in p.read_bytes()]

    config.write_text(config.read_text() + "telemetry: {interval_s: 5}\n")  # edited
    edited = config.read_bytes()
    assert install("--no-start").returncode == 0
    assert config.read_bytes() == edited
    assert (dest / "etc/edge-agent/agent.yaml.dist").exists()

    removed = install("--uninstall")
    assert removed.returncode == 0, removed.stderr
    left = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    assert left == ["etc/edge-agent/agent.yaml", "etc/edge-agent/agent.yaml.dist"]
    assert install("--uninstall", "--purge").returncode == 0
    assert not [p for p in dest.rglob("*") if p.is_file()]


def test_selftest_reports_honestly_on_this_machine(tmp_path: Path, broker: Broker) -> None:
    config = write_config(tmp_path, broker.port, Path("/"))
    result = subprocess.run([sys.executable, "-m", "agent", "selftest", "--config",
                             str(config), "--json"], capture_output=True, text=True,
                            timeout=120, check=False)
    report = json.loads(result.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["discovery"]["status"] == "pass"
    assert checks["inference"]["status"] == "pass"
    assert "CPUExecutionProvider" in checks["inference"]["detail"]
    assert checks["mqtt"]["status"] == "pass"
    assert checks["tuning"]["status"] == "n/a"  # selftest never applies a profile
    assert report["ok"] is True and result.returncode == 0
    broker.stop()
    offline = subprocess.run([sys.executable, "-m", "agent", "selftest", "--config",
                              str(config), "--seconds", "1"], capture_output=True, text=True,
                             timeout=120, check=False)
    assert offline.returncode == 1
    assert "fail  mqtt" in offline.stdout and "cannot reach the broker" in offline.stdout


def test_the_installer_is_executable() -> None:
    assert os.access(REPO / "install.sh", os.X_OK)
    assert shutil.which("systemd-analyze"), "install.sh --dev installs systemd"
