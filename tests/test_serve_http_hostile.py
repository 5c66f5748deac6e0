"""The HTTP front end against a hostile local process (issue 30): gzip bombs, JSON floods and
parallel big bodies against the memory budget, slowloris and idle floods against the
connection cap and timeouts, numbers JSON has no business carrying.  Raw sockets to a real
aiohttp server on a free port, each refusal checked for its status, its words, the
connection it closes and the budget it gives back."""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from http_helpers import HttpServer, exchange, status_of_raw, token_file
from mqtt_helpers import wait_until
from serving_helpers import DemoModels, RecordingModels

from agent.serving.access import Access
from agent.serving.budget import MB, MemoryBudget
from agent.serving.http_listener import SWEEP_S, ConnectionLimits

TOKEN = "hostile-token"
INFER = b"POST /v2/models/demo/infer HTTP/1.1\r\nHost: t\r\n"


@pytest.fixture()
def serve(tmp_path: Path) -> Iterator[Callable[..., HttpServer]]:
    """Servers over the demo model with the given limits, stopped after the test."""
    started: list[HttpServer] = []

    def start(models: DemoModels | None = None, **options: Any) -> HttpServer:
        server = HttpServer(models or DemoModels(),
                            Access((token_file(tmp_path, TOKEN),), everything=False),
                            **options)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def peak_rss() -> int:
    """This process's peak RSS in bytes since the last ``reset_peak_rss``."""
    status = Path("/proc/self/status").read_text()
    return int(status.split("VmHWM:")[1].split()[0]) * 1024


def reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def gzip_bomb(inflated: int = 1 << 30) -> bytes:
    """A gzip body of about 1 MB that inflates to ``inflated`` zero bytes: one compressed
    16 MiB block, flushed so that it repeats byte for byte, then the CRC and size."""
    chunk = bytes(16 << 20)
    deflate = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = deflate.compress(chunk) + deflate.flush(zlib.Z_FULL_FLUSH)
    crc = 0
    for _ in range(inflated // len(chunk)):
        crc = zlib.crc32(chunk, crc)
    end = zlib.compressobj(9, zlib.DEFLATED, -15).flush()
    return (b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff" + block * (inflated // len(chunk))
            + end + struct.pack("<II", crc, inflated & 0xFFFFFFFF))


def attack(server: HttpServer, head: bytes, body: bytes) -> tuple[bytes, bool, float]:
    """What an eager client does: the head and the whole body sent at once (by a thread),
    while the answer is read; (the answer, whether the server closed, seconds taken)."""
    sock = socket.create_connection((server.host, server.port), timeout=10)

    def push() -> None:
        with contextlib.suppress(OSError):  # refused and closed: the rest is not wanted
            sock.sendall(head + body)

    sender = threading.Thread(target=push)
    started = time.monotonic()
    sender.start()
    received, closed = b"", False
    try:
        while chunk := sock.recv(65536):
            received += chunk
        closed = True
    except ConnectionResetError:
        closed = True
    except TimeoutError:
        pass
    took = time.monotonic() - started
    sock.close()
    sender.join(10)
    return received, closed, took


def json_request(values: list[Any] | str) -> bytes:
    data = values if isinstance(values, str) else json.dumps(values)
    return (b'{"inputs":[{"name":"image","shape":[1,3,64,64],"datatype":"FP32","data":'
            + data.encode() + b"}]}")


def binary_request(x: np.ndarray) -> tuple[bytes, dict[str, str]]:
    raw = x.astype("<f4").tobytes()
    head = json.dumps({"inputs": [{"name": "image", "shape": list(x.shape), "datatype": "FP32",
                                   "parameters": {"binary_data_size": len(raw)}}]}).encode()
    return head + raw, {"Inference-Header-Content-Length": str(len(head))}


def image() -> np.ndarray:
    return np.random.default_rng(7).random((1, 3, 64, 64), dtype=np.float32)


def released(server: HttpServer) -> bool:
    return wait_until(lambda: server.budget.in_use == 0, 5)


def test_a_gzip_bomb_is_refused_415_at_once_without_inflating(
        serve: Callable[..., HttpServer]) -> None:
    """Three at once, as found: each answered 415 before its body is read, its connection
    closed, nothing inflated (the peak RSS stays put), health answering throughout."""
    server = serve(max_request_bytes=64 * MB)
    bomb = gzip_bomb()
    head = INFER + b"Content-Encoding: gzip\r\nContent-Length: %d\r\n\r\n" % len(bomb)
    reset_peak_rss()
    before = peak_rss()
    answers: list[tuple[bytes, bool, float]] = []
    threads = [threading.Thread(target=lambda: answers.append(attack(server, head, bomb)))
               for _ in range(3)]
    for thread in threads:
        thread.start()
    health = server.request("GET", "/v2/health/live")
    for thread in threads:
        thread.join(30)
    assert health.status == 200
    assert len(answers) == 3
    for answer, closed, took in answers:
        status, headers, body = status_of_raw(answer)
        assert (status, headers["connection"], closed) == (415, "close", True)
        assert json.loads(body)["error"].startswith("request body in Content-Encoding 'gzip'")
        assert took < 3.0
    assert peak_rss() - before < 48 * MB
    assert released(server)


def test_a_json_flood_is_refused_503_before_it_is_parsed(
        serve: Callable[..., HttpServer]) -> None:
    """3 MB of ``{}`` would be 75 MB of dicts: refused on its estimate, with a budget of
    16 MB in which the legit JSON request (12,288 floats) and a binary one still fit."""
    server = serve(max_request_bytes=8 * MB, budget=MemoryBudget(16 * MB))
    flood = b'{"inputs":[' + b",".join([b"{}"] * (1 << 20)) + b"]}"
    reset_peak_rss()
    before = peak_rss()
    reply = server.request("POST", "/v2/models/demo/infer", flood)
    assert reply.status == 503
    message = reply.json()["error"]
    assert message.startswith("the inference request as JSON: ")
    assert "serve.max_inflight_mb 16 MB" in message
    assert peak_rss() - before < 64 * MB
    assert released(server)
    x = image()
    legit = server.request("POST", "/v2/models/demo/infer", json_request(x.tolist()))
    assert legit.status == 200
    expected = server.models.session.run(None, {"image": x})[0]  # type: ignore[attr-defined]
    np.testing.assert_allclose(np.array(legit.json()["outputs"][0]["data"], np.float32),
                               expected.reshape(-1), rtol=1e-6)
    body, headers = binary_request(x)
    assert server.request("POST", "/v2/models/demo/infer", body, headers).status == 200
    assert released(server) and 0 < server.budget.peak <= 16 * MB


def test_json_beyond_the_element_bound_is_400_before_it_is_parsed(
        serve: Callable[..., HttpServer]) -> None:
    """5M values would hold the GIL, and so every other client, for seconds."""
    server = serve(max_request_bytes=16 * MB)
    values = b",".join([b"0"] * 5_000_000)
    reply = server.request("POST", "/v2/models/demo/infer", json_request(values.decode()))
    assert reply.status == 400
    message = reply.json()["error"]
    assert message.startswith("the inference request holds up to 50000")
    assert message.endswith(" JSON values, at most 4194304; send large tensors with the "
                            "binary tensor extension")
    assert released(server)


def hold_body(server: HttpServer, length: int) -> socket.socket:
    """A connection whose request announced ``length`` bytes and sent only 64 KB of them."""
    sock = socket.create_connection((server.host, server.port), timeout=10)
    sock.sendall(INFER + b"Content-Length: %d\r\n\r\n" % length + bytes(64 << 10))
    return sock


def test_bodies_beyond_the_budget_are_refused_503_before_they_are_read(
        serve: Callable[..., HttpServer]) -> None:
    """Two 4 MB bodies on their way hold 8 of the 10 MB: a third is answered 503 from its
    head, and each reservation is given back when its client goes away mid-body."""
    server = serve(max_request_bytes=4 * MB, budget=MemoryBudget(10 * MB))
    first = hold_body(server, 4 * MB)
    assert wait_until(lambda: server.budget.in_use == 4 * MB, 5)
    second = hold_body(server, 4 * MB)
    assert wait_until(lambda: server.budget.in_use == 8 * MB, 5)
    answer, closed = exchange(server.host, server.port,
                              INFER + b"Content-Length: %d\r\n\r\n" % (4 * MB))
    status, headers, body = status_of_raw(answer)
    assert (status, headers["connection"], closed) == (503, "close", True)
    assert json.loads(body)["error"].startswith("the request body: 4194304 bytes do not fit")
    assert server.request("GET", "/v2/health/ready").status == 200
    first.close()
    second.close()
    assert released(server)
    body, headers = binary_request(image())
    assert server.request("POST", "/v2/models/demo/infer", body, headers).status == 200


@pytest.mark.parametrize("request_bytes,status,held", [
    (b"GOOD", 200, 3 * 64 * 64 * 4), (INFER + b"Content-Length: 9\r\n\r\n{not json", 400, 9),
    (INFER + b"Content-Length: %d\r\n\r\n" % (2 * MB), 413, 0),
    (INFER + b"Content-Encoding: br\r\nContent-Length: 4\r\n\r\nxxxx", 415, 0),
    (INFER + b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n", 400, 2),
])
def test_the_budget_is_given_back_after_every_answer(serve: Callable[..., HttpServer],
                                                     request_bytes: bytes, status: int,
                                                     held: int) -> None:
    """Held while the request was answered (at least its body: refusals from the head hold
    nothing), all of it given back once the answer is written."""
    server = serve(max_request_bytes=1 * MB)
    if request_bytes == b"GOOD":
        body, headers = binary_request(image())
        request_bytes = INFER + b"".join(f"{k}: {v}\r\n".encode() for k, v in headers.items()) \
            + b"Content-Length: %d\r\n\r\n" % len(body) + body
    answer, closed = exchange(server.host, server.port,
                              request_bytes.replace(b"HTTP/1.1\r\n",
                                                    b"HTTP/1.1\r\nConnection: close\r\n", 1))
    assert status_of_raw(answer)[0] == status and closed
    assert released(server)
    assert server.budget.peak >= held and (held or server.budget.peak == 0)


def test_a_body_beyond_the_budget_is_refused_before_100_continue(
        serve: Callable[..., HttpServer]) -> None:
    server = serve(max_request_bytes=4 * MB, budget=MemoryBudget(6 * MB))
    holder = hold_body(server, 4 * MB)
    assert wait_until(lambda: server.budget.in_use == 4 * MB, 5)
    answer, closed = exchange(server.host, server.port, INFER + b"Expect: 100-continue\r\n"
                              b"Content-Length: %d\r\n\r\n" % (3 * MB))
    status, headers, _ = status_of_raw(answer)
    assert (status, headers["connection"], closed) == (503, "close", True)
    holder.close()
    assert released(server)


def test_a_body_trickled_in_loses_its_connection_and_reservation(
        serve: Callable[..., HttpServer]) -> None:
    """A body may take header_timeout_s plus its size at 1 MB/s: 1 KB sent at 50 bytes a
    second is cut off after about a second, its reservation given back."""
    server = serve(limits=ConnectionLimits(header_timeout_s=1.0, idle_timeout_s=30.0))
    sock = socket.create_connection((server.host, server.port), timeout=10)
    sock.sendall(INFER + b"Content-Length: 1000\r\n\r\n")
    started = time.monotonic()
    lasted = None
    try:
        for _ in range(100):
            sock.sendall(b"x" * 10)
            time.sleep(0.2)  # the attack's pace, not a wait for the server
    except OSError:
        lasted = time.monotonic() - started
    finally:
        sock.close()
    assert lasted is not None and lasted < 1.0 + 1.5
    assert released(server)


def test_a_client_gone_mid_body_gives_its_reservation_back(
        serve: Callable[..., HttpServer]) -> None:
    server = serve(max_request_bytes=4 * MB)
    sock = hold_body(server, 3 * MB)
    assert wait_until(lambda: server.budget.in_use == 3 * MB, 5)
    sock.close()
    assert released(server)


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (EOF or reset), waiting at most its timeout."""
    try:
        return sock.recv(65536) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_a_slowloris_is_closed_within_the_header_timeout(
        serve: Callable[..., HttpServer]) -> None:
    """A head sent a byte every 0.1 s, as found at a byte a second, faster so the test is
    short: closed once its head has taken longer than header_timeout_s."""
    server = serve(limits=ConnectionLimits(header_timeout_s=1.0, idle_timeout_s=30.0))
    sock = socket.create_connection((server.host, server.port), timeout=10)
    started = time.monotonic()
    lasted = None
    try:
        for byte in (INFER + b"X-Slow: " + b"a" * 200):
            sock.sendall(bytes([byte]))
            time.sleep(0.1)  # the attack's pace, not a wait for the server
    except OSError:
        lasted = time.monotonic() - started
    finally:
        sock.close()
    assert lasted is not None and lasted < 1.0 + 2 * SWEEP_S + 1.0
    assert server.request("GET", "/v2/health/live").status == 200


def test_idle_connections_are_closed_within_the_idle_timeout(
        serve: Callable[..., HttpServer]) -> None:
    """Ones that never send a byte and one kept alive after its request."""
    server = serve(limits=ConnectionLimits(header_timeout_s=30.0, idle_timeout_s=1.0))
    idle = [socket.create_connection((server.host, server.port), timeout=5)
            for _ in range(50)]
    kept = socket.create_connection((server.host, server.port), timeout=5)
    kept.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\n\r\n")
    assert kept.recv(65536).startswith(b"HTTP/1.1 200")
    started = time.monotonic()
    assert all(closed_by_server(sock) for sock in [*idle, kept])
    assert time.monotonic() - started < 1.0 + 2 * SWEEP_S + 1.5
    for sock in [*idle, kept]:
        sock.close()
    assert wait_until(lambda: server.listener.open_connections == 0, 5)


def test_the_connection_cap_makes_room_from_idle_ones_and_refuses_when_all_are_busy(
        serve: Callable[..., HttpServer]) -> None:
    """A flood of idle connections never holds more than the cap, and a new client still
    gets health and metadata; with every connection in a request a new one is answered
    503 and closed; once the flood ends a new connection is served."""
    cap = 8
    server = serve(max_request_bytes=4 * MB,
                   limits=ConnectionLimits(max_connections=cap, header_timeout_s=30.0,
                                           idle_timeout_s=30.0))
    most = 0
    flood = []
    for _ in range(200):
        flood.append(socket.create_connection((server.host, server.port), timeout=5))
        most = max(most, server.listener.open_connections)
    assert server.request("GET", "/v2/health/ready").status == 200
    assert server.request("GET", "/v2/models/demo").json()["name"] == "demo"
    assert most <= cap and server.listener.open_connections <= cap
    assert closed_by_server(flood[0])  # the idle longest made room
    for sock in flood:
        sock.close()
    busy = [hold_body(server, 2 * MB) for _ in range(cap)]
    assert wait_until(lambda: server.budget.in_use == cap * 2 * MB, 5)
    answer, closed = exchange(server.host, server.port,
                              b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\n\r\n")
    status, headers, body = status_of_raw(answer)
    assert (status, headers["connection"], closed) == (503, "close", True)
    assert json.loads(body)["error"].startswith("too many connections: the HTTP front end "
                                                "holds its limit of 8")
    for sock in busy:
        sock.close()
    assert wait_until(lambda: server.listener.open_connections == 0, 5)
    assert server.request("GET", "/v2/health/live").status == 200
    assert released(server)


@pytest.mark.parametrize("token", ["1e999", "NaN", "-Infinity"])
def test_non_finite_json_numbers_are_refused_naming_the_input(
        serve: Callable[..., HttpServer], token: str) -> None:
    server = serve()
    values = json.dumps(np.zeros(3 * 64 * 64).tolist())
    reply = server.request("POST", "/v2/models/demo/infer",
                           json_request(values.replace("0.0", token, 1)))
    assert reply.status == 400
    assert reply.json()["error"] == (
        "input image: NaN, Infinity or a number beyond FP32 (such as 1e999) in its JSON "
        "data; send such values with the binary tensor extension")
    x = np.zeros((1, 3, 64, 64), np.float32)
    x[0, 0, 0, 0] = np.inf  # the binary extension carries any float
    body, headers = binary_request(x)
    assert server.request("POST", "/v2/models/demo/infer", body, headers).status == 200


@pytest.mark.parametrize("document,words", [
    ({"inputs": [{"name": f"i{n}", "shape": [1], "datatype": "FP32", "data": [0]}
                 for n in range(300)]}, "inputs: 300 given, at most 256"),
    ({"inputs": [{"name": "image", "shape": [1], "datatype": "FP32", "data": [0]}],
      "outputs": [{"name": "probabilities"}] * 300}, "outputs: 300 given, at most 256"),
    ({"inputs": [{"name": "image", "shape": [1], "datatype": "FP32", "data": [0]}],
      "parameters": {f"p{n}": n for n in range(100)}}, "parameters: 100 given, at most 64"),
])
def test_counts_are_bounded_naming_the_field(serve: Callable[..., HttpServer],
                                             document: dict[str, Any], words: str) -> None:
    reply = serve().request("POST", "/v2/models/demo/infer", json.dumps(document))
    assert (reply.status, reply.json()["error"]) == (400, words)


def test_only_a_token_holder_is_trusted(serve: Callable[..., HttpServer]) -> None:
    models = RecordingModels()
    server = serve(models)
    body, headers = binary_request(image())
    for authorization in (None, "Bearer wrong", f"Bearer {TOKEN}"):
        sent = {**headers, **({"Authorization": authorization} if authorization else {})}
        assert server.request("POST", "/v2/models/demo/infer", body, sent).status == 200
    assert [request.trusted for request in models.requests] == [False, False, True]
