"""The data plane's figures as others read them: its Prometheus endpoint, telemetry's
per-interval inference figures, and ``infer --url --priority-mix``.

Real processes on free loopback ports where a process is the point (``edge-agent serve``,
``edge-agent run`` against a real broker); real ``LatencyStats`` windows where a function is.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from agent.inference.demo_model import DEMO_INPUT
from agent.inference.stats import LatencyStats, Window
from agent.service.intervals import Intervals
from agent.serving.errors import ServeError
from agent.serving.http_client import HttpClient
from agent.serving.metrics import BUCKETS_S, ServingCollector
from tests.agent_process import start_agent, write_config
from tests.mqtt_helpers import Broker, Subscriber, wait_until
from tests.test_serve_process import demo_input, serve_process

TOPIC = "edge/v1/lab/orin-1"
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> tuple[Samples, dict[str, str]]:
    """Every sample by (name, sorted labels), and each family's type."""
    samples: Samples = {}
    types = {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples, types


def scrape(address: str) -> Samples:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as answer:
        return parse(answer.read().decode())[0]


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def buckets(samples: Samples, name: str, **labels: str) -> list[float]:
    """A histogram's bucket counts in the order of their bounds, +Inf last."""
    return [value(samples, f"{name}_bucket", **labels, le=le)
            for le in [*map(repr, BUCKETS_S), "+Inf"]]


def calls(stats: LatencyStats, latencies_ns: Iterable[int], ok: bool = True,
          start_ns: int = 0) -> None:
    for latency in latencies_ns:
        stats.call_started(start_ns)
        stats.record(latency, ok)


# -- the Prometheus endpoint --------------------------------------------------------------------


def test_metrics_endpoint_agrees_with_the_statistics_extension(tmp_path: Path) -> None:
    with serve_process(tmp_path) as plane:
        client = HttpClient(f"http://{plane['http']}")
        for seed in range(7):
            client.infer("demo", {DEMO_INPUT: demo_input(seed=seed)})
        with pytest.raises(ServeError):  # reaches the version: a failure it counts
            client.infer("demo", {"nosuch": demo_input()})
        first = scrape(plane["metrics"])
        [stats] = client.statistics("demo")
        labels = {"model": "demo", "version": "1"}
        latency = "edge_agent_request_duration_seconds"
        assert value(first, f"{latency}_count", **labels) == 7
        counts = buckets(first, latency, **labels)
        assert counts == sorted(counts) and counts[-1] == 7
        window = Window.from_dict(stats["edge_agent"]["window"])
        bounds = [round(b * 1e9) for b in BUCKETS_S]
        assert counts[:-1] == window.cumulative(bounds)
        assert value(first, f"{latency}_sum", **labels) == pytest.approx(window.sum_ns / 1e9)
        kinds = stats["inference_stats"]
        expected = {
            "request_success": kinds["success"]["count"],
            "request_failure": kinds["fail"]["count"],
            "count": stats["inference_count"],
            "exec_count": stats["execution_count"],
            "request_duration_us": (kinds["success"]["ns"] + kinds["fail"]["ns"]) // 1000,
            "queue_duration_us": kinds["queue"]["ns"] // 1000,
            **{f"{k}_duration_us": kinds[k]["ns"] // 1000
               for k in ("compute_input", "compute_infer", "compute_output")},
        }
        assert expected["request_success"] == 7 and expected["request_failure"] == 1
        for name, number in expected.items():
            assert value(first, f"edge_agent_inference_{name}_total", **labels) == number, name
        assert value(first, "edge_agent_model_ready", **labels) == 1
        assert value(first, "edge_agent_queue_duration_seconds_count", **labels) == \
            kinds["queue"]["count"]

        for seed in range(5):
            client.infer("demo", {DEMO_INPUT: demo_input(seed=seed)})
        second = scrape(plane["metrics"])
        assert value(second, f"{latency}_count", **labels) == 12
        assert buckets(second, latency, **labels)[-1] == 12
        grown = {name: value(second, f"edge_agent_inference_{name}_total", **labels)
                 - value(first, f"edge_agent_inference_{name}_total", **labels)
                 for name in ("request_success", "request_failure", "count", "exec_count")}
        assert grown == {"request_success": 5, "request_failure": 0, "count": 5,
                         "exec_count": 5}


class _Models:
    """The two calls the collector makes, over statistics entries the test builds."""

    def __init__(self, entries: list[dict[str, Any]]) -> None:
        self.entries = entries

    def statistics(self, name: str, version: str) -> list[dict[str, Any]]:
        return self.entries

    def model_ready(self, name: str, version: str) -> bool:
        return name != "down"


def _entry(name: str, latency: Window, **ours: Any) -> dict[str, Any]:
    kinds = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")
    return {"name": name, "version": "3", "inference_count": latency.count,
            "execution_count": latency.count,
            "inference_stats": {k: {"count": 0, "ns": 0} for k in kinds},
            "edge_agent": {"window": latency.to_dict(), **ours}}


def test_queue_windows_instances_and_a_bad_entry() -> None:
    latency, queue, instance = LatencyStats(), LatencyStats(), LatencyStats()
    calls(latency, [40_000, 300_000, 2_000_000, 30_000_000_000])  # the last: above every bound
    calls(queue, [10_000, 20_000_000])
    calls(instance, [300_000])
    broken = _entry("broken", latency.window())
    del broken["edge_agent"]["window"]
    registry = CollectorRegistry()
    registry.register(ServingCollector(_Models([  # type: ignore[arg-type]
        broken,
        _entry("good", latency.window(), queue={"window": queue.window().to_dict()},
               instances=[{"index": 0, "window": instance.window().to_dict(),
                           "queue": queue.window().to_dict(), "backend": "rknn",
                           "device": "npu:0-2", "precision": "int8"}]),
        _entry("down", latency.window(), queue={"window": queue.window().to_dict()},
               instances=[])])))
    samples, types = parse(generate_latest(registry).decode())
    assert types["edge_agent_queue_duration_seconds"] == "histogram"
    good = {"model": "good", "version": "3"}
    assert buckets(samples, "edge_agent_request_duration_seconds", **good) == [
        1, 1, 1, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 4]
    assert value(samples, "edge_agent_request_duration_seconds_sum", **good) == \
        pytest.approx(30.002340)
    assert buckets(samples, "edge_agent_queue_duration_seconds", **good)[::4] == [
        1, 1, 2, 2, 2]
    instance0 = {"model_instance": "0", "device": "npu:0-2", "backend": "rknn",
                 "precision": "int8"}
    assert value(samples, "edge_agent_instance_request_duration_seconds_count",
                 **good, **instance0) == 1
    assert value(samples, "edge_agent_instance_queue_duration_seconds_count",
                 **good, **instance0) == 2
    assert value(samples, "edge_agent_model_ready", **good) == 1
    assert value(samples, "edge_agent_model_ready", model="down", version="3") == 0
    assert not [key for key in samples if ("model", "broken") in key[1]]
    assert not [key for key in samples if ("model", "down") in key[1] and "model_instance"
                in dict(key[1])]


# -- telemetry's intervals ----------------------------------------------------------------------


def _statistics(*versions: tuple[str, LatencyStats]) -> list[dict[str, Any]]:
    return [{"name": "demo", "version": number, "edge_agent": {"window":
            stats.window().to_dict()}} for number, stats in versions]


def test_each_sample_reports_the_calls_since_the_one_before() -> None:
    stats = LatencyStats()
    calls(stats, [1_000_000] * 90 + [50_000_000] * 10)
    calls(stats, [1], ok=False)
    intervals = Intervals()
    first = intervals.advance(100, _statistics(("1", stats)))[("demo", "1")]
    assert (first["count"], first["count_total"], first["errors"]) == (100, 100, 1)
    assert first["latency_ms"]["p95"] == pytest.approx(50, rel=0.01)

    calls(stats, [2_000_000] * 40)
    second = intervals.advance(100, _statistics(("1", stats)))[("demo", "1")]
    assert (second["count"], second["errors"]) == (40, 0)
    assert (second["count_total"], second["errors_total"]) == (140, 1)
    latency = second["latency_ms"]
    assert latency["p50"] == latency["p99"] == pytest.approx(2, rel=0.01)
    assert latency["mean"] == 2 and latency["max"] == pytest.approx(2, rel=0.02)

    idle = intervals.advance(100, _statistics(("1", stats)))[("demo", "1")]
    assert idle["count"] == 0 and idle["throughput_per_s"] == 0
    assert set(idle["latency_ms"].values()) == {0}
    assert idle["count_total"] == 140


def test_a_new_process_a_reset_or_a_rebuilt_version_starts_a_new_run() -> None:
    stats, other = LatencyStats(), LatencyStats()
    calls(stats, [1_000_000] * 5)
    intervals = Intervals()
    intervals.advance(100, _statistics(("1", stats), ("2", other)))
    calls(other, [3_000_000] * 2)
    again = intervals.advance(101, _statistics(("1", stats), ("2", other)))  # a restart
    assert again[("demo", "1")]["count"] == 5 and again[("demo", "2")]["count"] == 2

    rebuilt = LatencyStats()  # version 2 loaded again: generation 0 again, another first call
    calls(rebuilt, [1_000_000] * 3, start_ns=7)
    figures = intervals.advance(101, _statistics(("1", stats), ("2", rebuilt)))
    assert figures[("demo", "1")]["count"] == 0
    assert figures[("demo", "2")]["count"] == 3 == figures[("demo", "2")]["count_total"]

    stats.reset()
    calls(stats, [1_000_000] * 4)
    assert intervals.advance(101, _statistics(("1", stats)))[("demo", "1")]["count"] == 4


def test_telemetry_of_a_running_agent_is_per_interval(tmp_path: Path, broker: Broker) -> None:
    watcher = Subscriber(broker, [f"{TOPIC}/telemetry"])
    agent = start_agent(write_config(tmp_path, broker.port,
                                     inference={"source": "synthetic", "rate_hz": 50}))
    try:
        def counted() -> list[dict[str, Any]]:
            return [r["metrics"]["inference"] for r in watcher.on("telemetry")
                    if r["metrics"]["inference"].get("count_total", 0) > 0]

        assert wait_until(lambda: len(counted()) >= 6, 90), agent.stdout
        records = counted()
        for earlier, later in itertools.pairwise(records):
            assert later["count"] == later["count_total"] - earlier["count_total"]
            assert later["models"][0]["count"] == later["count"]
        assert sum(r["count"] for r in records[1:]) == \
            records[-1]["count_total"] - records[0]["count_total"]
        assert records[-1]["count"] < records[-1]["count_total"]
        assert all(r["errors"] == 0 and r["latency_ms"]["p99"] > 0 for r in records[1:]
                   if r["count"])
        served = scrape(records[-1]["data_plane"]["metrics"])  # the supervised process's
        assert value(served, "edge_agent_request_duration_seconds_count", model="demo",
                     version="1") >= records[-1]["count_total"]
    finally:
        agent.kill()
        agent.wait(30)
        watcher.close()


# -- infer --url --priority-mix -----------------------------------------------------------------


def _priority_run(url: str, mix: str) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, "-m", "agent", "infer", "--url", url, "--seconds", "1",
         "--concurrency", "2", "--priority-mix", mix, "--json"], capture_output=True,
        text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)  # type: ignore[no-any-return]


def test_infer_url_sends_the_priority_mix_and_reports_each(tmp_path: Path) -> None:
    demo = tmp_path / "state" / "repository" / "demo"  # the demo entry with two levels
    demo.mkdir(parents=True)
    (demo / "config.yaml").write_text("dynamic_batching: {priority_levels: 2}\n")
    # every level open: the mix is what is measured here, not the token's privilege
    with serve_process(tmp_path, privileged_priority=0) as plane:
        for url in (f"http://{plane['http']}", f"grpc://{plane['grpc']}"):
            report = _priority_run(url, "1:0.2,2:0.8")
            by = report["by_priority"]
            assert set(by) == {"1", "2"} and report["errors"] == 0
            assert by["1"]["count"] + by["2"]["count"] == report["count"] > 10
            assert abs(by["1"]["count"] - 0.2 * report["count"]) <= 1
            assert all(f["latency_ms"]["p99"] > 0 and f["throughput_per_s"] > 0
                       for f in by.values())


def _priorities(values: Mapping[int, float], n: int) -> list[int]:
    from agent.cli.infer_remote import PriorityMix

    mix = PriorityMix(dict(values))
    return [mix.next() for _ in range(n)]


def test_the_priority_mix_is_deterministic_and_proportional() -> None:
    assert _priorities({1: 0.2, 2: 0.8}, 10) == [2, 2, 1, 2, 2, 2, 2, 1, 2, 2]
    sent = _priorities({0: 1, 5: 2, 9: 1}, 400)
    assert [sent.count(p) for p in (0, 5, 9)] == [100, 200, 100]
    bad = subprocess.run([sys.executable, "-m", "agent", "infer", "--url", "http://127.0.0.1:1",
                          "--priority-mix", "1:x"], capture_output=True, text=True,
                         timeout=60, check=False)
    assert bad.returncode == 2 and "expected PRIORITY:FRACTION" in bad.stderr
    local = subprocess.run([sys.executable, "-m", "agent", "infer", "--priority-mix", "1:1"],
                           capture_output=True, text=True, timeout=60, check=False)
    assert local.returncode == 2 and "--priority-mix needs --url" in local.stderr
