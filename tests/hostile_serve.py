"""What any local process can send the data plane without a token: one function per attack of
issue 30, each bounded in count and time and ending by itself, aimed only at the 127.0.0.1
addresses it is given; a legit client that checks every answer against a local ONNX Runtime
session of the same model; and a sampler of the server's resident memory.

Shared by tests/test_hostile_serve.py and ``bench/serve.py --hostile``.  Every attack returns
a ``Flood``: what each hostile request got back (an HTTP status, a gRPC code name, or what
went wrong on the socket), so a caller asserts on the answers it wants.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import json
import socket
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from http.client import HTTPConnection, HTTPException
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import wire_helpers as wire

from agent.inference.demo_model import DEMO_MODEL_PATH

DEMO = "demo"
DEMO_INPUT, DEMO_OUTPUT = "image", "probabilities"
DEMO_SHAPE = (1, 3, 64, 64)
MB = 1 << 20
LOOPBACK = "127.0.0.1"
DYNAMIC, QUEUED = "dynamic", "queued"  # the models of ``repository``
QUEUED_SHAPE = (1, 3, 128, 128)  # some 20 ms a run of QUEUED on one thread


@dataclass
class Flood:
    """What one attack got: each hostile request's answer counted by kind (``200``, ``413``,
    ``UNAVAILABLE``, ``reset``, ``timeout``), and figures of its own (``notes``)."""

    kind: str
    answers: collections.Counter[str] = field(default_factory=collections.Counter)
    seconds: float = 0.0
    notes: dict[str, Any] = field(default_factory=dict)

    def count(self, answer: object) -> None:
        self.answers[str(answer)] += 1

    @property
    def server_errors(self) -> int:
        """Answers 500 (HTTP) or INTERNAL/UNKNOWN (gRPC): what no input may cost."""
        return sum(n for answer, n in self.answers.items()
                   if answer in ("500", "INTERNAL", "UNKNOWN"))


def host_port(address: str) -> tuple[str, int]:
    """``127.0.0.1:PORT`` split; anything but loopback is refused (these are attacks)."""
    host, _, port = address.rpartition(":")
    if host != LOOPBACK:
        raise ValueError(f"hostile traffic goes to {LOOPBACK} only, not {address}")
    return host, int(port)


def request(method: str, address: str, path: str, body: bytes | None = None,
            headers: dict[str, str] | None = None, timeout_s: float = 30.0
            ) -> tuple[str, bytes]:
    """One request on a fresh connection: its status and body, or ``reset``/``timeout``."""
    host, port = host_port(address)
    connection = HTTPConnection(host, port, timeout=timeout_s)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return str(response.status), response.read()
    except TimeoutError:
        return "timeout", b""
    except (ConnectionError, HTTPException, OSError):
        return "reset", b""
    finally:
        connection.close()


def post(address: str, path: str, body: bytes, headers: dict[str, str],
         timeout_s: float) -> tuple[str, bytes]:
    return request("POST", address, path, body, headers, timeout_s)


def get(address: str, path: str, timeout_s: float) -> tuple[str, bytes]:
    return request("GET", address, path, timeout_s=timeout_s)


def _parallel(kind: str, count: int, call: Callable[[int], tuple[str, bytes]]) -> Flood:
    """``count`` calls at once, each on its own thread; every answer counted."""
    flood = Flood(kind)
    began = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        for answer, _ in pool.map(call, range(count)):
            flood.count(answer)
    flood.seconds = time.monotonic() - began
    return flood


def binary_infer(name: str, x: np.ndarray, parameters: dict[str, Any] | None = None
                 ) -> tuple[bytes, dict[str, str]]:
    """An FP32 infer body in the binary extension and its headers (cheap to decode, so the
    server's time goes to the model, not to JSON)."""
    document: dict[str, Any] = {"inputs": [{"name": name, "shape": list(x.shape),
                                            "datatype": "FP32",
                                            "parameters": {"binary_data_size": x.nbytes}}]}
    if parameters:
        document["parameters"] = parameters
    head = json.dumps(document).encode()
    return head + x.astype(np.float32).tobytes(), {
        "Inference-Header-Content-Length": str(len(head)),
        "Content-Type": "application/octet-stream"}


# -- finding 1: compressed bodies ---------------------------------------------------------

@functools.lru_cache(maxsize=4)
def gzip_of_zeros(inflated_mb: int) -> bytes:
    """A gzip member of ``inflated_mb`` MiB of zeros (about 1/1000 of it), built chunk by
    chunk: the inflated size is never held."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)  # wbits 31: the gzip container
    chunk = bytes(MB)
    parts = [packer.compress(chunk) for _ in range(inflated_mb)]
    return b"".join(parts) + packer.flush()


def gzip_bombs(http: str, model: str = DEMO, count: int = 3, inflated_mb: int = 1024,
               timeout_s: float = 30.0) -> Flood:
    """``count`` parallel infer POSTs with ``Content-Encoding: gzip``, each about
    inflated_mb/1000 MB on the wire inflating to ``inflated_mb`` MiB."""
    body = gzip_of_zeros(inflated_mb)
    headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
    flood = _parallel("gzip", count, lambda _: post(
        http, f"/v2/models/{model}/infer", body, headers, timeout_s))
    flood.notes["wire_mb"] = round(len(body) / MB, 2)
    return flood


# -- finding 4: amplification -------------------------------------------------------------

def json_empty_objects(http: str, model: str = DEMO, mb: int = 20,
                       timeout_s: float = 30.0) -> Flood:
    """One infer body ``{"inputs": [{}, {}, ...]}`` of ``mb`` MiB: three bytes an element,
    each a dict (and then a parsed input) on the server."""
    count = mb * MB // 3
    body = b'{"inputs": [' + b"{}," * (count - 1) + b"{}]}"
    flood = Flood("json_objects")
    began = time.monotonic()
    flood.count(post(http, f"/v2/models/{model}/infer", body,
                     {"Content-Type": "application/json"}, timeout_s)[0])
    flood.seconds = time.monotonic() - began
    flood.notes["elements"] = count
    return flood


def json_huge_data(http: str, model: str = DEMO, mb: int = 20,
                   timeout_s: float = 30.0) -> Flood:
    """One infer body whose ``data`` list is ``mb`` MiB of ``0.5,`` (a float object each on
    the server), the shape claiming the demo's one image."""
    count = mb * MB // 4
    head = json.dumps({"inputs": [{"name": DEMO_INPUT, "shape": list(DEMO_SHAPE),
                                   "datatype": "FP32", "data": [0]}]}).encode()
    body = head.replace(b"[0]", b"[" + b"0.5," * (count - 1) + b"0.5]")
    flood = Flood("json_data")
    began = time.monotonic()
    flood.count(post(http, f"/v2/models/{model}/infer", body,
                     {"Content-Type": "application/json"}, timeout_s)[0])
    flood.seconds = time.monotonic() - began
    flood.notes["elements"] = count
    return flood




def grpc_empty_inputs_message(model: str, mb: int) -> bytes:
    """A ModelInferRequest (model_name = 1) with ``mb`` MiB of empty ``inputs`` entries
    (field 5, two bytes each: key 0x2a, length 0)."""
    return wire.field(1, model.encode()) + b"\x2a\x00" * (mb * MB // 2)


def grpc_unknown_fields_message(model: str, mb: int) -> bytes:
    """A ModelInferRequest with ``mb`` MiB of unknown varint fields (number 100, value 0:
    three bytes each) after its model name."""
    return wire.field(1, model.encode()) + (wire.varint(100 << 3) + b"\x00") * (mb * MB // 3)


def _grpc_raw(grpc: str, message: bytes, timeout_s: float) -> str:
    """``message`` sent as a ModelInfer through a plain channel: the status code's name."""
    import grpc as grpcio

    host_port(grpc)
    with grpcio.insecure_channel(grpc, options=[
            ("grpc.max_send_message_length", -1),
            ("grpc.max_receive_message_length", -1)]) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                   request_serializer=None, response_deserializer=None)
        try:
            call(message, timeout=timeout_s)
        except grpcio.RpcError as error:
            return str(error.code().name)
        return "OK"


def grpc_empty_inputs(grpc: str, model: str = DEMO, mb: int = 6, count: int = 1,
                      timeout_s: float = 30.0) -> Flood:
    """``count`` ModelInfer calls each with ``mb`` MiB of empty inputs (millions of them)."""
    message = grpc_empty_inputs_message(model, mb)
    flood = _parallel("grpc_inputs", count, lambda _: (_grpc_raw(grpc, message, timeout_s),
                                                       b""))
    flood.notes["entries"] = mb * MB // 2
    return flood


def grpc_unknown_fields(grpc: str, model: str = DEMO, mb: int = 8, count: int = 1,
                        timeout_s: float = 30.0) -> Flood:
    """``count`` ModelInfer calls each with ``mb`` MiB of unknown varint fields."""
    message = grpc_unknown_fields_message(model, mb)
    flood = _parallel("grpc_unknown", count, lambda _: (_grpc_raw(grpc, message, timeout_s),
                                                        b""))
    flood.notes["fields"] = mb * MB // 3
    return flood


def binary_tensor_body(mb: int) -> tuple[bytes, dict[str, str]]:
    """A binary-extension infer body of about ``mb`` MiB for the demo (a batch of as many
    zero images as fit) and its headers."""
    batch = max(1, mb * MB // (int(np.prod(DEMO_SHAPE)) * 4))
    return binary_infer(DEMO_INPUT, np.zeros((batch, *DEMO_SHAPE[1:]), np.float32))


def parallel_binary(http: str, model: str = DEMO, count: int = 8, mb: int = 60,
                    timeout_s: float = 60.0) -> Flood:
    """``count`` binary-tensor bodies of ``mb`` MiB at once (each under the 64 MB limit)."""
    body, headers = binary_tensor_body(mb)
    return _parallel("binary", count, lambda _: post(
        http, f"/v2/models/{model}/infer", body, headers, timeout_s))


# -- finding 2: one valid slow request ----------------------------------------------------

def dynamic_hw_cnn(path: Path, channels: int = 24) -> Path:
    """``image`` [N,3,H,W] float32 with N, H and W dynamic -> ``features`` [N,channels]: three
    3x3 Conv+Relu at full resolution, then a global average pool.  Milliseconds at 64x64; at
    2000x2000 tens of GFLOP and a gigabyte of activations: a valid request that is slow."""
    import onnx
    from onnx import TensorProto, helper

    from agent.inference.demo_model import HeWeights, finish_model

    weight = HeWeights(2)
    nodes: list[onnx.NodeProto] = []
    x, c_in = "image", 3
    for index in range(3):
        w = weight(f"c{index}.w", (channels, c_in, 3, 3), c_in * 9)
        nodes += [helper.make_node("Conv", [x, w], [f"c{index}.conv"], kernel_shape=[3, 3],
                                   pads=[1, 1, 1, 1]),
                  helper.make_node("Relu", [f"c{index}.conv"], [f"c{index}"])]
        x, c_in = f"c{index}", channels
    nodes += [helper.make_node("GlobalAveragePool", [x], ["gap"]),
              helper.make_node("Flatten", ["gap"], ["features"])]
    graph = helper.make_graph(
        nodes, "dynamic_hw_cnn",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 3, "H", "W"])],
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["N", channels])],
        weight.initializers)
    path.write_bytes(finish_model(graph).SerializeToString())
    return path


def repository(directory: Path) -> Path:
    """What the floods need beside the bundled demo: DYNAMIC (a model with dynamic H and W,
    finding 2) and QUEUED, the same model with two priority levels, one single-threaded
    instance and a queue of 8 (finding 6)."""
    import yaml

    for name in (DYNAMIC, QUEUED):
        (directory / name / "1").mkdir(parents=True)
        dynamic_hw_cnn(directory / name / "1" / "model.onnx")
    (directory / QUEUED / "config.yaml").write_text(yaml.safe_dump({
        "max_batch_size": 1, "instances": [{"count": 1, "threads": 1}],
        "dynamic_batching": {"priority_levels": 2, "default_priority_level": 2,
                             "queue": {"max_size": 8}}}))
    return directory


def slow_request(http: str, model: str = DYNAMIC, side: int = 2000, count: int = 1,
                 timeout_s: float = 60.0) -> Flood:
    """``count`` binary infer requests of one [1,3,side,side] image to a dynamic-H/W model
    (46 MB at 2000): valid, and as slow as the model makes it."""
    body, headers = binary_infer("image", np.full((1, 3, side, side), 0.5, np.float32))
    flood = _parallel("slow_run", count, lambda _: post(
        http, f"/v2/models/{model}/infer", body, headers, timeout_s))
    flood.notes["request_mb"] = round(len(body) / MB, 1)
    return flood


# -- finding 5: sockets -------------------------------------------------------------------

def _connect(address: str, count: int, timeout_s: float) -> list[socket.socket]:
    opened = []
    for _ in range(count):
        try:
            opened.append(socket.create_connection(host_port(address), timeout=timeout_s))
        except OSError:
            break  # the server's backlog is full: what is open is held
    return opened


def idle_connections(address: str, count: int = 1100, hold_s: float = 5.0,
                     opened: threading.Event | None = None) -> Flood:
    """``count`` TCP connections opened and held silent for ``hold_s``, then closed;
    ``opened`` is set once they are."""
    flood = Flood("idle")
    began = time.monotonic()
    held = _connect(address, count, 2.0)
    flood.notes["opened"] = len(held)
    if opened is not None:
        opened.set()
    try:
        time.sleep(hold_s)  # the attack is the holding itself
        closed = 0
        for sock in held:  # a connection the server closed reads as end of stream
            sock.setblocking(False)
            try:
                closed += sock.recv(1) == b""
            except BlockingIOError:
                pass
            except OSError:
                closed += 1
        flood.notes["closed_by_server"] = closed
    finally:
        for sock in held:
            sock.close()
    flood.seconds = time.monotonic() - began
    return flood


def slowloris(address: str, count: int = 1010, seconds: float = 5.0,
              opened: threading.Event | None = None) -> Flood:
    """``count`` connections, each sending one byte of a request head every second for
    ``seconds``; counts how many the server closed on its own before the end.  ``opened``
    is set once the connections are."""
    flood = Flood("slowloris")
    began = time.monotonic()
    held = _connect(address, count, 2.0)
    flood.notes["opened"] = len(held)
    if opened is not None:
        opened.set()
    head = b"POST /v2/models/demo/infer HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 4096
    alive = list(held)
    try:
        for position in range(int(seconds)):
            for sock in list(alive):
                try:
                    sock.sendall(head[position:position + 1])
                except OSError:
                    alive.remove(sock)
            time.sleep(1.0)  # one byte a second is the attack
    finally:
        for sock in held:
            sock.close()
    flood.notes["closed_by_server"] = len(held) - len(alive)
    flood.seconds = time.monotonic() - began
    return flood


def fresh_clients_get_in(addresses: dict[str, Any],
                         attack: Callable[[threading.Event], Flood]) -> tuple[Flood, list[str]]:
    """``attack(opened)`` on a thread; once it has set ``opened`` (its connections are
    held), a new HTTP client, a new gRPC channel and a new metrics client (where the server
    has one) each try to get an answer within 2 s.  The flood, and the front ends that shut
    them out."""
    import grpc as grpcio

    result: list[Flood] = []
    opened = threading.Event()
    thread = threading.Thread(target=lambda: result.append(attack(opened)))
    thread.start()
    if not opened.wait(60):
        thread.join(60)
        raise AssertionError(f"the attack did not open its connections: {result}")
    refused = []
    for name, path in (("http", "/v2/health/ready"), ("metrics", "/metrics")):
        if addresses.get(name) and get(addresses[name], path, 2.0)[0] != "200":
            refused.append(name)
    with grpcio.insecure_channel(addresses["grpc"]) as channel:
        try:
            grpcio.channel_ready_future(channel).result(timeout=2.0)
        except grpcio.FutureTimeoutError:
            refused.append("grpc")
    thread.join(60)
    result[0].notes["shut_out"] = refused
    return result[0], refused


# -- finding 6: priorities ----------------------------------------------------------------

def priority_starvation(http: str, model: str = QUEUED, input_name: str = "image",
                        input_shape: tuple[int, ...] = QUEUED_SHAPE, low_clients: int = 40,
                        high_requests: int = 12, low_level: int = 2,
                        seconds: float = 4.0, token: str | None = None) -> Flood:
    """``low_clients`` threads send at ``low_level`` back to back (keeping the model's queue
    full) while ``high_requests`` at level 1 are sent one after another once the queue has
    refused a low one, with ``token`` (level 1 is privileged: serve.privileged_priority);
    ``answers`` counts the high ones' statuses, ``notes`` the low ones'.  Ends after at most
    ``seconds`` plus the high requests' own time."""
    x = np.zeros(input_shape, np.float32)
    low, headers = binary_infer(input_name, x, {"priority": low_level})
    high, _ = binary_infer(input_name, x, {"priority": 1})
    path = f"/v2/models/{model}/infer"
    stop = threading.Event()
    low_answers: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()

    def flood_low() -> None:
        host, port = host_port(http)
        connection = HTTPConnection(host, port, timeout=10)
        while not stop.is_set():
            try:
                connection.request("POST", path, body=low, headers=headers)
                response = connection.getresponse()
                response.read()
                answer = str(response.status)
            except (OSError, HTTPException):
                connection.close()
                connection = HTTPConnection(host, port, timeout=10)
                answer = "reset"
            with lock:
                low_answers[answer] += 1
        connection.close()

    flood = Flood("priority")
    began = time.monotonic()
    threads = [threading.Thread(target=flood_low, daemon=True) for _ in range(low_clients)]
    for thread in threads:
        thread.start()
    try:
        # the queue fills once the low clients have each sent (their first 503s say so)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not low_answers.get("503"):
            time.sleep(0.01)
        trusted = {**headers, "Authorization": f"Bearer {token}"} if token else headers
        for _ in range(high_requests):
            flood.count(post(http, path, high, trusted, 10.0)[0])
    finally:
        stop.set()
        for thread in threads:
            thread.join(15)
    flood.notes["low"] = dict(low_answers)
    flood.seconds = time.monotonic() - began
    return flood


# -- finding 8: inputs that must be refused with a 400 ------------------------------------

@dataclass(frozen=True)
class Answer:
    """One odd request's answer: status (HTTP) or code name (gRPC), and the message."""

    status: str
    message: str


def _demo_json(value_text: str) -> bytes:
    """A demo infer body whose data is ``value_text`` repeated for every element."""
    count = int(np.prod(DEMO_SHAPE))
    return (b'{"inputs": [{"name": "image", "shape": [1, 3, 64, 64], "datatype": "FP32", '
            b'"data": [' + b",".join([value_text.encode()] * count) + b"]}]}")


def _demo_ok_json(parameters: dict[str, Any] | None = None) -> bytes:
    document: dict[str, Any] = {"inputs": [{"name": DEMO_INPUT, "shape": list(DEMO_SHAPE),
                                            "datatype": "FP32",
                                            "data": [0.0] * int(np.prod(DEMO_SHAPE))}]}
    if parameters:
        document["parameters"] = parameters
    return json.dumps(document).encode()


def _http_answer(result: tuple[str, bytes]) -> Answer:
    status, body = result
    try:
        message = str(json.loads(body).get("error", "")) if body else ""
    except ValueError:
        message = body[:300].decode("utf-8", "replace")
    return Answer(status, message)


def odd_input(case: str, http: str, grpc: str, token: str, timeout_s: float = 20.0) -> Answer:
    """One of ODD_INPUTS sent to the demo model (``token``: the server's, for the one case
    that needs it: a token holder's load of a name with a newline)."""
    headers = {"Content-Type": "application/json"}
    if case == "version_5000_digits":
        return _http_answer(post(http, f"/v2/models/{DEMO}/versions/{'9' * 5000}/infer",
                                 _demo_ok_json(), headers, timeout_s))
    if case == "version_01":
        return _http_answer(post(http, f"/v2/models/{DEMO}/versions/01/infer",
                                 _demo_ok_json(), headers, timeout_s))
    if case == "shape_2e62_binary":
        head = json.dumps({"inputs": [{"name": DEMO_INPUT, "shape": [2**62, 0],
                                       "datatype": "FP32",
                                       "parameters": {"binary_data_size": 0}}]}).encode()
        return _http_answer(post(http, f"/v2/models/{DEMO}/infer", head, {
            "Inference-Header-Content-Length": str(len(head))}, timeout_s))
    if case == "shape_2e62_grpc_raw":
        from agent.serving import proto

        message = proto.ModelInferRequest(model_name=DEMO)
        message.inputs.add(name=DEMO_INPUT, datatype="FP32", shape=[2**62, 0])
        message.raw_input_contents.append(b"")
        return Answer(_grpc_raw(grpc, message.SerializeToString(), timeout_s), "")
    if case == "timeout_9e15":
        return _http_answer(post(http, f"/v2/models/{DEMO}/infer",
                                 _demo_ok_json({"timeout": 9_300_000_000_000_000}),
                                 headers, timeout_s))
    if case == "json_1e999":
        return _http_answer(post(http, f"/v2/models/{DEMO}/infer", _demo_json("1e999"),
                                 headers, timeout_s))
    if case == "name_trailing_newline":
        return _http_answer(post(http, f"/v2/repository/models/{DEMO}%0A/load", b"{}",
                                 {**headers, "Authorization": f"Bearer {token}"}, timeout_s))
    if case == "unauthorized_load":
        return _http_answer(post(http, f"/v2/repository/models/{DEMO}/load", b"{}",
                                 headers, timeout_s))
    raise ValueError(f"unknown case {case!r}")


ODD_INPUTS = ("version_5000_digits", "version_01", "shape_2e62_binary", "shape_2e62_grpc_raw",
              "timeout_9e15", "json_1e999", "name_trailing_newline", "unauthorized_load")


# -- the legit client and the server's memory ---------------------------------------------

@dataclass(frozen=True)
class Call:
    """One legit call: when it started (monotonic), how long it took, the answer's code
    (``OK`` or the error's) and whether the output matched the local reference."""

    started: float
    seconds: float
    code: str
    matched: bool


_B = TypeVar("_B", bound="Background")


class Background:
    """A thread that runs ``_run`` while the ``with`` block does; ``_stop`` ends it, and
    leaving the block waits ``join_s`` at most for it."""

    def __init__(self, name: str, join_s: float = 5.0) -> None:
        self._join_s = join_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def __enter__(self: _B) -> _B:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(self._join_s)

    def _run(self) -> None:
        raise NotImplementedError


class LegitClient(Background):
    """Triton's own clients calling the demo model every ``interval_s`` on a thread of
    their own, gRPC and HTTP in turn (a flood may stall one front end and not the other),
    each answer compared with a local ONNX Runtime session of the same file."""

    def __init__(self, grpc: str, http: str, interval_s: float = 0.2, timeout_s: float = 5.0,
                 model_path: Path = DEMO_MODEL_PATH) -> None:
        import onnxruntime as ort

        host_port(grpc), host_port(http)
        self.grpc, self.http = grpc, http
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.x = np.random.default_rng(30).random(DEMO_SHAPE, dtype=np.float32)
        session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
        self.reference = session.run([DEMO_OUTPUT], {DEMO_INPUT: self.x})[0]
        self.calls: list[Call] = []
        super().__init__("legit-client", timeout_s + 5)

    def _callers(self) -> list[tuple[str, Callable[[], Any]]]:
        """One call per front end, each returning the output array."""
        import tritonclient.grpc as grpcclient
        import tritonclient.http as httpclient

        over_grpc = grpcclient.InferenceServerClient(self.grpc)
        grpc_input = grpcclient.InferInput(DEMO_INPUT, list(DEMO_SHAPE), "FP32")
        grpc_input.set_data_from_numpy(self.x)
        over_http = httpclient.InferenceServerClient(
            self.http, connection_timeout=self.timeout_s, network_timeout=self.timeout_s)
        http_input = httpclient.InferInput(DEMO_INPUT, list(DEMO_SHAPE), "FP32")
        http_input.set_data_from_numpy(self.x, binary_data=True)
        return [("grpc", lambda: over_grpc.infer(DEMO, [grpc_input], client_timeout=self.timeout_s
                                                 ).as_numpy(DEMO_OUTPUT)),
                ("http", lambda: over_http.infer(DEMO, [http_input]).as_numpy(DEMO_OUTPUT))]

    def _run(self) -> None:
        from tritonclient.utils import InferenceServerException

        callers = self._callers()
        turn = 0
        while not self._stop.is_set():
            front, call = callers[turn % len(callers)]
            turn += 1
            began = time.monotonic()
            try:
                output = call()
                code = "OK"
                matched = output is not None and bool(np.allclose(
                    output, self.reference, rtol=1e-4, atol=1e-6))
            except InferenceServerException as error:
                code, matched = f"{front}:{error.status() or 'error'}", False
            except Exception as error:  # a socket the server dropped: a failed call
                code, matched = f"{front}:{type(error).__name__}", False
            took = time.monotonic() - began
            self.calls.append(Call(began, took, code, matched))
            self._stop.wait(max(0.0, self.interval_s - took))

    WARM = 2  # the first call on each front end opens its connection

    def summary(self) -> dict[str, float]:
        """count, success (answered OK and matched, as a fraction), p99_ms and max_ms, the
        warming calls left out."""
        calls = self.calls[self.WARM:]
        if not calls:
            return {"count": 0, "success": 0.0, "p99_ms": float("nan"),
                    "max_ms": float("nan")}
        good = sum(call.code == "OK" and call.matched for call in calls)
        latencies = [call.seconds * 1000 for call in calls]
        return {"count": len(calls), "success": good / len(calls),
                "p99_ms": float(np.percentile(latencies, 99)), "max_ms": max(latencies)}

    def failures(self, within_s: float = 1.0) -> list[Call]:
        """The calls (but the warming ones) that failed, mismatched or took over
        ``within_s``."""
        calls = self.calls[self.WARM:]
        return [c for c in calls if c.code != "OK" or not c.matched or c.seconds > within_s]


def vm_kb(pid: int, key: str) -> int:
    """A /proc/<pid>/status figure in kB (VmRSS, VmHWM); 0 once the process is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1])
    return 0


class PeakRss(Background):
    """The highest VmRSS of ``pid`` seen while the block runs, sampled every ``step_s``."""

    def __init__(self, pid: int, step_s: float = 0.02) -> None:
        self.pid, self.step_s = pid, step_s
        self.start_mb = vm_kb(pid, "VmRSS") / 1024
        self.peak_mb = self.start_mb
        super().__init__("rss")

    def _run(self) -> None:
        while not self._stop.wait(self.step_s):
            self.peak_mb = max(self.peak_mb, vm_kb(self.pid, "VmRSS") / 1024)

    @property
    def growth_mb(self) -> float:
        return self.peak_mb - self.start_mb
