"""Benchmark: edge-agent serve against the Python OIP servers a user could pick instead.

The same model (bench/serve.py's real model), the same client (tritonclient gRPC; HTTP
JSON where a server's gRPC does not answer it) and the same intra-op threads for every
server, all of them running at once on free loopback ports, measured in interleaved rounds
whose order rotates, so that the other load on the machine falls on every server alike:

1. Concurrency 1 on the model without batching: p50 and p99, each as a ratio
   server / edge-agent (bare ORT in this process beside them, for the floor).
2. Concurrency 16 on the model with each server's own adaptive batching (up to BATCH rows;
   edge-agent's on one single-threaded instance per core, as bench/serve.py runs it):
   throughput as edge-agent / server, p50 and p99 as server / edge-agent.

The alternatives live in venvs of their own (they pin grpcio, protobuf and fastapi apart
from ours; README's Benchmarks section has the commands) and serve the model through the
small runtimes in bench/alternatives/. One whose interpreter is not given, lacks the
package, or does not come up is reported as skipped with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's agent
from serve import (  # the data-plane bench's helpers, not copies
    BATCH,
    CONCURRENCY,
    SPLIT,
    THREADS,
    bare_session,
    concurrent_rate,
    input_of,
    p,
    real_model,
    repository,
    start_server,
    timed,
)

from agent.inference.demo_model import DEMO_MODEL_PATH
from agent.kernel.process import keep_freed_buffers
from agent.serving.server import KEPT_BUFFER_BYTES

ALTERNATIVES = Path(__file__).resolve().parent / "alternatives"
ROUNDS = 3
BARE = "bare ORT, no server"
JSON = {"Content-Type": "application/json"}  # KServe reads a body without it as binary
READY_S = 120.0
MAX_BATCH_TIME_S = 0.002  # as serve.repository()'s max_queue_delay_us: 2000
# Inference in MLServer's API process: its default, 1 worker process, measured slower here
# (and MLServer 1.7.1's workers die at start with uvloop >= 0.22, "no current event loop").
MLSERVER_WORKERS = 0


class Skipped(Exception):
    """An alternative that cannot be measured, with the reason a person can act on."""


def not_connected(index: int, model: str) -> np.ndarray:
    raise RuntimeError("connect() first")


@dataclass
class Target:
    name: str
    settings: str
    grpc: str | None = None
    http: str | None = None
    transport: str = "gRPC"
    call: Callable[[int, str], np.ndarray] = field(repr=False, default=not_connected)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def interpreter_version(python: str | None, flag: str, package: str,
                        distribution: str | None = None) -> str:
    """The version of ``distribution`` (default: named as the ``package`` it imports) in
    that interpreter, or Skipped saying why not."""
    if not python:
        raise Skipped(f"{flag} not given")
    if not Path(python).is_file():
        raise Skipped(f"{flag} {python}: no such file")
    try:
        probe = subprocess.run([python, "-c", f"import importlib.metadata as m, onnxruntime, "
                                f"{package}; print(m.version('{distribution or package}'))"],
                               capture_output=True, text=True, timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise Skipped(f"{flag} {python}: {error}") from error
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        raise Skipped(f"{flag} {python} cannot import {package} and onnxruntime: {last}")
    return probe.stdout.strip()


@contextmanager
def server_process(argv: list[str], log: Path, http: str, models: list[str],
                   env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """Starts a server in a session of its own, waits (bounded) until it and each model
    answer ready over HTTP, and stops the whole session on the way out."""
    with log.open("wb") as sink:
        process = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, env=env,
                                   cwd=log.parent, start_new_session=True)
    try:
        urls = [f"http://{http}/v2/health/ready",
                *(f"http://{http}/v2/models/{model}/ready" for model in models)]
        deadline = time.monotonic() + READY_S
        while urls:
            if process.poll() is not None or time.monotonic() > deadline:
                tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])
                state = (f"exited {process.returncode}" if process.poll() is not None
                         else f"not ready after {READY_S:.0f} s")
                raise Skipped(f"{argv[0]} {state}; its output ends: {tail}")
            try:
                with urllib.request.urlopen(urls[0], timeout=2) as answer:
                    if answer.status == 200:
                        urls.pop(0)
                        continue
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)  # a bounded readiness poll, nothing else
        yield process
    finally:
        stop(process)


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)  # the server and the workers it forked
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)


def start_mlserver(python: str, scratch: Path, model: Path,
                   stack: ExitStack) -> Target:
    version = interpreter_version(python, "--mlserver-python", "mlserver")
    root = scratch / "mlserver"
    http, grpc = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    (root / "single").mkdir(parents=True)
    (root / "real").mkdir()
    (root / "settings.json").write_text(json.dumps({
        "host": "127.0.0.1", "http_port": int(http.rsplit(":")[1]),
        "grpc_port": int(grpc.rsplit(":")[1]), "metrics_endpoint": None,
        "parallel_workers": MLSERVER_WORKERS, "debug": False}))
    for name, batching in (("single", {}), ("real", {"max_batch_size": BATCH,
                                                     "max_batch_time": MAX_BATCH_TIME_S})):
        (root / name / "model-settings.json").write_text(json.dumps({
            "name": name, "implementation": "mlserver_onnx.OnnxModel",
            "parameters": {"uri": str(model), "extra": {"threads": THREADS}}, **batching}))
    env = {**os.environ, "PYTHONPATH": str(ALTERNATIVES)}
    stack.enter_context(server_process([python, "-m", "mlserver.cli.main", "start", str(root)],
                                       scratch / "mlserver.log", http, ["single", "real"],
                                       env))
    return Target(f"MLServer {version}", f"adaptive batching max_batch_size {BATCH}, "
                  f"max_batch_time {MAX_BATCH_TIME_S} s; parallel_workers "
                  f"{MLSERVER_WORKERS}; ORT runs off the event loop; {THREADS} intra-op "
                  "threads", grpc, http)


def start_kserve(python: str, scratch: Path, model: Path, stack: ExitStack) -> Target:
    version = interpreter_version(python, "--kserve-python", "kserve")
    http_port, grpc_port = free_port(), free_port()
    http = f"127.0.0.1:{http_port}"
    stack.enter_context(server_process(
        [python, str(ALTERNATIVES / "kserve_onnx.py"), "--onnx", str(model),
         "--threads", str(THREADS), "--names", "single", "--threaded-names", "real",
         "--http_port", str(http_port), "--grpc_port", str(grpc_port),
         "--enable_latency_logging", "false"],
        scratch / "kserve.log", http, ["single", "real"]))
    return Target(f"KServe {version}", "no adaptive batching (the Python server has none; "
                  "KServe batches in its Kubernetes sidecar); 1 worker; single: predict on the "
                  "event loop; real: ORT in a thread, so runs overlap; latency logging off; "
                  f"{THREADS} intra-op threads; binds all interfaces (not settable)",
                  f"127.0.0.1:{grpc_port}", http)


def _triton_config(name: str, model: Path, batching: bool, count: int, threads: int) -> str:
    """config.pbtxt of a python-backend model serving ``model`` (bench/serve.py's layout:
    input ``x`` [3, 224, 224], output ``fetch_name_0`` [4], as the bare session reads it)."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])

    def tensors(kind: str, specs: list[Any]) -> str:
        return f"{kind} [ " + ", ".join(
            f'{{ name: "{spec.name}" data_type: TYPE_FP32 dims: '
            f'[ {", ".join(str(d) for d in spec.shape[1:])} ] }}' for spec in specs) + " ]"

    queue = (f"dynamic_batching {{ max_queue_delay_microseconds: "
             f"{int(MAX_BATCH_TIME_S * 1e6)} preferred_batch_size: [ {BATCH} ] }}\n"
             if batching else "")
    return (f'name: "{name}"\nbackend: "python"\nmax_batch_size: {BATCH}\n'
            f"{tensors('input', session.get_inputs())}\n"
            f"{tensors('output', session.get_outputs())}\n{queue}"
            f"instance_group [ {{ count: {count} kind: KIND_CPU }} ]\n"
            f'parameters: {{ key: "onnx" value: {{ string_value: "{model}" }} }}\n'
            f'parameters: {{ key: "threads" value: {{ string_value: "{threads}" }} }}\n')


def start_triton(python: str, scratch: Path, model: Path, stack: ExitStack) -> Target:
    """NVIDIA's ``tritonserver`` from the nvidia-pytriton wheel, as pytriton itself lays it
    out: the server tree copied with the stub for this interpreter's Python version in its
    python backend, the wheel's libraries and the interpreter's libpython on the loader
    path.  Its python backend runs ORT through bench/alternatives/triton_onnx.py."""
    version = interpreter_version(python, "--triton-python", "pytriton", "nvidia-pytriton")
    probe = subprocess.run(
        [python, "-c", "import pytriton, sys, sysconfig; from pathlib import Path; "
         "print(Path(pytriton.__file__).parent); print(sysconfig.get_config_var('LIBDIR')); "
         "print(f'{sys.version_info[0]}.{sys.version_info[1]}')"],
        capture_output=True, text=True, timeout=60, check=True)
    package, libdir, python_version = probe.stdout.split()
    dist = Path(package) / "tritonserver"
    server = scratch / "tritonserver"
    shutil.copytree(dist, server, ignore=shutil.ignore_patterns("python_backend_stubs"))
    shutil.copy(dist / "python_backend_stubs" / python_version / "triton_python_backend_stub",
                server / "backends" / "python")
    root = scratch / "triton-repository"
    for name, batching, count, threads in (("single", False, 1, THREADS),
                                           ("real", True, THREADS, 1)):
        (root / name / "1").mkdir(parents=True)
        shutil.copy(ALTERNATIVES / "triton_onnx.py", root / name / "1" / "model.py")
        (root / name / "config.pbtxt").write_text(
            _triton_config(name, model, batching, count, threads))
    http_port, grpc_port = free_port(), free_port()
    env = {**os.environ, "PATH": f"{Path(python).parent}:{os.environ['PATH']}",
           "LD_LIBRARY_PATH": f"{Path(package).parent / 'nvidia_pytriton.libs'}:{libdir}"}
    http = f"127.0.0.1:{http_port}"
    stack.enter_context(server_process(
        [str(server / "bin" / "tritonserver"), "--model-repository", str(root),
         "--backend-directory", str(server / "backends"), "--http-address", "127.0.0.1",
         "--http-port", str(http_port), "--grpc-address", "127.0.0.1",
         "--grpc-port", str(grpc_port), "--allow-metrics", "false"],
        scratch / "tritonserver.log", http, ["single", "real"], env))
    return Target(f"Triton (pytriton {version})", f"tritonserver's python backend running "
                  f"ORT (bench/alternatives/triton_onnx.py); real: dynamic batching "
                  f"max_batch_size {BATCH}, max_queue_delay 2000 us, preferred [{BATCH}] on "
                  f"{THREADS} instances of 1 thread; single: 1 instance of {THREADS} threads",
                  f"127.0.0.1:{grpc_port}", http)


def connect(target: Target, name: str, x: np.ndarray, output: str,
            expected: np.ndarray) -> None:
    """Sets ``target.call``: tritonclient gRPC if the server answers it with the right
    output, else tritonclient HTTP with JSON tensors; Skipped if neither does."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    def over_grpc() -> Callable[[int, str], np.ndarray]:
        clients = [grpcclient.InferenceServerClient(target.grpc or "")
                   for _ in range(CONCURRENCY)]

        def call(index: int, model: str) -> np.ndarray:
            given = grpcclient.InferInput(name, list(x.shape), "FP32")
            given.set_data_from_numpy(x)
            return clients[index].infer(model, [given]).as_numpy(output)
        return call

    def over_http() -> Callable[[int, str], np.ndarray]:
        clients = [httpclient.InferenceServerClient(target.http or "")
                   for _ in range(CONCURRENCY)]

        def call(index: int, model: str) -> np.ndarray:
            given = httpclient.InferInput(name, list(x.shape), "FP32")
            given.set_data_from_numpy(x, binary_data=False)
            wanted = httpclient.InferRequestedOutput(output, binary_data=False)
            return clients[index].infer(model, [given], outputs=[wanted],
                                        headers=JSON).as_numpy(output)
        return call

    failures = []
    for transport, make, address in (("gRPC", over_grpc, target.grpc),
                                     ("HTTP JSON", over_http, target.http)):
        if address is None:
            continue
        try:
            call = make()
            answers = [call(0, model) for model in ("single", "real")]
        except (InferenceServerException, OSError, ValueError) as error:
            failures.append(f"{transport}: {str(error).splitlines()[0][:200]}")
            continue
        if all(a is not None and a.shape == expected.shape and
               np.allclose(a, expected, atol=1e-5) for a in answers):
            target.call, target.transport = call, transport
            return
        failures.append(f"{transport}: output differs from bare ORT")
    raise Skipped("; ".join(failures))


def measure(targets: list[Target], bare: Callable[[], Any],
            seconds: float) -> tuple[dict[str, list[float]], dict[str, tuple[float, list[float]]]]:
    """Concurrency-1 latencies (and bare ORT's) and concurrency-16 (rate, latencies) per
    target, in ROUNDS interleaved rounds whose order rotates."""
    share = seconds / ROUNDS
    single: dict[str, list[float]] = {t.name: [] for t in targets} | {BARE: []}
    for target in targets:  # warm: sessions, connections, the batchers' first batches
        timed(lambda target=target: target.call(0, "single"), 0.5)
        concurrent_rate(lambda i, target=target: target.call(i, "real"), CONCURRENCY, 1.0)
    for round_ in range(ROUNDS):
        for target in targets[round_ % len(targets):] + targets[:round_ % len(targets)]:
            single[target.name] += timed(lambda target=target: target.call(0, "single"),
                                         share)
        single[BARE] += timed(bare, share)
    counts = {t.name: 0.0 for t in targets}
    spent = {t.name: 0.0 for t in targets}
    batched: dict[str, list[float]] = {t.name: [] for t in targets}
    for round_ in range(ROUNDS):
        for target in targets[round_ % len(targets):] + targets[:round_ % len(targets)]:
            rate, latencies = concurrent_rate(lambda i, target=target: target.call(i, "real"),
                                              CONCURRENCY, share)
            counts[target.name] += len(latencies)
            spent[target.name] += len(latencies) / rate
            batched[target.name] += latencies
    return single, {name: (counts[name] / spent[name], batched[name]) for name in batched}


def report(targets: list[Target], single: dict[str, list[float]],
           batched: dict[str, tuple[float, list[float]]]) -> None:
    ours = targets[0].name
    ours_50, ours_99 = p(single[ours], 50), p(single[ours], 99)
    print(f"\n1. concurrency 1, model without batching (ratios: server / {ours}):")
    for name, latencies in single.items():
        p50, p99 = p(latencies, 50), p(latencies, 99)
        ratios = "" if name in (ours, BARE) else \
            f"   p50 {p50 / ours_50:5.2f}x  p99 {p99 / ours_99:5.2f}x"
        print(f"   {name:<24} p50 {p50:7.2f} ms  p99 {p99:7.2f} ms{ratios}")
    rate_ours, lat_ours = batched[ours]
    print(f"\n2. concurrency {CONCURRENCY}, model with batching (throughput: {ours} / server; "
          "p50, p99: server / edge-agent):")
    for name, (rate, latencies) in batched.items():
        p50, p99 = p(latencies, 50), p(latencies, 99)
        ratios = "" if name == ours else (f"   {rate_ours / rate:5.2f}x  p50 "
                                          f"{p50 / p(lat_ours, 50):5.2f}x  p99 "
                                          f"{p99 / p(lat_ours, 99):5.2f}x")
        print(f"   {name:<24} {rate:7.1f}/s  p50 {p50:7.1f} ms  p99 {p99:7.1f} ms{ratios}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=6.0,
                        help="per measurement per server, split into interleaved rounds")
    parser.add_argument("--mlserver-python", help="python of a venv with mlserver, onnxruntime")
    parser.add_argument("--kserve-python", help="python of a venv with kserve, onnxruntime")
    parser.add_argument("--triton-python", help="python of a venv with nvidia-pytriton, "
                        "onnxruntime and numpy < 2 (its tritonserver's python backend)")
    args = parser.parse_args()
    keep_freed_buffers(KEPT_BUFFER_BYTES)  # the client's allocator, as in bench/serve.py
    model = real_model()
    bare = bare_session(model)
    name, x = input_of(bare, 1)
    output = bare.get_outputs()[0].name
    expected = bare.run(None, {name: x})[0]
    print(f"model {model.name} ({'real' if model != DEMO_MODEL_PATH else 'demo stand-in'}), "
          f"{THREADS} intra-op threads everywhere, concurrency 1 and {CONCURRENCY}")
    with tempfile.TemporaryDirectory() as scratch_dir, ExitStack() as stack:
        scratch = Path(scratch_dir)
        repository(scratch, model, SPLIT)  # batching on one 1-thread instance per core
        process, addresses = start_server(scratch)
        stack.callback(lambda: (process.terminate(), process.wait(30)))
        targets = [Target("edge-agent", f"dynamic_batching max_batch_size {BATCH}, "
                          f"max_queue_delay_us 2000, preferred_batch_size [{BATCH}] on "
                          f"{THREADS} instances of 1 thread; single: 1 instance of "
                          f"{THREADS} threads", addresses["grpc"])]
        try:
            connect(targets[0], name, x, output, expected)
        except Skipped as why:
            raise SystemExit(f"edge-agent serve: {why}") from why
        starts = (("MLServer", start_mlserver, args.mlserver_python),
                  ("KServe", start_kserve, args.kserve_python),
                  ("Triton", start_triton, args.triton_python))
        for label, start, python in starts:
            try:
                target = start(python, scratch, model, stack)
                connect(target, name, x, output, expected)
                targets.append(target)
            except Skipped as why:
                print(f"{label}: skipped: {why}")
        for target in targets:
            print(f"{target.name} over {target.transport}: {target.settings}")
        single, batched = measure(targets, lambda: bare.run(None, {name: x}), args.seconds)
    report(targets, single, batched)


if __name__ == "__main__":
    main()
