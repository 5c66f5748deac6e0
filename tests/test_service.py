"""``edge-agent run`` as a real process against a real Mosquitto, on a fixture board."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

from agent_process import start_agent, status, write_config
from mqtt_helpers import Broker, Subscriber, free_port, wait_until
from tuning_helpers import copy_board, snapshot

from agent.telemetry.groups import METRIC_GROUPS

FIXTURES = Path(__file__).parent / "fixtures"
PROFILES = Path(__file__).parents[1] / "profiles"
TOPIC = "edge/v1/lab/orin-1"


def test_run_reports_and_the_last_will_names_the_birth_session(tmp_path: Path,
                                                                broker: Broker) -> None:
    watcher = Subscriber(broker, [f"{TOPIC}/#"])
    # a load test through the data plane, so that the default model has figures to report
    agent = start_agent(write_config(tmp_path, broker.port, inference={"source": "synthetic"}))
    try:
        assert wait_until(lambda: len(watcher.on("telemetry")) >= 3 and (
            watcher.on("telemetry")[-1]["metrics"]["inference"].get("count", 0) > 0), 60), \
            agent.stdout
        # on the broker before the data plane is ready (its first start is not waited for):
        # degraded and a birth without a model, then online and a birth with it
        first, birth = watcher.on("birth")[0], watcher.on("birth")[-1]
        assert first["model"] is None and first["session"] == birth["session"]
        states = watcher.on("state")
        assert (states[0]["state"], states[0]["reason"]) == ("degraded", "data plane: starting")
        assert states[-1]["state"] == "online"
        assert birth["board"]["family"] == "jetson" and birth["node_id"] == "orin-1"
        assert birth["model"]["name"] == "demo"
        assert birth["models"] == [{"name": "demo", "versions": ["1"]}]
        assert birth["profile"] == {"name": "jetson-orin", "applied": False}
        record = watcher.on("telemetry")[-1]
        assert record["schema"] == "telemetry/1" and record["session"] == birth["session"]
        metrics = record["metrics"]
        assert metrics["inference"]["count"] > 0 and metrics["inference"]["errors"] == 0
        served = metrics["inference"]["models"]
        assert [(m["name"], m["version"]) for m in served] == [("demo", "1")]
        assert served[0]["count"] == metrics["inference"]["count"]
        assert metrics["inference"]["data_plane"]["state"] == "ready"
        assert metrics["memory"]["total_bytes"] > 0  # read from the fixture's meminfo
        assert metrics["tuning"]["profile"] == "jetson-orin"
        assert metrics["outbox"]["dropped"] == 0
        agent.send_signal(signal.SIGKILL)
        agent.wait(10)
        assert wait_until(lambda: watcher.on("state")[-1]["state"] == "offline", 60)
        assert watcher.on("state")[-1]["session"] == birth["session"]
    finally:
        agent.kill()
        watcher.close()


def test_sigterm_says_stopped_and_exits_zero(tmp_path: Path, broker: Broker) -> None:
    watcher = Subscriber(broker, [f"{TOPIC}/state"])
    config = write_config(tmp_path, broker.port)
    agent = start_agent(config)
    try:
        assert wait_until(lambda: watcher.on("state") and watcher.on("state")[-1]["state"]
                          == "online", 60)
        assert wait_until(lambda: status(config)[0] == 0, 30)
        agent.send_signal(signal.SIGTERM)
        output, _ = agent.communicate(timeout=30)
        assert agent.returncode == 0, output
        assert wait_until(lambda: watcher.on("state")[-1]["state"] == "stopped")
    finally:
        agent.kill()
        watcher.close()
    code, state = status(config)
    assert code == 1 and state["stopped"] is True and state["outbox"]["depth"] == 0


def test_sigterm_delivers_the_rollback_before_stopped(tmp_path: Path, broker: Broker) -> None:
    """With a profile applied and rollback_on_stop, SIGTERM rolls back before the last
    flush: tuning_rolled_back reaches the broker in this stop, not at the next start."""
    root = copy_board("jetson-agx-orin-jp6", tmp_path)
    original = snapshot(root)
    watcher = Subscriber(broker, [f"{TOPIC}/state", f"{TOPIC}/event"])
    config = write_config(tmp_path, broker.port, root,
                          tuning={"profile": "jetson-orin-latency", "apply": True})
    agent = start_agent(config)
    try:
        assert wait_until(lambda: any(e["type"] == "tuning_applied"
                                      for e in watcher.on("event")), 60), agent.stdout
        assert snapshot(root) != original
        agent.send_signal(signal.SIGTERM)
        output, _ = agent.communicate(timeout=60)
        assert agent.returncode == 0, output
        assert wait_until(lambda: watcher.on("state")[-1]["state"] == "stopped")
    finally:
        agent.kill()
        watcher.close()
    assert snapshot(root) == original
    with watcher.lock:
        arrived = [(topic.rsplit("/", 1)[1], p.get("type") or p.get("state"))
                   for topic, p, _ in watcher.messages]
    last = arrived[-2:]
    assert last == [("event", "tuning_rolled_back"), ("state", "stopped")], arrived
    code, state = status(config)
    assert code == 1 and state["stopped"] is True and state["outbox"]["depth"] == 0


def test_without_a_broker_it_buffers_and_says_so(tmp_path: Path) -> None:
    config = write_config(tmp_path, free_port())  # nothing listens there
    agent = start_agent(config)
    try:
        assert wait_until(lambda: status(config)[1].get("outbox", {}).get("depth", 0) >= 5, 60)
        code, state = status(config)
        assert code == 0 and agent.poll() is None
        assert state["link"]["state"] in ("connecting", "disconnected")
        assert "cannot reach the broker" in state["link"]["last_error"]
        text = subprocess.run([sys.executable, "-m", "agent", "status", "--config",
                               str(config)], capture_output=True, text=True, timeout=60,
                              check=False).stdout
        assert "buffering: cannot reach the broker" in text and "outbox" in text
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.communicate(timeout=30)
    assert agent.returncode == 0


def test_prometheus_and_home_assistant_discovery(tmp_path: Path, broker: Broker) -> None:
    port = free_port()
    watcher = Subscriber(broker, ["homeassistant/#", f"{TOPIC}/telemetry"])
    agent = start_agent(write_config(tmp_path, broker.port,
                                     prometheus={"listen": f"127.0.0.1:{port}"},
                                     home_assistant={"enabled": True},
                                     inference={"source": "synthetic"}))
    try:
        assert wait_until(lambda: len(watcher.on("telemetry")) >= 2 and (
            watcher.on("telemetry")[-1]["metrics"]["inference"].get("count", 0) > 0), 60)
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                      timeout=10).read().decode()
        samples = {line.split(" ")[0]: float(line.split(" ")[1]) for line in body.splitlines()
                   if line and not line.startswith("#")}
        assert samples["edge_agent_inference_latency_ms_p95"] > 0
        assert samples["edge_agent_memory_total_bytes"] > 0
        configs = [(t, p) for t, p, _ in watcher.messages if t.startswith("homeassistant/")]
        topics = {t for t, _ in configs}
        assert "homeassistant/sensor/orin-1/inference_p99/config" in topics
        p99 = next(p for t, p in configs if t.endswith("/inference_p99/config"))
        assert p99["state_topic"] == f"{TOPIC}/telemetry" and p99["unit_of_measurement"] == "ms"
        assert any(t.startswith("homeassistant/sensor/orin-1/temp_") for t in topics)
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.communicate(timeout=30)
        watcher.close()


def test_a_bad_config_names_the_key(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text("mqtt: {port: 70000}\n")
    result = subprocess.run([sys.executable, "-m", "agent", "run", "--config", str(path)],
                            capture_output=True, text=True, timeout=60, check=False,
                            env={**os.environ})
    assert result.returncode == 2
    assert f"{path}: mqtt.port: 70000 is not allowed" in result.stderr


def test_a_second_agent_on_the_same_state_directory_is_refused(tmp_path: Path,
                                                                broker: Broker) -> None:
    config = write_config(tmp_path, broker.port)
    first = start_agent(config)
    try:
        assert wait_until(lambda: status(config)[0] == 0, 60)
        second = subprocess.run([sys.executable, "-m", "agent", "run", "--config",
                                 str(config), "--seconds", "1"], capture_output=True,
                                text=True, timeout=60, check=False)
        assert second.returncode == 1
        assert "is another edge-agent using this state directory?" in second.stderr
        assert first.poll() is None
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=30)
    assert first.returncode == 0


def test_ctrl_c_stops_cleanly_and_exits_130(tmp_path: Path, broker: Broker) -> None:
    watcher = Subscriber(broker, [f"{TOPIC}/state"])
    config = write_config(tmp_path, broker.port)
    agent = start_agent(config)
    try:
        assert wait_until(lambda: status(config)[0] == 0, 60)
        agent.send_signal(signal.SIGINT)
        output, _ = agent.communicate(timeout=30)
        assert agent.returncode == 130, output
        assert "Traceback" not in output
        assert wait_until(lambda: watcher.on("state")[-1]["state"] == "stopped")
    finally:
        agent.kill()
        watcher.close()


def test_an_unknown_profile_starts_degraded_and_says_why(tmp_path: Path,
                                                         broker: Broker) -> None:
    """The node stays reachable (the fleet fixes it with apply-profile); the reason names
    the key and what this node holds, in the MQTT state and in edge-agent status."""
    available = ", ".join(sorted(p.stem for p in PROFILES.glob("*.yaml")))
    why = f"tuning.profile: 'nosuch' is not a profile here (available: {available})"
    watcher = Subscriber(broker, [f"{TOPIC}/state", f"{TOPIC}/telemetry"])
    config = write_config(tmp_path, broker.port, tuning={"profile": "nosuch"})
    agent = start_agent(config)
    try:
        # once the data plane is up, the profile alone (before it: "...; data plane: starting")
        assert wait_until(lambda: watcher.on("state") and watcher.on("state")[-1].get(
            "reason") == f"tuning: {why}", 60), watcher.on("state")
        assert watcher.on("state")[-1]["state"] == "degraded"
        assert wait_until(lambda: status(config)[0] == 0, 30)
        assert f"tuning: {why}" in status(config)[1]["problems"]
        text = subprocess.run([sys.executable, "-m", "agent", "status", "--config",
                               str(config)], capture_output=True, text=True, timeout=60,
                              check=False).stdout
        assert f"problem: tuning: {why}" in text.splitlines()
        # and it runs: every metric group is sampled, the service's own ones too
        assert wait_until(lambda: len(watcher.on("telemetry")) >= 1, 60)
        assert tuple(watcher.on("telemetry")[-1]["metrics"]) == METRIC_GROUPS
        assert watcher.on("telemetry")[-1]["metrics"]["tuning"]["error"] == why
    finally:
        agent.send_signal(signal.SIGTERM)
        output, _ = agent.communicate(timeout=30)
        watcher.close()
    assert agent.returncode == 0
    assert f"{config}: {why}: the agent starts degraded" in output
