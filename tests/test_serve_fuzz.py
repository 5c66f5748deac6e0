"""Hostile bodies and headers against the HTTP data plane, over raw sockets so that nothing
a client library would refuse to send is left out: random bytes, JSON of every shape, near-
valid inference requests with one field wrong (huge or negative dimensions, NaN, sizes beyond
the body, garbage Inference-Header-Content-Length), compressed bodies, floods of inputs,
outputs and parameters, numbers beyond what JSON or the datatype holds.  Every answer must
be a refusal (4xx, or 503 for a model unloaded by an earlier example) or a success, never a
500 and never silence: a socket timeout fails the example, and the server must still answer
its liveness probe."""

from __future__ import annotations

import gzip
import json
import socket
import urllib.parse
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from http_helpers import HttpServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serving_helpers import DemoModels

from agent.serving.access import Access
from agent.serving.core import DATATYPES
from agent.serving.http_codec import MAX_PARAMETERS, MAX_TENSORS
from agent.serving.json_body import MAX_INT_DIGITS

TOKEN = "fuzz-token"
TIMEOUT_S = 10.0
FUZZ = settings(deadline=None, max_examples=150, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpServer]:
    directory: Path = tmp_path_factory.mktemp("fuzz")
    (directory / "token").write_text(TOKEN)
    (directory / "token").chmod(0o600)
    running = HttpServer(DemoModels(), Access((directory / "token",), everything=False),
                         max_request_bytes=1 << 20)
    yield running
    running.stop()


def send(server: HttpServer, method: str, path: str, body: bytes,
         headers: list[tuple[str, bytes]]) -> tuple[int, bytes]:
    """One request as raw bytes on a fresh connection; the status and body of the answer."""
    head = [f"{method} {path} HTTP/1.1".encode(), b"Host: fuzz",
            f"Content-Length: {len(body)}".encode(), b"Connection: close"]
    head += [name.encode() + b": " + value for name, value in headers]
    received = b""
    with socket.create_connection((server.host, server.port), timeout=TIMEOUT_S) as sock:
        try:
            sock.sendall(b"\r\n".join(head) + b"\r\n\r\n" + body)
            while chunk := sock.recv(65536):  # a timeout raises: the server hung
                received += chunk
        except (ConnectionResetError, BrokenPipeError):
            # A head the HTTP parser refuses (a control byte in a header, say) is answered
            # 400 and the connection closed at once, unread body and all: the kernel then
            # resets it, and the answer may not survive.  The liveness check that follows
            # every example still catches a server that died.
            if not received:
                return 400, b""
    while received.startswith(b"HTTP/1.1 1"):  # an interim 100 Continue: the answer follows
        received = received.partition(b"\r\n\r\n")[2]
    status_line, _, rest = received.partition(b"\r\n")
    assert status_line.startswith(b"HTTP/1."), received[:200]
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


def check(server: HttpServer, status: int, body: bytes) -> None:
    assert status < 500 or status == 503, (status, body[:500])
    if status >= 400 and body.startswith(b"{"):
        assert isinstance(json.loads(body)["error"], str)
    assert send(server, "GET", "/v2/health/live", b"", [])[0] == 200


def mostly(right: st.SearchStrategy[Any], wrong: st.SearchStrategy[Any]) -> Any:
    """``right`` about seven times in eight, so a wrong field is reached past the right ones
    (the choice in the middle of the range: Hypothesis favours the ends of one)."""
    return st.integers(0, 7).flatmap(lambda pick: wrong if pick == 3 else right)


header_value = st.one_of(
    st.sampled_from([b"100-continue", b"gzip", b"deflate", b"br", b"application/json",
                     b"Bearer " + TOKEN.encode(), b"Bearer", b"0", b"-1"]),
    st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=24).map(str.encode),
    st.text(st.characters(min_codepoint=1, max_codepoint=255, blacklist_characters="\r\n"),
            max_size=24).map(lambda text: text.encode("latin-1")))
big_ints = st.sampled_from([2**40, 2**63, 2**64 + 1, -1, -(2**63), 10**30, 0])
json_scalar = st.one_of(st.none(), st.booleans(), st.integers(), big_ints,
                        st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20))
json_value = st.recursive(json_scalar, lambda inner: st.one_of(
    st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=10), inner, max_size=5)),
    max_leaves=25)
dims = st.lists(st.one_of(st.integers(-2, 70), big_ints), max_size=18)
datatype = st.one_of(st.sampled_from([*DATATYPES, "BYTES", "fp32", ""]), json_value)
size = st.one_of(st.integers(0, 4096), big_ints, json_value)
PIXELS = 3 * 64 * 64


@st.composite
def infer_body(draw: st.DrawFn) -> tuple[bytes, list[tuple[str, bytes]]]:
    """A near-valid request: mostly right field by field (so that a wrong one is reached),
    binary or JSON, the JSON part's length in its header right, wrong or not a number."""
    batch = draw(st.integers(0, 2))
    binary = draw(st.booleans())
    entry: dict[str, Any] = {
        "name": draw(mostly(st.just("image"), st.one_of(st.sampled_from(["x", ""]),
                                                        json_value))),
        "shape": draw(mostly(st.just([batch, 3, 64, 64]), st.one_of(dims, json_value))),
        "datatype": draw(mostly(st.just("FP32"), datatype))}
    tail = b""
    if binary:
        entry["parameters"] = {"binary_data_size": draw(mostly(st.just(batch * PIXELS * 4),
                                                               size))}
        tail = draw(mostly(st.just(b"\0" * (batch * PIXELS * 4)), st.binary(max_size=64)))
    else:
        entry["data"] = draw(mostly(
            st.floats(allow_nan=True, allow_infinity=True).map(lambda v: [v] * batch * PIXELS),
            st.one_of(st.lists(st.floats(), max_size=8), json_value)))
    if not draw(st.integers(0, 5)):
        entry["parameters"] = draw(json_value)
    document: dict[str, Any] = {"inputs": draw(mostly(st.just([entry]), st.one_of(
        st.just([entry, entry]), st.just([]), json_value)))}
    outputs = st.lists(st.fixed_dictionaries(
        {"name": mostly(st.just("probabilities"), json_value),
         "parameters": mostly(st.fixed_dictionaries({"binary_data": st.booleans()}),
                              json_value)}), max_size=2)
    for key, strategy in (("id", mostly(st.text(max_size=8), json_value)),
                          ("parameters", mostly(st.fixed_dictionaries(
                              {"binary_data_output": st.booleans()}), json_value)),
                          ("outputs", mostly(outputs, json_value))):
        if draw(st.booleans()):
            document[key] = draw(strategy)
    head = json.dumps(document).encode()
    length = draw(mostly(st.just(str(len(head)).encode()), st.one_of(
        st.integers().map(lambda n: str(n).encode()), big_ints.map(lambda n: str(n).encode()),
        header_value)))
    headers = [("Inference-Header-Content-Length", length)] if binary or draw(st.booleans()) \
        else []
    return head + tail, headers


extra_headers = st.lists(st.tuples(st.sampled_from(
    ["Inference-Header-Content-Length", "Content-Type", "Authorization", "Content-Encoding",
     "Accept-Encoding", "Accept", "Expect"]), header_value), max_size=3)
routes = st.sampled_from(["/v2/models/demo/infer", "/v2/models/demo/versions/1/infer",
                          "/v2/models/demo/versions/x/infer", "/v2/models/nope/infer",
                          "/v2/repository/index", "/v2/repository/models/demo/load",
                          "/v2/repository/models/demo/unload"])


@FUZZ
@given(route=routes, body=st.binary(max_size=512), headers=extra_headers)
def test_random_bytes_and_headers(server: HttpServer, route: str, body: bytes,
                                  headers: list[tuple[str, bytes]]) -> None:
    check(server, *send(server, "POST", route, body, headers))


@FUZZ
@given(route=routes, document=json_value, token=st.booleans())
def test_random_json_documents(server: HttpServer, route: str, document: Any,
                               token: bool) -> None:
    headers = [("Authorization", f"Bearer {TOKEN}".encode())] if token else []
    check(server, *send(server, "POST", route, json.dumps(document).encode(), headers))


@FUZZ
@given(request=infer_body(), headers=st.lists(st.tuples(st.sampled_from(
    ["Content-Type", "Authorization", "Content-Encoding", "Expect"]), header_value),
    max_size=1))
def test_near_valid_inference_requests(server: HttpServer,
                                       request: tuple[bytes, list[tuple[str, bytes]]],
                                       headers: list[tuple[str, bytes]]) -> None:
    body, split = request
    check(server, *send(server, "POST", "/v2/models/demo/infer", body, split + headers))


def compressed(algorithm: str, data: bytes, cut: int) -> bytes:
    packed = gzip.compress(data) if algorithm == "gzip" else zlib.compress(data)
    return packed[:cut] if cut else packed


@FUZZ
@given(route=routes, algorithm=st.sampled_from(["gzip", "deflate", "br", "zstd", "x"]),
       body=st.one_of(st.binary(max_size=256), st.builds(
           compressed, st.sampled_from(["gzip", "deflate"]),
           st.one_of(st.binary(max_size=256), json_value.map(lambda v: json.dumps(v).encode()),
                     st.just(b"0" * (2 << 20))), st.integers(0, 64))))
def test_compressed_bodies(server: HttpServer, route: str, algorithm: str,
                           body: bytes) -> None:
    """Refused from the head, whatever they inflate to (the control routes ask for the
    token first)."""
    status, answer = send(server, "POST", route, body, [("Content-Encoding", algorithm.encode())])
    check(server, status, answer)
    assert status == (401 if route.endswith(("/load", "/unload")) else 415)


def infer_loaded(server: HttpServer, body: bytes) -> tuple[int, bytes]:
    """An inference of the demo, loaded again first if an earlier example unloaded it."""
    answer = send(server, "POST", "/v2/models/demo/infer", body, [])
    if answer[0] == 503 and b"not loaded" in answer[1]:
        assert send(server, "POST", "/v2/repository/models/demo/load", b"",
                    [("Authorization", f"Bearer {TOKEN}".encode())])[0] == 200
        answer = send(server, "POST", "/v2/models/demo/infer", body, [])
    return answer


NON_FINITE = {"1e999", "-1e999", "NaN", "Infinity", "-Infinity", "1.7976931348623157e309"}
FINITE = ["0.5", "1e-999", "-0", "4.9e-325", "18446744073709551616", "-1e38", "3.4e38"]
TOO_LONG = ["1" * (MAX_INT_DIGITS + 1), "-" + "9" * (MAX_INT_DIGITS + 5)]


@FUZZ
@given(placed=st.lists(st.tuples(st.integers(0, PIXELS - 1),
                                 st.sampled_from([*NON_FINITE, *FINITE, *TOO_LONG])),
                       max_size=3))
def test_numbers_beyond_json_or_the_datatype(server: HttpServer,
                                             placed: list[tuple[int, str]]) -> None:
    """The demo's FP32 input in JSON with a few values replaced: a non-finite number or an
    integer of too many digits is a 400 naming the input; anything else serves."""
    values = ["0.5"] * PIXELS
    for index, token in placed:
        values[index] = token
    body = ('{"inputs":[{"name":"image","shape":[1,3,64,64],"datatype":"FP32","data":['
            + ",".join(values) + "]}]}").encode()
    status, answer = infer_loaded(server, body)
    check(server, status, answer)
    if any(value in TOO_LONG for value in values):  # refused as the JSON is parsed
        assert status == 400 and b"digits is out of range" in answer
    elif any(value in NON_FINITE for value in values):
        assert status == 400 and b"input image: NaN, Infinity" in answer
    else:
        assert status == 200


FLOODS = {"inputs": MAX_TENSORS, "outputs": MAX_TENSORS, "parameters": MAX_PARAMETERS,
          "input parameters": MAX_PARAMETERS}


@FUZZ
@given(field=st.sampled_from(sorted(FLOODS)), count=st.integers(0, 2 * MAX_TENSORS),
       overflow=st.sampled_from(["1e999", "NaN", str(2**64), "-1", str(10**39), "0"]))
def test_floods_of_fields(server: HttpServer, field: str, count: int, overflow: str) -> None:
    """``count`` inputs, outputs or parameters (each value ``overflow``): beyond the bound a
    400 naming the field and the bound, before any of them is decoded; never a 500."""
    image = ('{"name":"image","shape":[1,3,64,64],"datatype":"FP32","data":['
             + ",".join(["0.5"] * PIXELS) + "]")
    entries = ",".join(f'"p{n}":{overflow}' for n in range(count))
    if field == "inputs":
        inputs = ",".join([image + "}"] + [f'{{"name":"x{n}","shape":[1],"datatype":"FP32",'
                                            f'"data":[{overflow}]}}' for n in range(count - 1)])
        body = f'{{"inputs":[{inputs}]}}'
    elif field == "outputs":
        outputs = ",".join(['{"name":"probabilities"}'] * count)
        body = f'{{"inputs":[{image}}}],"outputs":[{outputs}]}}'
    elif field == "parameters":
        body = f'{{"inputs":[{image}}}],"parameters":{{{entries}}}}}'
    else:
        body = f'{{"inputs":[{image},"parameters":{{{entries}}}}}]}}'
    status, answer = infer_loaded(server, body.encode())
    check(server, status, answer)
    limit = FLOODS[field]
    if count > limit:
        assert status == 400
        assert f": {count} given, at most {limit}".encode() in answer


@FUZZ
@given(segments=st.lists(st.text(max_size=12), max_size=6),
       method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "HEAD"]),
       headers=extra_headers)
def test_random_paths(server: HttpServer, segments: list[str], method: str,
                      headers: list[tuple[str, bytes]]) -> None:
    path = "/v2/" + "/".join(urllib.parse.quote(segment, safe="") for segment in segments)
    if method == "HEAD":  # no body comes back: only the status line to check
        with socket.create_connection((server.host, server.port), timeout=TIMEOUT_S) as sock:
            sock.sendall(f"HEAD {path} HTTP/1.1\r\nHost: f\r\nConnection: close\r\n\r\n"
                         .encode())
            status = int(sock.recv(65536).split()[1])
        check(server, status, b"")
    else:
        check(server, *send(server, method, path, b"", headers))


# -- issue 30: compressed bodies, field floods, overflow values ---------------------------

FEW = settings(FUZZ, max_examples=30)  # each example is a large body: few of them
INFER = "/v2/models/demo/infer"


def demo_loaded(server: HttpServer) -> None:
    """The demo loaded again where an earlier example unloaded it (the fuzzers above may)."""
    if send(server, "GET", "/v2/models/demo/ready", b"", [])[0] != 200:
        status, answer = send(server, "POST", "/v2/repository/models/demo/load", b"",
                              [("Authorization", f"Bearer {TOKEN}".encode())])
        assert status == 200, answer


def valid_infer_json() -> bytes:
    return json.dumps({"inputs": [{"name": "image", "shape": [1, 3, 64, 64],
                                   "datatype": "FP32", "data": [0.5] * PIXELS}]}).encode()


def packed(algorithm: str, data: bytes) -> bytes:
    """``data`` in ``algorithm``'s format (brotli as aiohttp reads it)."""
    if algorithm == "br":
        import brotli

        return bytes(brotli.compress(data))
    return gzip.compress(data) if algorithm == "gzip" else zlib.compress(data)


def bomb(algorithm: str, inflated_mb: int) -> bytes:
    """``inflated_mb`` MiB of zeros, compressed chunk by chunk (never held inflated)."""
    if algorithm == "br":
        import brotli

        packer = brotli.Compressor(quality=5)
        chunks = [packer.process(bytes(1 << 20)) for _ in range(inflated_mb)]
        return b"".join(chunks) + bytes(packer.finish())
    deflater = zlib.compressobj(9, zlib.DEFLATED, 31 if algorithm == "gzip" else 15)
    chunks = [deflater.compress(bytes(1 << 20)) for _ in range(inflated_mb)]
    return b"".join(chunks) + deflater.flush()


@FEW
@given(algorithm=st.sampled_from(["gzip", "deflate", "br"]),
       payload=st.sampled_from(["valid", "junk", "cut", "bomb"]), junk=st.binary(max_size=128),
       cut=st.integers(1, 64), inflated_mb=st.sampled_from([2, 16, 64]))
def test_compressed_real_junk_and_bomb_payloads(server: HttpServer, algorithm: str,
                                                payload: str, junk: bytes, cut: int,
                                                inflated_mb: int) -> None:
    """A real compressed infer body is served or refused (415), never half-read; junk in a
    compressed format, a cut stream and a bomb past the 1 MiB limit are refused."""
    demo_loaded(server)
    body = {"valid": lambda: packed(algorithm, valid_infer_json()),
            "junk": lambda: junk,
            "cut": lambda: packed(algorithm, valid_infer_json())[:cut],
            "bomb": lambda: bomb(algorithm, inflated_mb)}[payload]()
    status, answer = send(server, "POST", INFER, body,
                          [("Content-Encoding", algorithm.encode()),
                           ("Content-Type", b"application/json")])
    check(server, status, answer)
    if payload == "valid":
        assert status in (200, 413, 415), (status, answer[:300])
    else:
        assert 400 <= status < 500, (status, answer[:300])


def entry(name: str = "image") -> dict[str, Any]:
    return {"name": name, "shape": [1, 3, 64, 64], "datatype": "FP32", "data": [0.0] * PIXELS}


@FEW
@given(where=st.sampled_from(["inputs", "outputs", "parameters", "input_parameters",
                              "empty_inputs"]),
       count=st.sampled_from([1_000, 10_000, 50_000]))  # 50,000 fit under the 1 MiB limit
def test_field_floods(server: HttpServer, where: str, count: int) -> None:
    """Many inputs, outputs or parameters in one body under the size limit: refused, or
    (unknown parameters, which the protocol lets a server ignore) served."""
    demo_loaded(server)
    document: dict[str, Any] = {"inputs": [entry()]}
    if where == "inputs":
        document["inputs"] = [entry()] + [{"name": f"x{i}"} for i in range(count)]
    elif where == "empty_inputs":
        document["inputs"] = [{}] * count
    elif where == "outputs":
        document["outputs"] = [{"name": "probabilities"}] * count
    elif where == "parameters":
        document["parameters"] = {f"p{i}": i for i in range(count)}
    else:
        document["inputs"][0]["parameters"] = {f"p{i}": i for i in range(count)}
    status, answer = send(server, "POST", INFER, json.dumps(document).encode(),
                          [("Content-Type", b"application/json")])
    check(server, status, answer)
    if where in ("inputs", "empty_inputs", "outputs"):
        assert 400 <= status < 500, (status, answer[:300])


# as text: 5,000 digits are past what int() converts by default, in this process too
huge = st.sampled_from([str(2**62), str(2**63), str(2**64 + 1), str(10**30),
                        "9300000000000000", str(-(2**63) - 1), "9" * 5000])
HUGE = "__huge__"  # where the drawn digits go in the JSON text


def overflow_request(field: str, value: str, sign: bytes
                     ) -> tuple[str, bytes, list[tuple[str, bytes]]]:
    """(route, body, headers): a demo request right but for ``field``, which holds
    ``value``, past any integer the server holds (or for data, ``sign`` 1e999)."""
    document: dict[str, Any] = {"inputs": [entry()]}
    route, headers, tail = INFER, [("Content-Type", b"application/json")], b""
    if field == "version":
        route = f"/v2/models/demo/versions/{value.lstrip('-')}/infer"
    elif field in ("timeout", "priority"):
        document["parameters"] = {field: HUGE}
    elif field == "shape":
        document["inputs"][0]["shape"] = [HUGE, 0]
    elif field in ("binary_shape", "binary_size"):
        size = HUGE if field == "binary_size" else 0
        document["inputs"][0] = {"name": "image", "datatype": "FP32",
                                 "shape": [HUGE, 0] if field == "binary_shape" else
                                 [1, 3, 64, 64], "parameters": {"binary_data_size": size}}
    body = json.dumps(document).encode().replace(f'"{HUGE}"'.encode(), value.encode())
    if field == "data":
        body = body.replace(b"[0.0, ", b"[" + sign + b"1e999, ", 1)
    if field.startswith("binary"):
        headers = [("Inference-Header-Content-Length", str(len(body)).encode())]
        tail = b"\0" * 16
    return route, body + tail, headers


@FEW
@given(field=st.sampled_from(["shape", "binary_shape", "timeout", "priority", "version",
                              "data", "binary_size"]),
       value=huge, sign=st.sampled_from([b"", b"-"]))
def test_overflow_values_are_refused(server: HttpServer, field: str, value: str,
                                     sign: bytes) -> None:
    route, body, headers = overflow_request(field, value, sign)
    demo_loaded(server)
    status, answer = send(server, "POST", route, body, headers)
    check(server, status, answer)
    assert status in (400, 404, 413), (field, status, answer[:300])
