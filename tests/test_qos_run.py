"""The QoS controller in a real ``edge-agent run`` against a real Mosquitto: a model whose
p99 objective its own queue delay violates under a steady stream of requests gets a
``qos_action`` event over MQTT, and in ``control`` mode the data plane serves the new lever;
in ``advise`` mode the event comes and nothing changes."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import onnx_models
import pytest
import yaml
from agent_process import serving_addresses, start_agent, write_config
from mqtt_helpers import Broker, Subscriber, wait_until

from agent.serving.errors import ServeError
from agent.serving.http_client import HttpClient

TOPIC = "edge/v1/lab/orin-1"
# one request at a time waits 50 ms for company that never comes: p99 ~50 ms, above 20
CONFIG = {"max_batch_size": 8,
          "dynamic_batching": {"preferred_batch_size": [8], "max_queue_delay_us": 50_000},
          "qos": {"class": "latency_critical", "p99_ms": 20}}


def repository(tmp_path: Path) -> Path:
    path = tmp_path / "repository"
    onnx_models.dynamic_batch_mlp(_mkdir(path / "lc" / "1") / "model.onnx")
    (path / "lc" / "config.yaml").write_text(yaml.safe_dump(CONFIG))
    return path


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True)
    return path


class Stream:
    """Requests to model ``lc`` one after another, from a thread, until ``stop``."""

    def __init__(self, url: str) -> None:
        self.client = HttpClient(url, timeout_s=10)
        self.failures: list[str] = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        feeds = {"x": np.full((1, 64), 0.5, np.float32)}
        while not self.stopped.is_set():
            try:
                self.client.infer("lc", feeds)
            except ServeError as error:
                self.failures.append(error.message)

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(30)
        self.client.close()


def levers(url: str) -> dict[str, Any]:
    with HttpClient(url, timeout_s=10) as client:
        return dict(client.statistics("lc")[0]["edge_agent"]["levers"])


@pytest.mark.parametrize("mode", ["control", "advise"])
def test_a_violated_objective_moves_the_queue_delay_and_says_so(
        tmp_path: Path, broker: Broker, mode: str) -> None:
    watcher = Subscriber(broker, [f"{TOPIC}/#"])
    config = write_config(tmp_path, broker.port, qos={"mode": mode, "window_s": 0.5})
    document = yaml.safe_load(config.read_text())
    document["serve"]["repository"] = str(repository(tmp_path))
    config.write_text(yaml.safe_dump(document))
    agent = start_agent(config)
    stream = None
    try:
        assert wait_until(lambda: "http" in serving_addresses(tmp_path / "state")
                          and watcher.on("state") and
                          watcher.on("state")[-1]["state"] == "online", 90), agent.stdout
        url = f"http://{serving_addresses(tmp_path / 'state')['http']}"
        stream = Stream(url)

        def actions() -> list[dict[str, Any]]:
            return [e for e in watcher.on("event") if e.get("type") == "qos_action"]

        assert wait_until(lambda: bool(actions()), 60), agent.stdout
        first = actions()[0]
        assert (first["model"], first["serves"], first["lever"]) == ("lc", "lc",
                                                                     "max_queue_delay_us")
        assert (first["before"], first["after"]) == (50_000, 12_500)
        assert first["why"].startswith("p99 ") and "above the objective 20 ms of lc" in \
            first["why"]
        assert first["figures"]["lc"]["p99_ms"] > 20 and first["figures"]["lc"]["count"] > 0
        assert first["mode"] == mode
        if mode == "control":
            assert first["applied"] is True and first["applied_ms"] >= 0
            # the data plane serves what the last action set
            assert wait_until(lambda: levers(url)["max_queue_delay_us"]
                              == actions()[-1]["after"], 30)
        else:
            assert first["applied"] is False
            assert levers(url)["max_queue_delay_us"] == 50_000
        stream.stop()
        assert not stream.failures, stream.failures[:3]
        telemetry = [t for t in watcher.on("telemetry") if "qos" in t["metrics"]]
        assert telemetry and telemetry[-1]["metrics"]["qos"]["mode"] == mode
        assert telemetry[-1]["metrics"]["qos"]["models"]["lc"]["class"] == "latency_critical"
    finally:
        if stream is not None:
            stream.stop()
        agent.kill()
        agent.wait(30)
        watcher.close()
