"""The aarch64 lane's smoke (``.ci/aarch64``): the commands a device runs, in the arm64
chroot, each checked from the host against what the x86_64 checkout gives.

discover and ``profile plan auto`` on the Jetson and RK3588 fixture trees must print the
same JSON as on x86_64 (only ``root``, the tree's path, differs); ``infer`` runs the demo
model; ``serve`` answers tritonclient (HTTP and gRPC) with the probabilities x86_64's
onnxruntime computes for the same input; ``run --seconds 10`` reports to a Mosquitto on the
host's loopback (the chroot shares the host's network) and stops with an empty outbox.
Run by the host's dev venv (tritonclient, paho, onnxruntime); prints one line per check.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

BOARDS = {"jetson-agx-orin-jp6": "jetson-orin", "rk3588-vendor": "rk3588"}
RUN_BOARD = "rk3588-vendor"  # the Debian/Python 3.11 board this chroot stands for
AGENT = "/opt/edge-agent/bin/edge-agent"
GUEST_FIXTURES = "/src/tests/fixtures"
TIMEOUT_S = 300.0


class Lane:
    """Runs the agent in the chroot and the same command on the host, for comparison."""

    def __init__(self, rootfs: Path, checkout: Path, env: list[str]) -> None:
        self.rootfs = rootfs
        self.checkout = checkout
        self.prefix = ["chroot", str(rootfs), "/usr/bin/env", "-i", *env]

    def guest(self, *args: str) -> str:
        """The agent's stdout in the chroot; its stderr when it fails."""
        return self._checked([*self.prefix, AGENT, *args], "aarch64")

    def host(self, *args: str) -> str:
        """The checkout's agent, run by this (x86_64) interpreter."""
        return self._checked([sys.executable, "-m", "agent", *args], "x86_64")

    def _checked(self, command: list[str], where: str) -> str:
        result = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S,
                                cwd=self.checkout, check=False)
        if result.returncode != 0:
            raise SystemExit(f"{where}: {' '.join(command[-6:])} exited {result.returncode}:\n"
                             f"{result.stderr[-3000:]}")
        return result.stdout

    def write(self, guest_path: str, text: str) -> None:
        path = self.rootfs / guest_path.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def check(name: str, ok: bool, detail: str) -> None:
    print(f"aarch64 smoke: {'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        raise SystemExit(f"aarch64 smoke: {name} failed")


def without_root(text: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(text)
    data.pop("root", None)
    return data


def discover_and_plan(lane: Lane) -> None:
    for board, profile in BOARDS.items():
        guest_tree = f"{GUEST_FIXTURES}/{board}"
        host_tree = lane.checkout / "tests/fixtures" / board
        summary = lane.guest("discover", "--root", guest_tree)
        check(f"discover {board}", summary.startswith("Board"), summary.splitlines()[0])
        same = without_root(lane.guest("discover", "--root", guest_tree, "--json")) == \
            without_root(lane.host("discover", "--root", str(host_tree), "--json"))
        check(f"discover --json {board}", same, "the same topology as on x86_64")
        guest_plan = json.loads(lane.guest("profile", "plan", "auto", "--root", guest_tree,
                                           "--state-dir", f"/tmp/plan-{board}", "--json"))
        host_plan = json.loads(lane.host("profile", "plan", "auto", "--root", str(host_tree),
                                         "--state-dir", str(lane.rootfs / "tmp/host-plan" / board),
                                         "--json"))
        check(f"profile plan auto {board}", guest_plan["profile"] == profile and
              guest_plan == host_plan,
              f"profile {guest_plan['profile']}, {len(guest_plan['changes'])} changes, "
              f"the same plan as on x86_64")


def infer(lane: Lane) -> None:
    stats = json.loads(lane.guest("infer", "--seconds", "3", "--json", "--no-progress",
                                  "--root", f"{GUEST_FIXTURES}/{RUN_BOARD}",
                                  "--state-dir", "/tmp/infer-state"))
    check("infer", stats["count"] > 0 and stats["errors"] == 0,
          f"{stats['count']} calls on {stats['providers']}, "
          f"p50 {stats['latency_ms']['p50']:.1f} ms")


def expected_probabilities(lane: Lane, image: np.ndarray) -> np.ndarray:
    import onnxruntime

    model = lane.checkout / "agent/inference/models/demo_cnn.onnx"
    session = onnxruntime.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    return np.asarray(session.run(["probabilities"], {"image": image})[0])


def wait_for(predicate: Any, what: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not predicate():
        if process.poll() is not None:
            raise SystemExit(f"aarch64 smoke: {what}: the process exited {process.returncode}")
        if time.monotonic() > deadline:
            raise SystemExit(f"aarch64 smoke: {what}: not within {TIMEOUT_S:.0f} s")
        time.sleep(0.1)


def serve(lane: Lane) -> None:
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    lane.write("/tmp/serve.yaml", 'serve: {metrics: "127.0.0.1:0"}\n')
    ready = lane.rootfs / "tmp/serve-ready.json"
    process = subprocess.Popen([*lane.prefix, AGENT, "serve", "--config", "/tmp/serve.yaml",
                                "--root", f"{GUEST_FIXTURES}/{RUN_BOARD}",
                                "--state-dir", "/tmp/serve-state", "--http", "127.0.0.1:0",
                                "--grpc", "127.0.0.1:0", "--ready-file", "/tmp/serve-ready.json"])
    try:
        wait_for(ready.exists, "serve's ready file", process)
        listening = json.loads(ready.read_text())
        image = np.linspace(0, 1, 3 * 64 * 64, dtype=np.float32).reshape(1, 3, 64, 64)
        expected = expected_probabilities(lane, image)
        http = httpclient.InferenceServerClient(listening["http"])
        wait_for(lambda: http.is_model_ready("demo"), "the demo model's load", process)
        request = httpclient.InferInput("image", [1, 3, 64, 64], "FP32")
        request.set_data_from_numpy(image)
        got = http.infer("demo", [request]).as_numpy("probabilities")
        check("serve: tritonclient.http infer", np.allclose(got, expected, atol=1e-5),
              f"demo on {listening['http']}: the probabilities x86_64 computes")
        grpc = grpcclient.InferenceServerClient(listening["grpc"])
        request_grpc = grpcclient.InferInput("image", [1, 3, 64, 64], "FP32")
        request_grpc.set_data_from_numpy(image)
        got = grpc.infer("demo", [request_grpc]).as_numpy("probabilities")
        check("serve: tritonclient.grpc infer", np.allclose(got, expected, atol=1e-5),
              f"demo on {listening['grpc']}: the same")
    finally:
        process.send_signal(signal.SIGTERM)  # chroot execs env, which execs the agent
        code = process.wait(TIMEOUT_S)
    check("serve: SIGTERM", code == 0, f"exit {code}")


def run(lane: Lane) -> None:
    sys.path.insert(0, str(lane.checkout / "tests"))
    from mqtt_helpers import Broker, Subscriber, wait_until

    broker = Broker(lane.rootfs.parent / "broker")
    broker.start()
    subscriber = Subscriber(broker, ["edge/#"], client_id="aarch64-lane")
    try:
        check("mosquitto on the host", subscriber.subscribed.wait(10),
              f"{broker.host}:{broker.port}")
        lane.write("/tmp/agent.yaml", "\n".join([
            "node_id: aarch64-ci", f"root: {GUEST_FIXTURES}/{RUN_BOARD}",
            "state_dir: /tmp/run-state", f"mqtt: {{host: {broker.host}, port: {broker.port}}}",
            'serve: {http: "127.0.0.1:0", grpc: "127.0.0.1:0", metrics: "127.0.0.1:0"}', ""]))
        result = subprocess.run([*lane.prefix, AGENT, "run", "--config", "/tmp/agent.yaml",
                                 "--seconds", "10"], capture_output=True, text=True,
                                timeout=TIMEOUT_S, check=False)
        last = (result.stderr.strip().splitlines() or [""])[-1]
        check("run --seconds 10", result.returncode == 0 and "0 waiting in the outbox" in last,
              f"exit {result.returncode}: {last}")
        states = lambda: [p.get("state") for p in subscriber.on("state")]  # noqa: E731
        wait_until(lambda: "stopped" in states(), 10)
        telemetry = subscriber.on("telemetry")
        check("MQTT from aarch64", "online" in states() and "stopped" in states() and
              len(telemetry) >= 5 and bool(subscriber.on("birth")),
              f"states {states()}, {len(telemetry)} telemetry records, "
              f"{len(subscriber.on('birth'))} birth")
    finally:
        subscriber.close()
        broker.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rootfs", type=Path, required=True)
    parser.add_argument("--checkout", type=Path, required=True)
    parser.add_argument("env", nargs="*", help="the guest's environment (NAME=VALUE)")
    options = parser.parse_args()
    lane = Lane(options.rootfs, options.checkout, options.env)
    for step in (discover_and_plan, infer, serve, run):
        started = time.monotonic()
        step(lane)
        print(f"aarch64 smoke: {step.__name__} took {time.monotonic() - started:.0f}s",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
