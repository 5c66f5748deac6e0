"""HttpClient, the agent's own client of the HTTP data plane, against the real server: every
method, the errors it turns answers and lost connections into, and the one reconnect."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from http_helpers import HttpServer, token_file
from serving_helpers import DemoModels

from agent.inference.demo_model import DEMO_MODEL_PATH
from agent.serving.access import Access
from agent.serving.core import IndexEntry, InferRequest, InferResult, ModelMetadata
from agent.serving.errors import ServeError
from agent.serving.http_client import HttpClient, decode_outputs, status_name

TOKEN = "client-token"


@pytest.fixture()
def demo() -> DemoModels:
    return DemoModels()


@pytest.fixture()
def server(demo: DemoModels, tmp_path: Path) -> Iterator[HttpServer]:
    running = HttpServer(demo, Access((token_file(tmp_path, TOKEN),), everything=False))
    yield running
    running.stop()


@pytest.fixture()
def client(server: HttpServer) -> Iterator[HttpClient]:
    with HttpClient(f"http://{server.url}", token=TOKEN) as connection:
        yield connection


def image(batch: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random((batch, 3, 64, 64), dtype=np.float32)


def raised(call: object, *args: object, **kwargs: object) -> ServeError:
    with pytest.raises(ServeError) as caught:
        call(*args, **kwargs)  # type: ignore[operator]
    return caught.value


def test_health_and_metadata(client: HttpClient, demo: DemoModels) -> None:
    assert client.live() and client.ready()
    assert client.server_metadata()["name"] == "edge-agent"
    meta = demo.model_metadata("demo", "")
    assert isinstance(meta, ModelMetadata) and meta.versions == ("1",)
    assert client.model_metadata("demo") == meta
    assert client.model_metadata("demo", "1") == meta
    assert client.model_ready("demo") and client.model_ready("demo", "1")


@pytest.mark.parametrize("binary", [True, False])
def test_infer_matches_onnxruntime(client: HttpClient, binary: bool) -> None:
    x = image(2, seed=4)
    want = ort.InferenceSession(str(DEMO_MODEL_PATH), providers=["CPUExecutionProvider"]
                                ).run(["probabilities"], {"image": x})[0]
    got = client.infer("demo", {"image": x}, binary=binary)
    assert list(got) == ["probabilities"] and got["probabilities"].dtype == np.float32
    np.testing.assert_allclose(got["probabilities"], want, rtol=1e-6)
    named = client.infer("demo", {"image": x}, version="1", outputs=["probabilities"],
                         binary=binary, parameters={"note": "x"})
    np.testing.assert_allclose(named["probabilities"], want, rtol=1e-6)


def test_statistics_index_load_unload(client: HttpClient, server: HttpServer) -> None:
    client.infer("demo", {"image": image(1)})
    stats = client.statistics()
    assert [(s["name"], s["inference_count"]) for s in stats] == [("demo", 1)]
    assert client.statistics("demo") == stats
    assert client.index() == [IndexEntry("demo", "1", "READY")]
    client.unload("demo")
    assert client.index() == [IndexEntry("demo", "", "UNAVAILABLE", "unloaded")]
    assert client.index(ready_only=True) == []
    # the server stays ready: an unloaded model is not a fault (Triton's rule too)
    assert not client.model_ready("demo") and client.ready()
    error = raised(client.infer, "demo", {"image": image(1)})
    assert error.code == "UNAVAILABLE" and "not loaded" in error.message
    client.load("demo", {"canary": json.dumps({"canary_s": 0.1})}, timeout_s=30.0)
    assert client.model_ready("demo")


def test_refusals_carry_their_status_name(client: HttpClient, server: HttpServer) -> None:
    assert raised(client.model_metadata, "nope").code == "NOT_FOUND"
    assert raised(client.model_ready, "nope").code == "NOT_FOUND"
    assert raised(client.statistics, "nope").code == "NOT_FOUND"
    error = raised(client.infer, "demo", {"image": np.zeros((1, 3, 8, 8), np.float32)})
    assert error.code == "INVALID_ARGUMENT" and "input image: shape [1, 3, 8, 8]" in error.message
    assert raised(client.infer, "demo", {"image": np.zeros(2, np.complex64)}).code == \
        "INVALID_ARGUMENT"
    with HttpClient(f"http://{server.url}") as anonymous:
        error = raised(anonymous.unload, "demo")
        assert error.code == "UNAUTHENTICATED" and "bearer token" in error.message
        assert raised(anonymous.load, "demo").code == "UNAUTHENTICATED"
    assert client.model_ready("demo")


class Broken(DemoModels):
    def infer(self, request: InferRequest) -> InferResult:
        raise RuntimeError("a bug")


def test_a_server_fault_is_internal() -> None:
    server = HttpServer(Broken(), Access((), everything=False))
    try:
        with HttpClient(f"http://{server.url}") as client:
            error = raised(client.infer, "demo", {"image": image(1)})
            assert (error.code, error.message) == ("INTERNAL", "internal error")
    finally:
        server.stop()


def test_a_stopped_server_is_unavailable(demo: DemoModels) -> None:
    server = HttpServer(demo, Access((), everything=False))
    client = HttpClient(f"http://{server.url}")
    assert client.live()
    server.stop()
    error = raised(client.live)
    assert error.code == "UNAVAILABLE" and server.url in error.message


class OneShotServer:
    """Raw HTTP on a loopback socket: answers each connection's first request, then closes
    it (``answer``) or never answers at all (a hung server)."""

    def __init__(self, answer: bool) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.answer = answer
        self.connections = 0
        self.stopping = False
        self.held: list[socket.socket] = []
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            if self.stopping:
                connection.close()
                return
            self.connections += 1
            if not self.answer:
                self.held.append(connection)
                continue
            with connection:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += connection.recv(65536)
                connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n"
                                   b"Connection: keep-alive\r\n\r\n")

    def close(self) -> None:
        self.stopping = True
        socket.create_connection(("127.0.0.1", self.port)).close()  # wakes the accept
        self.thread.join(5)
        assert not self.thread.is_alive()
        self.listener.close()
        for connection in self.held:
            connection.close()


def test_a_dropped_keep_alive_connection_is_reopened_once() -> None:
    server = OneShotServer(answer=True)
    try:
        with HttpClient(f"http://127.0.0.1:{server.port}") as client:
            assert client.live()
            assert client.live()  # the first connection is gone: a second one answers
            assert server.connections == 2
    finally:
        server.close()


def test_a_server_that_never_answers_is_a_deadline() -> None:
    server = OneShotServer(answer=False)
    try:
        with HttpClient(f"http://127.0.0.1:{server.port}", timeout_s=0.2) as client:
            error = raised(client.live)
            assert error.code == "DEADLINE_EXCEEDED" and "0.2 s" in error.message
    finally:
        server.close()


def test_status_names_and_malformed_answers() -> None:
    assert [status_name(s) for s in (400, 401, 404, 413, 500, 503, 504, 502, 418, 599)] == [
        "INVALID_ARGUMENT", "UNAUTHENTICATED", "NOT_FOUND", "RESOURCE_EXHAUSTED", "INTERNAL",
        "UNAVAILABLE", "DEADLINE_EXCEEDED", "UNAVAILABLE", "INVALID_ARGUMENT", "INTERNAL"]
    head = b'{"outputs": [{"name": "y", "datatype": "FP32", "shape": [2], ' \
           b'"parameters": {"binary_data_size": 8}}]}'
    body = head + np.array([1.5, -2.0], "<f4").tobytes()
    np.testing.assert_array_equal(decode_outputs(body, str(len(head)))["y"], [1.5, -2.0])
    for broken, length in ((body, str(len(body) + 1)), (body[:-1], str(len(head))),
                           (b'{"outputs": [{"name": "y"}]}', None), (b"[", None)):
        assert raised(decode_outputs, broken, length).code == "INTERNAL"
    with pytest.raises(ValueError, match="not an http"):
        HttpClient("ftp://host")
