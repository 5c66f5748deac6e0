"""The HTTP data plane against Triton's own client (tritonclient.http) and raw requests: every
route, both tensor encodings, the repository extension behind the token, and each refusal
with its status and the words that name what was wrong."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.http as triton
from http_helpers import HttpServer, exchange, status_of_raw, token_file
from serving_helpers import DemoModels
from tritonclient.utils import InferenceServerException

from agent.inference.demo_model import DEMO_MODEL_PATH
from agent.serving.access import Access
from agent.serving.core import InferRequest, InferResult
from agent.serving.errors import ServeError

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
LIMIT = 1 << 20


@pytest.fixture()
def demo() -> DemoModels:
    return DemoModels()


@pytest.fixture()
def server(demo: DemoModels, tmp_path: Path) -> Iterator[HttpServer]:
    running = HttpServer(demo, Access((token_file(tmp_path, TOKEN),), everything=False),
                         max_request_bytes=LIMIT)
    yield running
    running.stop()


def test_a_server_not_ready_answers_503(tmp_path: Path) -> None:
    """A registry that has not finished its start (its models not loaded and probed)."""
    from serving_helpers import cpu_factory

    from agent.serving.registry import ModelRegistry

    starting = ModelRegistry(tmp_path, {"demo": DEMO_MODEL_PATH}, cpu_factory)
    running = HttpServer(starting, Access((token_file(tmp_path, TOKEN),), everything=False),
                         max_request_bytes=LIMIT)
    try:
        assert running.request("GET", "/v2/health/ready").status == 503
        assert running.request("GET", "/v2/health/live").status == 200
        body, headers = binary_body(image(1))
        assert running.request("POST", "/v2/models/demo/infer", body, headers).status == 503
    finally:
        running.stop()


@pytest.fixture()
def client(server: HttpServer) -> Iterator[triton.InferenceServerClient]:
    connection = triton.InferenceServerClient(server.url, network_timeout=10.0)
    yield connection
    connection.close()


@pytest.fixture(scope="module")
def reference() -> ort.InferenceSession:
    return ort.InferenceSession(str(DEMO_MODEL_PATH), providers=["CPUExecutionProvider"])


def image(batch: int = 2, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random((batch, 3, 64, 64), dtype=np.float32)


def expected(reference: ort.InferenceSession, x: np.ndarray) -> np.ndarray:
    return np.asarray(reference.run(["probabilities"], {"image": x})[0])


def status_of(call: Any, *args: Any, **kwargs: Any) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as raised:
        call(*args, **kwargs)
    return raised.value.status(), raised.value.message()


def test_health_and_server_metadata(client: triton.InferenceServerClient,
                                    server: HttpServer) -> None:
    assert client.is_server_live() and client.is_server_ready()
    meta = client.get_server_metadata()
    assert meta["name"] == "edge-agent"
    assert {"binary_tensor_data", "model_repository", "statistics"} <= set(meta["extensions"])
    assert server.request("GET", "/v2/health/live").status == 200


def test_model_metadata_and_config(client: triton.InferenceServerClient) -> None:
    meta = {"name": "demo", "versions": ["1"], "platform": "onnxruntime_onnx",
            "inputs": [{"name": "image", "datatype": "FP32", "shape": [-1, 3, 64, 64]}],
            "outputs": [{"name": "probabilities", "datatype": "FP32", "shape": [-1, 10]}]}
    assert client.get_model_metadata("demo") == meta
    assert client.get_model_metadata("demo", "1") == meta
    assert client.is_model_ready("demo") and client.is_model_ready("demo", "1")
    config = client.get_model_config("demo")
    parameters = config.pop("parameters")
    assert parameters["providers"] == {"string_value": "CPUExecutionProvider"}
    assert parameters["precision"] == {"string_value": "fp32"}
    assert len(parameters["sha256.1"]["string_value"]) == 64
    assert config == {
        "name": "demo", "platform": "onnxruntime_onnx", "backend": "onnxruntime",
        "max_batch_size": 4,
        "input": [{"name": "image", "data_type": "TYPE_FP32", "dims": [3, 64, 64]}],
        "output": [{"name": "probabilities", "data_type": "TYPE_FP32", "dims": [10]}],
        "instance_group": [{"name": "demo_0", "kind": "KIND_CPU", "count": 1, "gpus": []}],
        "version_policy": {"latest": 1}}
    assert client.get_model_config("demo", "1")["name"] == "demo"


def test_infer_binary_both_ways(client: triton.InferenceServerClient,
                                reference: ort.InferenceSession) -> None:
    x = image()
    given = triton.InferInput("image", list(x.shape), "FP32")
    given.set_data_from_numpy(x)
    result = client.infer("demo", [given], request_id="req-7")
    response = result.get_response()
    assert response["id"] == "req-7"
    assert (response["model_name"], response["model_version"]) == ("demo", "1")
    out = response["outputs"][0]
    assert out["parameters"] == {"binary_data_size": 2 * 10 * 4} and "data" not in out
    np.testing.assert_allclose(result.as_numpy("probabilities"), expected(reference, x),
                               rtol=1e-6)


def test_infer_json_both_ways(client: triton.InferenceServerClient,
                              reference: ort.InferenceSession) -> None:
    x = image(1, seed=3)
    given = triton.InferInput("image", list(x.shape), "FP32")
    given.set_data_from_numpy(x, binary_data=False)
    wanted = triton.InferRequestedOutput("probabilities", binary_data=False)
    result = client.infer("demo", [given], outputs=[wanted], request_id="json-1")
    out = result.get_response()["outputs"][0]
    assert out["shape"] == [1, 10] and len(out["data"]) == 10 and "parameters" not in out
    assert result.get_response()["id"] == "json-1"
    np.testing.assert_allclose(result.as_numpy("probabilities"), expected(reference, x),
                               rtol=1e-6)


@pytest.mark.parametrize("binary_in,binary_out", [(True, False), (False, True)])
def test_infer_mixed_encodings(client: triton.InferenceServerClient,
                               reference: ort.InferenceSession, binary_in: bool,
                               binary_out: bool) -> None:
    x = image(1, seed=5)
    given = triton.InferInput("image", list(x.shape), "FP32")
    given.set_data_from_numpy(x, binary_data=binary_in)
    wanted = triton.InferRequestedOutput("probabilities", binary_data=binary_out)
    result = client.infer("demo", [given], outputs=[wanted])
    assert ("data" in result.get_response()["outputs"][0]) is not binary_out
    np.testing.assert_allclose(result.as_numpy("probabilities"), expected(reference, x),
                               rtol=1e-6)


def test_curl_style_json_request(server: HttpServer, reference: ort.InferenceSession) -> None:
    x = image(1, seed=9)
    body = json.dumps({"id": "curl", "inputs": [
        {"name": "image", "shape": [1, 3, 64, 64], "datatype": "FP32",
         "data": x.tolist()}]})  # nested rows, as a hand-written request has them
    reply = server.request("POST", "/v2/models/demo/infer", body,
                           {"Content-Type": "application/json"})
    assert reply.status == 200
    assert reply.headers["Content-Type"].startswith("application/json")
    assert "Inference-Header-Content-Length" not in reply.headers
    document = reply.json()
    assert document["id"] == "curl" and document["model_name"] == "demo"
    np.testing.assert_allclose(np.array(document["outputs"][0]["data"], np.float32),
                               expected(reference, x).reshape(-1), rtol=1e-6)


def binary_body(x: np.ndarray, size: int | None = None, **extra: Any) -> tuple[bytes, dict[str,
                                                                                          str]]:
    raw = x.astype("<f4").tobytes()
    head = json.dumps({"inputs": [{"name": "image", "shape": list(x.shape), "datatype": "FP32",
                                   "parameters": {"binary_data_size": size or len(raw)}}],
                       "parameters": {"binary_data_output": True}, **extra}).encode()
    return head + raw, {"Inference-Header-Content-Length": str(len(head)),
                        "Content-Type": "application/octet-stream"}


def test_raw_binary_request_and_response(server: HttpServer,
                                         reference: ort.InferenceSession) -> None:
    x = image(3, seed=11)
    body, headers = binary_body(x)
    reply = server.request("POST", "/v2/models/demo/versions/1/infer", body, headers)
    assert reply.status == 200
    assert reply.headers["Content-Type"] == "application/octet-stream"
    head = int(reply.headers["Inference-Header-Content-Length"])
    document = json.loads(reply.body[:head])
    assert document["outputs"][0]["parameters"]["binary_data_size"] == len(reply.body) - head
    got = np.frombuffer(reply.body[head:], "<f4").reshape(document["outputs"][0]["shape"])
    np.testing.assert_allclose(got, expected(reference, x), rtol=1e-6)


def test_repository_control_needs_the_token(client: triton.InferenceServerClient,
                                            server: HttpServer) -> None:
    assert client.get_model_repository_index() == [
        {"name": "demo", "version": "1", "state": "READY", "reason": ""}]
    status, message = status_of(client.unload_model, "demo")
    assert status == "401" and "bearer token" in message
    assert status_of(client.load_model, "demo", headers={"Authorization": "Bearer wrong"}
                     )[0] == "401"
    assert client.is_model_ready("demo")
    client.unload_model("demo", headers=AUTH)
    assert client.get_model_repository_index() == [
        {"name": "demo", "version": "", "state": "UNAVAILABLE", "reason": "unloaded"}]
    assert server.request("POST", "/v2/repository/index", '{"ready": true}').json() == []
    # the server stays ready: an unloaded model is not a fault (Triton's rule too)
    assert not client.is_model_ready("demo") and client.is_server_ready()
    assert server.request("GET", "/v2/health/ready").status == 200
    assert server.request("GET", "/v2/models/demo/ready").status == 400
    assert server.request("GET", "/v2/models/demo/versions/1/ready").status == 400
    body, headers = binary_body(image(1))
    reply = server.request("POST", "/v2/models/demo/infer", body, headers)
    assert reply.status == 503 and "not loaded" in reply.json()["error"]
    client.load_model("demo", headers=AUTH)
    assert client.is_model_ready("demo") and client.is_server_ready()


def test_statistics(client: triton.InferenceServerClient) -> None:
    given = triton.InferInput("image", [1, 3, 64, 64], "FP32")
    given.set_data_from_numpy(image(1))
    client.infer("demo", [given])
    client.infer("demo", [given])
    stats = client.get_inference_statistics()["model_stats"]
    assert [(s["name"], s["version"], s["inference_count"]) for s in stats] == [("demo", "1", 2)]
    assert client.get_inference_statistics("demo")["model_stats"] == stats
    assert client.get_inference_statistics("demo", "1")["model_stats"] == stats


@pytest.mark.parametrize("method,path", [
    ("GET", "/v2/models/nope"), ("GET", "/v2/models/demo/versions/9"),
    ("GET", "/v2/models/nope/ready"), ("GET", "/v2/models/demo/versions/9/ready"),
    ("GET", "/v2/models/nope/config"), ("GET", "/v2/models/demo/versions/9/config"),
    ("GET", "/v2/models/nope/stats"), ("POST", "/v2/models/nope/infer"),
    ("POST", "/v2/models/demo/versions/9/infer"), ("GET", "/v2/not/a/route"),
])
def test_unknown_model_version_or_route_is_404(server: HttpServer, method: str,
                                               path: str) -> None:
    body, headers = binary_body(image(1)) if method == "POST" else (None, {})
    reply = server.request(method, path, body, headers)
    assert reply.status == 404
    assert isinstance(reply.json()["error"], str)


def test_unknown_model_through_tritonclient(client: triton.InferenceServerClient) -> None:
    status, message = status_of(client.get_model_metadata, "nope")
    assert status == "404" and "nope" in message
    given = triton.InferInput("image", [1, 3, 64, 64], "FP32")
    given.set_data_from_numpy(image(1))
    assert status_of(client.infer, "demo", [given], model_version="7")[0] == "404"
    assert not client.is_model_ready("nope")


@pytest.mark.parametrize("name,shape,datatype,words", [
    ("picture", [1, 3, 64, 64], "FP32", "no input 'picture'"),
    ("image", [1, 3, 64, 64], "FP64", "datatype FP64"),
    ("image", [1, 3, 32, 32], "FP32", "shape [1, 3, 32, 32]"),
    ("image", [3, 64, 64], "FP32", "shape [3, 64, 64]"),
])
def test_wrong_input_is_400_naming_it(client: triton.InferenceServerClient, name: str,
                                      shape: list[int], datatype: str, words: str) -> None:
    given = triton.InferInput(name, shape, datatype)
    given.set_data_from_numpy(np.zeros(shape, np.float64 if datatype == "FP64" else
                                       np.float32))
    status, message = status_of(client.infer, "demo", [given])
    assert status == "400" and words in message and name in message


def test_byte_count_not_matching_shape_is_400(server: HttpServer) -> None:
    x = image(1)
    raw = x.tobytes()[:-4]
    head = json.dumps({"inputs": [{"name": "image", "shape": [1, 3, 64, 64], "datatype": "FP32",
                                   "parameters": {"binary_data_size": len(raw)}}]}).encode()
    reply = server.request("POST", "/v2/models/demo/infer", head + raw,
                           {"Inference-Header-Content-Length": str(len(head))})
    assert reply.status == 400
    assert reply.json()["error"] == ("input image: 49148 bytes, but shape [1, 3, 64, 64] of "
                                     "FP32 needs 49152")


@pytest.mark.parametrize("body,headers,words", [
    (b"{not json", {}, "not JSON"),
    (b"\xff\xfe", {}, "not UTF-8"),
    (b"[1, 2]", {}, "must be a JSON object"),
    (b'{"inputs": "x"}', {}, "inputs must be a non-empty list"),
    (b'{"inputs": [{"name": "image", "shape": "3", "datatype": "FP32", "data": []}]}', {},
     "input image: shape must be a list"),
    (b'{"inputs": [{"name": "image", "shape": [1], "datatype": "FP32"}]}', {},
     "input image: no data and no binary_data_size"),
    (b'{"id": 7, "inputs": []}', {}, "id must be a string"),
    (b'{"inputs": [{"name": "image", "shape": [2], "datatype": "FP32", "data": [1, 2]}],'
     b' "outputs": [{"name": "probabilities", "parameters": {"binary_data": "yes"}}]}', {},
     "binary_data must be true or false"),
    (b"{}", {"Inference-Header-Content-Length": "99"}, "beyond the body"),
    (b"{}", {"Inference-Header-Content-Length": "-1"}, "not a byte count"),
    (b"{}", {"Inference-Header-Content-Length": "two"}, "not a byte count"),
])
def test_malformed_requests_are_400(server: HttpServer, body: bytes, headers: dict[str, str],
                                    words: str) -> None:
    reply = server.request("POST", "/v2/models/demo/infer", body, headers)
    assert reply.status == 400
    assert words in reply.json()["error"]


def test_binary_sizes_must_add_up_to_the_body(server: HttpServer) -> None:
    x = image(1)
    body, headers = binary_body(x)
    reply = server.request("POST", "/v2/models/demo/infer", body + b"\0\0\0\0", headers)
    assert reply.status == 400
    assert reply.json()["error"] == ("binary_data_size of the inputs add up to 49152 bytes, "
                                     "but 49156 follow the JSON")
    body, headers = binary_body(x, size=1 << 40)
    assert server.request("POST", "/v2/models/demo/infer", body, headers).status == 400


def test_body_above_the_limit_is_413_before_it_is_sent(server: HttpServer) -> None:
    """Answered from its head, and the connection closed at once: a client that sends the
    whole body first may see the reset rather than the answer (no lingering read)."""
    answer, closed = exchange(server.host, server.port,
                              b"POST /v2/models/demo/infer HTTP/1.1\r\nHost: t\r\n"
                              b"Content-Length: %d\r\n\r\n" % (LIMIT + 1))
    status, headers, body = status_of_raw(answer)
    assert (status, headers["connection"], closed) == (413, "close", True)
    assert "limit of 1048576" in json.loads(body)["error"]
    assert server.request("GET", "/v2/health/live").status == 200


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_requests_are_refused_415(client: triton.InferenceServerClient,
                                             server: HttpServer, algorithm: str) -> None:
    """Triton's client compresses only when asked; the answer says to send it plain."""
    given = triton.InferInput("image", [1, 3, 64, 64], "FP32")
    given.set_data_from_numpy(image(1, seed=2))
    status, message = status_of(client.infer, "demo", [given],
                                request_compression_algorithm=algorithm)
    assert status == "415"
    assert message == (f"request body in Content-Encoding '{algorithm}': this server takes "
                       "bodies uncompressed only; send it again without Content-Encoding")
    reply = server.request("POST", "/v2/repository/index", b"{}",
                           {"Content-Encoding": algorithm})
    assert reply.status == 415
    assert server.request("POST", "/v2/repository/index", b"{}",
                          {"Content-Encoding": "identity"}).status == 200


def test_expect_continue_and_anything_else(server: HttpServer) -> None:
    body, headers = binary_body(image(1))
    reply = server.request("POST", "/v2/models/demo/infer", body,
                           {**headers, "Expect": "100-continue"})
    assert reply.status == 200
    # refused before the body is sent, and closed (a client that sends it anyway may see
    # the reset rather than the answer)
    answer, closed = exchange(server.host, server.port,
                              b"POST /v2/models/demo/infer HTTP/1.1\r\nHost: t\r\n"
                              b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % (LIMIT + 1))
    assert status_of_raw(answer)[0] == 413 and closed
    for route in ("/v2/models/demo/infer", "/v2/nothing"):  # aiohttp's own handler: a 500
        odd = server.request("POST", route, b"{}", {"Expect": b"\x80odd"})
        assert (odd.status, odd.json()) == (417, {
            "error": "only Expect: 100-continue is understood"})


def test_wrong_method_is_405_json(server: HttpServer) -> None:
    reply = server.request("GET", "/v2/models/demo/infer")
    assert reply.status == 405 and "error" in reply.json()


ROUTES = [("GET", "/v2/health/live"), ("GET", "/v2/health/ready"), ("GET", "/v2"),
          ("GET", "/v2/models/demo"), ("GET", "/v2/models/demo/versions/1"),
          ("GET", "/v2/models/demo/ready"), ("GET", "/v2/models/demo/config"),
          ("GET", "/v2/models/stats"), ("GET", "/v2/models/demo/stats"),
          ("POST", "/v2/models/demo/infer"), ("POST", "/v2/repository/index"),
          ("POST", "/v2/repository/models/demo/load"),
          ("POST", "/v2/repository/models/demo/unload"), ("GET", "/v2/nothing")]


def test_non_loopback_access_needs_the_token_everywhere(demo: DemoModels,
                                                        tmp_path: Path) -> None:
    server = HttpServer(demo, Access((token_file(tmp_path, TOKEN),), everything=True))
    try:
        body, headers = binary_body(image(1))
        for method, path in ROUTES:
            sent = body if path.endswith("/infer") else None
            reply = server.request(method, path, sent, headers if sent else {})
            assert (path, reply.status) == (path, 401)
            assert "bearer token" in reply.json()["error"]
            authorized = server.request(method, path, sent, {**(headers if sent else {}),
                                                             **AUTH})
            assert (path, authorized.status) == (path, 404 if "nothing" in path else 200)
        client = triton.InferenceServerClient(server.url)
        try:
            assert status_of(client.get_server_metadata)[0] == "401"
            assert client.get_server_metadata(headers=AUTH)["name"] == "edge-agent"
        finally:
            client.close()
    finally:
        server.stop()


class Broken(DemoModels):
    """A Models whose infer has a bug."""

    def infer(self, request: InferRequest) -> InferResult:
        raise RuntimeError("a bug")


def test_an_unexpected_exception_is_logged_and_500(tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    server = HttpServer(Broken(), Access((), everything=False))
    try:
        body, headers = binary_body(image(1))
        with caplog.at_level(logging.ERROR, "agent.serving.http_api"):
            reply = server.request("POST", "/v2/models/demo/infer", body, headers)
        assert (reply.status, reply.json()) == (500, {"error": "internal error"})
        assert any(r.exc_info and str(r.exc_info[1]) == "a bug" for r in caplog.records)
        assert server.request("GET", "/v2/health/live").status == 200
    finally:
        server.stop()


def test_a_rotated_or_removed_token_file_takes_effect_at_the_next_check(tmp_path: Path
                                                                        ) -> None:
    path = token_file(tmp_path, "first")
    access = Access((path,), everything=False)
    access.check("first", control=True)
    for _ in range(3):  # the cached token is still checked, not merely accepted
        with pytest.raises(ServeError, match="not the one"):
            access.check("second", control=True)
    path.write_text("second\n")  # rewritten in place, same size
    access.check("second", control=True)
    with pytest.raises(ServeError, match="not the one"):
        access.check("first", control=True)
    replacement = tmp_path / "new-token"
    replacement.write_text("third\n")
    replacement.chmod(0o600)
    replacement.replace(path)  # rotated by rename
    access.check("third", control=True)
    path.unlink()
    with pytest.raises(ServeError, match="not the one"):
        access.check("third", control=True)
