"""Benchmark: the QoS controller's instant levers, decision to applied.

(1) one decision of the core (agent.control.qos) for 2 and for 20 models, p50 and p99;
(2) one window's reading at idle: the statistics over HTTP, each model's figures
    (qos_inputs.Windows) and the decision, in CPU time of this process (which serves the
    statistics too), as a share of one core at one window a second;
(3) one lever applied through the data plane's token-guarded route (HttpClient.set_levers:
    the request, the queue's retune under its lock, the answer) on a real registry of ONNX
    Runtime sessions behind the real HTTP front end, while four clients keep the model busy;
    p50 and p99 over sequential changes, and the requests that failed meanwhile (none).

Target (issue 34): one decision <= 17 ms from window to applied lever, for the instant levers.
The whole path of a real ``edge-agent run`` also reads the statistics once per window
(``qos_action``'s ``applied_ms`` counts from the decision to the data plane's answer).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import onnx_models
from http_helpers import HttpServer
from serving_helpers import cpu_factory

from agent.control.qos import Figures, Levers, Objective, QosController
from agent.service.qos_inputs import Windows
from agent.serving.access import Access
from agent.serving.core import InferRequest, Tensor
from agent.serving.http_client import HttpClient
from agent.serving.registry import ModelRegistry


def percentiles(samples: list[float]) -> str:
    ms = np.array(samples)
    return (f"p50 {np.percentile(ms, 50):.3f} ms, p99 {np.percentile(ms, 99):.3f} ms, "
            f"max {ms.max():.3f} ms")


def decisions(models: int, rounds: int) -> None:
    names = [f"m{i}" for i in range(models)]
    objectives = {n: Objective("latency_critical" if i == 0 else "best_effort",
                               p99_ms=5.0 if i == 0 else None) for i, n in enumerate(names)}
    levers = {n: Levers(2000, 8) for n in names}
    controller = QosController()
    samples = []
    for turn in range(rounds):
        figures = {n: Figures(p99_ms=9.0 if turn % 3 else 2.0, rate_rps=50.0, count=50)
                   for n in names}
        start = time.perf_counter()
        controller.decide(figures, objectives, levers, levers)
        samples.append((time.perf_counter() - start) * 1000)
    print(f"decide, {models} models, {rounds} windows: {percentiles(samples)}")


def applied(rounds: int) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        repo = Path(scratch) / "repository"
        (repo / "busy" / "1").mkdir(parents=True)
        onnx_models.dynamic_batch_mlp(repo / "busy" / "1" / "model.onnx")
        (repo / "busy" / "config.yaml").write_text(
            "max_batch_size: 8\ninstances: [{count: 2}]\n"
            "dynamic_batching: {preferred_batch_size: [4, 8], max_queue_delay_us: 2000}\n")
        token = Path(scratch) / "token"
        token.write_text("bench-token")
        token.chmod(0o600)
        registry = ModelRegistry(repo, {}, cpu_factory, probe_interval_s=3600)
        registry.start()
        server = HttpServer(registry, Access([token], everything=False))
        stop, failed, served = threading.Event(), [0], [0]

        def load() -> None:
            x = (Tensor("x", np.full((1, 64), 0.5, np.float32)),)
            while not stop.is_set():
                try:
                    registry.infer(InferRequest("busy", "", x))
                    served[0] += 1
                except Exception:  # counted: the bench reports failures, never hides them
                    failed[0] += 1

        threads = [threading.Thread(target=load) for _ in range(4)]
        client = HttpClient(f"http://{server.url}", token="bench-token", timeout_s=10)
        samples = []
        try:
            idle_window(client, rounds)
            for thread in threads:
                thread.start()
            for turn in range(rounds):
                change = {"max_queue_delay_us": 0 if turn % 2 else 2000,
                          "preferred_batch_size": [2] if turn % 2 else [4, 8]}
                start = time.perf_counter()
                client.set_levers("busy", change)
                samples.append((time.perf_counter() - start) * 1000)
        finally:
            stop.set()
            for thread in threads:
                thread.join()
            client.close()
            server.stop()
            registry.stop()
        warm = min(10, rounds // 2)  # the first changes warm the path up
        print(f"lever applied through the data plane, {rounds} changes under load: "
              f"{percentiles(samples[warm:])}; requests served {served[0]}, failed {failed[0]} "
              "(target: decision + this <= 17 ms)")


def idle_window(client: HttpClient, rounds: int) -> None:
    """The controller's work each window with nothing to do: read, figure, decide."""
    windows, controller = Windows(), QosController()
    objectives = {"busy": Objective("latency_critical", p99_ms=50.0)}
    cpu, wall = [], []
    for turn in range(rounds):
        start, started_cpu = time.perf_counter(), time.process_time()
        served = windows.advance(1, client.statistics(), now_s=float(turn))
        controller.decide({m: s.figures for m, s in served.items()}, objectives,
                          {m: s.levers for m, s in served.items()},
                          {m: s.configured for m, s in served.items()})
        cpu.append((time.process_time() - started_cpu) * 1000)
        wall.append((time.perf_counter() - start) * 1000)
    print(f"one idle window (statistics read, figures, decision): {percentiles(wall)}; CPU "
          f"{np.mean(cpu):.3f} ms a window = {np.mean(cpu) / 10:.3f} % of a core at 1 s "
          "windows (target <= 0.5 %)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=500)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be 1 or more, not {args.rounds}")
    decisions(2, args.rounds * 4)
    decisions(20, args.rounds * 4)
    applied(args.rounds)


if __name__ == "__main__":
    main()
