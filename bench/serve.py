"""Benchmark: the demo model served by `edge-agent serve` (HTTP binary, HTTP JSON, gRPC, as
tritonclient sends them) against bare ONNX Runtime on the same model with the same threads,
interleaved in one run so machine drift cancels.

The server is a real `edge-agent serve` process on free loopback ports; the bare session
runs in this process.  Each round runs every variant for `--seconds`; printed are the
throughput and p50/p99 of each over all rounds, and the ratios against bare ORT.  What the
ratio measures is the protocol's cost (framing, a loopback round trip, the copy into and out
of the request) on a ~1 ms model: the next issue's batching and shared memory go after it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import yaml

from agent.inference.demo_model import DEMO_INPUT, DEMO_MODEL_PATH, DEMO_OUTPUT

THREADS = 2


def start_server(scratch: Path) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    config = scratch / "agent.yaml"
    config.write_text(yaml.safe_dump({
        "state_dir": str(scratch / "state"),
        "serve": {"http": "127.0.0.1:0", "grpc": "127.0.0.1:0",
                  "token_file": str(scratch / "token")}}))
    ready = scratch / "ready.json"
    process = subprocess.Popen([sys.executable, "-m", "agent", "serve", "--config",
                                str(config), "--ready-file", str(ready)],
                               stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not ready.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("edge-agent serve did not start")
        time.sleep(0.05)
    return process, json.loads(ready.read_text())


def measure(call: Callable[[], Any], seconds: float) -> list[float]:
    latencies = []
    end = time.perf_counter() + seconds
    while (start := time.perf_counter()) < end:
        call()
        latencies.append(time.perf_counter() - start)
    return latencies


def variants(addresses: dict[str, Any], x: np.ndarray) -> dict[str, Callable[[], Any]]:
    options = ort.SessionOptions()
    options.intra_op_num_threads = THREADS
    bare = ort.InferenceSession(str(DEMO_MODEL_PATH), options,
                                providers=["CPUExecutionProvider"])
    http = httpclient.InferenceServerClient(addresses["http"])
    grpc = grpcclient.InferenceServerClient(addresses["grpc"])

    def http_call(binary: bool) -> Callable[[], Any]:
        def call() -> Any:
            given = httpclient.InferInput(DEMO_INPUT, list(x.shape), "FP32")
            given.set_data_from_numpy(x, binary_data=binary)
            wanted = httpclient.InferRequestedOutput(DEMO_OUTPUT, binary_data=binary)
            return http.infer("demo", [given], outputs=[wanted]).as_numpy(DEMO_OUTPUT)
        return call

    def grpc_call() -> Any:
        given = grpcclient.InferInput(DEMO_INPUT, list(x.shape), "FP32")
        given.set_data_from_numpy(x)
        return grpc.infer("demo", [given]).as_numpy(DEMO_OUTPUT)

    return {"bare ORT": lambda: bare.run([DEMO_OUTPUT], {DEMO_INPUT: x}),
            "HTTP binary": http_call(True), "HTTP JSON": http_call(False),
            "gRPC": grpc_call}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="per variant and round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    x = np.random.default_rng(0).random((1, 3, 64, 64), dtype=np.float32)
    with tempfile.TemporaryDirectory() as scratch:
        (Path(scratch) / "token").write_text("bench\n")
        process, addresses = start_server(Path(scratch))
        try:
            calls = variants(addresses, x)
            for call in calls.values():  # warm every path up once
                call()
            results: dict[str, list[float]] = {name: [] for name in calls}
            for _ in range(args.rounds):
                for name, call in calls.items():
                    results[name] += measure(call, args.seconds)
        finally:
            process.terminate()
            process.wait(30)
    base = results["bare ORT"]
    base_rate = len(base) / sum(base)
    print(f"demo CNN [1,3,64,64], {args.rounds} rounds x {args.seconds:g} s per variant")
    print(f"{'variant':<12} {'calls/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'rate vs bare':>13} "
          f"{'p50 vs bare':>12}")
    for name, latencies in results.items():
        rate = len(latencies) / sum(latencies)
        p50, p99 = np.percentile(latencies, [50, 99]) * 1000
        bare50 = float(np.percentile(base, 50) * 1000)
        print(f"{name:<12} {rate:9.1f} {p50:8.3f} {p99:8.3f} {rate / base_rate:12.2f}x "
              f"{p50 / bare50:11.2f}x")


if __name__ == "__main__":
    main()
