"""The gRPC front end against a hostile local client, through a real channel to the real
server: floods of fields refused before they cost memory or CPU, every request's bytes
admitted against the memory budget and given back, overflowing values refused naming the
field (never INTERNAL, on HTTP too where the decoding is shared), connections and calls
bounded, and shared memory attached only when the token's owner may open it."""

from __future__ import annotations

import concurrent.futures
import json
import os
import resource
import shutil
import socket
import stat
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
from http_helpers import HttpServer, token_file
from hypothesis import given, settings
from hypothesis import strategies as st
from serving_helpers import DemoModels, RecordingModels
from tritonclient.utils import InferenceServerException
from wire_helpers import field

from agent.inference.demo_model import DEMO_MODEL_PATH
from agent.serving import proto
from agent.serving.access import Access
from agent.serving.budget import MemoryBudget
from agent.serving.core import InferRequest, InferResult
from agent.serving.errors import ServeError
from agent.serving.grpc_api import ConnectionLimits, build_grpc_server
from agent.serving.grpc_codec import infer_request
from agent.serving.shm import DEFAULT_PREFIX, SharedMemoryRegions

TOKEN = "s3cret-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
MAX_REQUEST = 16 << 20
NO_REGIONS = SharedMemoryRegions(DEFAULT_PREFIX, max_bytes=0)  # nothing registers in it
INFER = "/inference.GRPCInferenceService/ModelInfer"
METADATA = "/inference.GRPCInferenceService/ModelMetadata"


@dataclass
class Plane:
    models: DemoModels
    budget: MemoryBudget
    target: str
    channel: grpc.Channel
    triton: Any  # tritonclient.grpc.InferenceServerClient

    def call(self, method: str, data: bytes, timeout: float = 30.0) -> bytes:
        """Bytes as sent, past any client-side serializer."""
        send = self.channel.unary_unary(method)
        return send(data, timeout=timeout)  # type: ignore[no-any-return]

    def refusal(self, method: str, data: bytes) -> tuple[grpc.StatusCode, str]:
        with pytest.raises(grpc.RpcError) as excinfo:
            self.call(method, data)
        error: Any = excinfo.value
        return error.code(), error.details()


@pytest.fixture
def demo() -> DemoModels:
    return DemoModels()


@pytest.fixture
def start(demo: DemoModels, tmp_path: Path) -> Iterator[Callable[..., Plane]]:
    started: list[tuple[Plane, Any, concurrent.futures.ThreadPoolExecutor]] = []
    access = Access((token_file(tmp_path, TOKEN),), everything=False)

    def run(models: Any = None, budget_bytes: int = 1 << 30,
            limits: ConnectionLimits | None = None) -> Plane:
        budget = MemoryBudget(budget_bytes)
        executor = concurrent.futures.ThreadPoolExecutor(4)
        server = build_grpc_server(models or demo, access, max_request_bytes=MAX_REQUEST,
                                   executor=executor, budget=budget,
                                   limits=limits or ConnectionLimits(),
                                   regions=SharedMemoryRegions(DEFAULT_PREFIX,
                                                               max_bytes=MAX_REQUEST))
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        target = f"127.0.0.1:{port}"
        plane = Plane(models or demo, budget, target, grpc.insecure_channel(target, options=[
            ("grpc.max_send_message_length", -1)]), triton.InferenceServerClient(target))
        started.append((plane, server, executor))
        return plane

    yield run
    for plane, server, executor in started:
        plane.triton.close()
        plane.channel.close()
        server.stop(None)
        executor.shutdown(wait=True)


@pytest.fixture
def plane(start: Callable[..., Plane]) -> Plane:
    return start()


def image(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random((1, 3, 64, 64), dtype=np.float32)




def cpu_and_peak() -> tuple[float, int]:
    """This process's CPU seconds (the server's threads are in it) and peak RSS in KiB."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime, usage.ru_maxrss


# --- floods --------------------------------------------------------------------------------


@pytest.mark.parametrize(("flood", "named"), [
    (field(5, b"") * 3_000_000, "inputs has more than 1024 entries"),  # 6 MB of empty inputs
    (b"\xa0\x06\x01" * 2_800_000, "more than 16 unknown fields"),  # 8 MB of unknown varints
    (field(7, b"") * 3_000_000, "raw_input_contents has more than 1024 entries"),
])
def test_a_flood_of_fields_is_refused_before_it_costs(plane: Plane, flood: bytes,
                                                      named: str) -> None:
    """Before: +1 GB for the empty inputs, 5.5 CPU-seconds for the unknown fields (on the
    thread that reads every connection).  Bounds are loose against a loaded machine: the
    refusal costs milliseconds, the flood cost seconds and a gigabyte."""
    data = field(1, b"demo") + flood
    cpu, peak = cpu_and_peak()
    code, details = plane.refusal(INFER, data)
    spent, peaked = cpu_and_peak()
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert named in details
    assert spent - cpu < 2.0
    assert peaked - peak < 200 << 10  # KiB
    assert plane.budget.in_use == 0


def test_a_message_the_deserializer_refuses_is_invalid_argument_not_internal(
        plane: Plane) -> None:
    for method, data in ((INFER, b"\x0a\x05de"), (INFER, b"\x2b\x2c"),
                         (METADATA, b"\x0a\x05de"), (METADATA, b"\x0a\x01\xff")):
        code, details = plane.refusal(method, data)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, details
        assert "not a valid" in details


def test_an_answer_naming_what_was_sent_still_reaches_the_client(plane: Plane) -> None:
    """A status message must fit gRPC's 16 KB of metadata: a 1 MB model name, or a refusal
    naming a thousand long input names, came back as a transport error (RESOURCE_EXHAUSTED,
    "Stream removed") instead of the refusal."""
    message = proto.ModelInferRequest(model_name="m" * 1_000_000)
    code, details = plane.refusal(INFER, message.SerializeToString())
    assert (code, details) == (grpc.StatusCode.INVALID_ARGUMENT,
                               "model_name is longer than 1024 bytes")
    message = proto.ModelInferRequest(model_name="demo")
    for index in range(1000):
        message.inputs.add(name=f"{index:04d}" + "x" * 1000, datatype="FP32",
                           shape=[1]).contents.fp32_contents.append(1.0)
    message.raw_input_contents.append(b"\0\0\0\0")
    code, details = plane.refusal(INFER, message.SerializeToString())
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("inputs 0000x") and details.endswith("...")


# --- the budget ----------------------------------------------------------------------------


def test_a_legit_request_is_admitted_given_back_and_bit_exact(plane: Plane) -> None:
    x = image(3)
    tensor = triton.InferInput("image", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    result = plane.triton.infer("demo", [tensor])
    want = plane.models.session.run(["probabilities"], {"image": x})[0]
    assert np.array_equal(result.as_numpy("probabilities"), want)
    assert plane.budget.peak >= x.nbytes  # the request was admitted ...
    assert plane.budget.in_use == 0  # ... and given back


def test_typed_contents_are_admitted_before_they_are_decoded(plane: Plane) -> None:
    x = image(4)
    message = proto.ModelInferRequest(model_name="demo")
    message.inputs.add(name="image", datatype="FP32",
                       shape=list(x.shape)).contents.fp32_contents.extend(x.reshape(-1))
    data = message.SerializeToString()
    reply = proto.ModelInferResponse.FromString(plane.call(INFER, data))
    got = np.frombuffer(reply.raw_output_contents[0], dtype="<f4").reshape(1, 10)
    assert np.array_equal(got, plane.models.session.run(["probabilities"], {"image": x})[0])
    # the message, protobuf's parse of it and the array decoded from it, all at once
    assert plane.budget.peak >= 2 * len(data) + x.nbytes
    assert plane.budget.in_use == 0


def test_a_request_beyond_the_budget_is_resource_exhausted(start: Callable[..., Plane]) -> None:
    plane = start(budget_bytes=16 << 10)
    tensor = triton.InferInput("image", [1, 3, 64, 64], "FP32")
    tensor.set_data_from_numpy(image())
    with pytest.raises(InferenceServerException) as excinfo:
        plane.triton.infer("demo", [tensor])
    assert str(excinfo.value.status()) == "StatusCode.RESOURCE_EXHAUSTED"
    assert "serve.max_inflight_mb" in excinfo.value.message()
    assert plane.budget.in_use == 0 and plane.budget.refused == 1


# --- values that overflowed ----------------------------------------------------------------


@pytest.mark.parametrize("shape", [[2**62, 0], [2**63 - 1, 2**63 - 1, 0], [0, 2**40, 2**40]])
@pytest.mark.parametrize("raw", [True, False])
def test_a_shape_spanning_too_much_is_invalid_argument(plane: Plane, shape: list[int],
                                                       raw: bool) -> None:
    """Before: numpy's reshape raised, and the call was INTERNAL."""
    message = proto.ModelInferRequest(model_name="demo")
    message.inputs.add(name="image", datatype="FP32", shape=shape)
    if raw:
        message.raw_input_contents.append(b"")
    code, details = plane.refusal(INFER, message.SerializeToString())
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "input image: shape" in details and "spans more than" in details
    assert plane.budget.in_use == 0


@pytest.mark.parametrize("version", ["1" * 5000, "01", "+1", " 1", "1 ", "\uff11", "1\n",
                                     "99999999999999999999"])
def test_a_version_not_in_canonical_decimal_is_not_found(plane: Plane, version: str) -> None:
    """A version is a decimal without leading zeros: "01" served version 1, 5,000 digits
    were INTERNAL (int()'s limit).  NOT_FOUND, as for "9": it names no version."""
    for call in (lambda: plane.triton.get_model_metadata("demo", version),
                 lambda: plane.triton.is_model_ready("demo", version)):
        with pytest.raises(InferenceServerException) as excinfo:
            call()
        assert str(excinfo.value.status()) == "StatusCode.NOT_FOUND"
        assert "has no version" in excinfo.value.message()
        assert len(excinfo.value.message()) < 300
    assert plane.triton.get_model_metadata("demo", "1").versions == ["1"]


def test_a_model_name_with_a_trailing_newline_is_no_model(plane: Plane) -> None:
    """Names match whole: ``$`` also matched before a final newline, so a directory
    "demo\\n" was a model of its own, listed and loadable."""
    version = plane.models.repository / "demo\n" / "1"
    version.mkdir(parents=True)
    shutil.copy(DEMO_MODEL_PATH, version / "model.onnx")
    assert [entry.name for entry in plane.triton.get_model_repository_index().models] == [
        "demo"]
    with pytest.raises(InferenceServerException) as excinfo:
        plane.triton.get_model_metadata("demo\n")
    assert str(excinfo.value.status()) == "StatusCode.NOT_FOUND"


def test_the_http_front_end_refuses_the_same_values(demo: DemoModels, tmp_path: Path) -> None:
    """HTTP decodes with the same tensors and registry: the binary path's huge shape is a
    400 naming the input, a version or name gone wrong a 404."""
    server = HttpServer(demo, Access((token_file(tmp_path, TOKEN),), everything=False))
    try:
        head = (b'{"inputs":[{"name":"image","datatype":"FP32","shape":[4611686018427387904,0],'
                b'"parameters":{"binary_data_size":0}}]}')
        reply = server.request("POST", "/v2/models/demo/infer", head,
                               {"Inference-Header-Content-Length": str(len(head))})
        assert reply.status == 400
        assert "input image: shape" in reply.json()["error"]
        for version in ("1" * 5000, "01", "%2B1", "%EF%BC%91"):
            assert server.request("GET", f"/v2/models/demo/versions/{version}").status == 404
        assert server.request("GET", "/v2/models/demo%0A").status == 404
        assert server.request("GET", "/v2/models/demo/versions/1").status == 200
    finally:
        server.stop()


# --- connections and calls -----------------------------------------------------------------


class BlockingModels(DemoModels):
    """Each infer waits for ``release``; ``waiting`` counts those waiting."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.waiting = 0
        self._lock = threading.Lock()

    def infer(self, request: InferRequest) -> InferResult:
        with self._lock:
            self.waiting += 1
        self.release.wait(30)
        return super().infer(request)


def wait_until(condition: Callable[[], bool], what: str, seconds: float = 15.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_calls_beyond_the_cap_are_resource_exhausted_at_once(
        start: Callable[..., Plane]) -> None:
    models = BlockingModels()
    plane = start(models, limits=ConnectionLimits(concurrent_rpcs=2))
    tensor = triton.InferInput("image", [1, 3, 64, 64], "FP32")
    tensor.set_data_from_numpy(image())
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        held = [pool.submit(plane.triton.infer, "demo", [tensor]) for _ in range(2)]
        wait_until(lambda: models.waiting == 2, "two calls in the model")
        try:
            with pytest.raises(InferenceServerException) as excinfo:
                plane.triton.infer("demo", [tensor], client_timeout=20)
            assert str(excinfo.value.status()) == "StatusCode.RESOURCE_EXHAUSTED"
        finally:
            models.release.set()
        assert all(future.result(30).as_numpy("probabilities").shape == (1, 10)
                   for future in held)
    assert plane.budget.in_use == 0


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closed it (EOF or reset) within the socket's timeout, reading
    past what it sends first (its HTTP/2 settings)."""
    try:
        while sock.recv(1 << 16):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


def test_connections_beyond_the_cap_are_closed_as_they_come(
        start: Callable[..., Plane]) -> None:
    plane = start(limits=ConnectionLimits(connections=2, handshake_timeout_ms=60_000))
    host, port = plane.target.split(":")
    socks = [socket.create_connection((host, int(port)), timeout=10) for _ in range(6)]
    try:
        closed = 0
        for sock in socks[2:]:
            closed += closed_by_server(sock)
        assert closed >= 3  # the cap, give or take one being accepted as another closes
    finally:
        for sock in socks:
            sock.close()


def test_a_slowloris_is_closed_and_new_clients_get_in(start: Callable[..., Plane]) -> None:
    """Connections that never send gRPC's preface are closed after the handshake timeout
    (before: 120 s, gRPC's default), so they cannot hold the server's places."""
    plane = start(limits=ConnectionLimits(connections=4, handshake_timeout_ms=500))
    host, port = plane.target.split(":")
    socks = [socket.create_connection((host, int(port)), timeout=10) for _ in range(4)]
    try:
        for sock in socks:
            sock.sendall(b"PRI * HTTP/2.0\r\n")  # half a preface, then nothing
        assert all(closed_by_server(sock) for sock in socks)
    finally:
        for sock in socks:
            sock.close()
    assert plane.triton.is_server_ready()


# --- shared memory -------------------------------------------------------------------------


@pytest.fixture
def shm_object() -> Iterator[tuple[str, int]]:
    """A shared memory object under the prefix; its key and descriptor."""
    name = f"{DEFAULT_PREFIX}test-{uuid.uuid4().hex}"
    fd = os.open(f"/dev/shm/{name}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, 64)
    try:
        yield f"/{name}", fd
    finally:
        os.close(fd)
        os.unlink(f"/dev/shm/{name}")


@pytest.mark.skipif(os.geteuid() != 0, reason="giving an object away needs root")
def test_only_memory_the_tokens_owner_may_open_is_attached(
        plane: Plane, shm_object: tuple[str, int], tmp_path: Path) -> None:
    """The token file (the test's, owned by root) names who holds the token: an object of
    another uid is refused unless shared read-write with the token file's group."""
    key, fd = shm_object
    token_group = (tmp_path / "token").stat().st_gid
    other = 54321

    def register() -> str:
        try:
            plane.triton.register_system_shared_memory("region", key, 64, headers=AUTH)
        except InferenceServerException as error:
            return str(error.status())
        plane.triton.unregister_system_shared_memory("region", headers=AUTH)
        return "OK"

    os.fchown(fd, other, other)
    assert register() == "StatusCode.PERMISSION_DENIED"
    os.fchmod(fd, 0o666)  # open to all, but not through the token's group: still refused
    assert register() == "StatusCode.PERMISSION_DENIED"
    os.fchown(fd, other, token_group)
    os.fchmod(fd, 0o640)  # the group may read but not write
    assert register() == "StatusCode.PERMISSION_DENIED"
    os.fchmod(fd, 0o660)
    assert register() == "OK"
    os.fchown(fd, os.geteuid(), other)
    os.fchmod(fd, 0o600)
    assert register() == "OK"
    assert stat.S_IMODE(os.fstat(fd).st_mode) == 0o600


@pytest.mark.skipif(os.geteuid() != 0, reason="giving an object away needs root")
def test_http_registers_by_the_tokens_owner_too(
        demo: DemoModels, shm_object: tuple[str, int], tmp_path: Path) -> None:
    """The HTTP front end names the token's owner as gRPC does: an object of the uid that
    owns the token file is attached, one of another uid is not."""
    key, fd = shm_object
    token = token_file(tmp_path, TOKEN)
    holder = 54321
    os.chown(token, holder, holder)
    server = HttpServer(demo, Access((token,), everything=False),
                        regions=SharedMemoryRegions(DEFAULT_PREFIX, max_bytes=MAX_REQUEST))
    headers = {"Authorization": f"Bearer {TOKEN}"}
    body = json.dumps({"key": key, "offset": 0, "byte_size": 64}).encode()
    path = "/v2/systemsharedmemory/region/region/register"
    try:
        assert server.request("POST", path, body, headers).status == 403  # root's object
        os.fchown(fd, holder, holder)  # the token holder's own
        assert server.request("POST", path, body, headers).status == 200
    finally:
        server.stop()


# --- the token's privileges ----------------------------------------------------------------


def test_a_request_is_trusted_only_with_the_token(start: Callable[..., Plane]) -> None:
    """The privileged priority levels go by ``InferRequest.trusted``: set by the token only
    (inference itself needs none on loopback, so a wrong token is merely untrusted)."""
    models = RecordingModels()
    plane = start(models)
    tensor = triton.InferInput("image", [1, 3, 64, 64], "FP32")
    tensor.set_data_from_numpy(image())
    for headers in (AUTH, None, {"authorization": "Bearer not-the-token"}):
        plane.triton.infer("demo", [tensor], headers=headers)
    assert [request.trusted for request in models.requests] == [True, False, False]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(-2**63, 2**63 - 1) | st.sampled_from([0, 1, 2**31, 2**62]),
                max_size=20),
       st.sampled_from(["FP32", "INT8", "BOOL", "FP16", "UINT64", "BYTES", ""]),
       st.binary(max_size=64), st.booleans())
def test_any_shape_and_datatype_decode_or_are_invalid_argument(
        shape: list[int], datatype: str, raw: bytes, typed: bool) -> None:
    message = proto.ModelInferRequest(model_name="demo")
    tensor = message.inputs.add(name="x", datatype=datatype, shape=shape)
    if typed:
        tensor.contents.int_contents.extend(raw)
    else:
        message.raw_input_contents.append(raw)
    budget = MemoryBudget(1 << 20)
    try:
        with budget.reserve(0, "test") as reservation:
            infer_request(message, regions=NO_REGIONS, reservation=reservation)
    except ServeError as error:
        assert error.code in ("INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"), error.message
    assert budget.in_use == 0


class CappedModels(RecordingModels):
    """Refuses every input as the serving version's size cap would, recording the shapes it
    was asked about: a decode that came first would have made the array already."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[tuple[str, list[int]]] = []

    def check_elements(self, model: str, version: str, name: str, shape: Any) -> None:
        self.asked.append((name, list(shape)))
        raise ServeError("INVALID_ARGUMENT", f"input {name}: above the cap")


def test_typed_inputs_meet_the_size_cap_before_they_are_decoded(
        start: Callable[..., Plane]) -> None:
    models = CappedModels()
    plane = start(models)
    x = image()
    message = proto.ModelInferRequest(model_name="demo")
    message.inputs.add(name="image", datatype="FP32",
                       shape=list(x.shape)).contents.fp32_contents.extend(x.reshape(-1))
    data = message.SerializeToString()
    assert plane.refusal(INFER, data) == (grpc.StatusCode.INVALID_ARGUMENT,
                                          "input image: above the cap")
    assert models.asked == [("image", [1, 3, 64, 64])]
    assert models.requests == []  # nothing reached infer
    # the array was never admitted, so never made: the same request where the cap lets it
    # through holds the array's bytes more at its peak
    served = start()
    served.call(INFER, data)
    assert served.budget.peak - plane.budget.peak >= x.nbytes


def test_http_json_inputs_meet_the_size_cap_before_they_are_decoded(tmp_path: Path) -> None:
    models = CappedModels()
    server = HttpServer(models, Access((token_file(tmp_path, TOKEN),), everything=False))
    try:
        body = json.dumps({"inputs": [{"name": "image", "datatype": "FP32",
                                       "shape": [1, 3, 64, 64], "data": [0.5] * 12288}]})
        reply = server.request("POST", "/v2/models/demo/infer", body.encode())
        assert (reply.status, reply.json()) == (400, {"error": "input image: above the cap"})
        assert models.asked == [("image", [1, 3, 64, 64])]
        assert models.requests == []
    finally:
        server.stop()
    # the JSON was admitted, the array it would become was not: where the cap lets the same
    # request through, its peak holds the array's bytes more
    served = HttpServer(RecordingModels(), Access((token_file(tmp_path, TOKEN),),
                                                  everything=False))
    try:
        assert served.request("POST", "/v2/models/demo/infer", body.encode()).status == 200
        assert served.budget.peak - server.budget.peak >= 12288 * 4
    finally:
        served.stop()
