"""Triton's system shared memory extension against Triton's own clients (tritonclient.http and
.grpc, with tritonclient.utils.shared_memory making the regions), over the real registry of
the demo model: tensors both ways through /dev/shm, the endpoints behind the token, and each
object the data plane must not open refused with its status and the words that name why.
Every /dev/shm object a test makes has this process's id in its name and is removed after it.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpc_triton
import tritonclient.http as http_triton
import tritonclient.utils.shared_memory as shm
from http_helpers import HttpServer, token_file
from serving_helpers import DemoModels
from tritonclient.utils import InferenceServerException

from agent.serving import proto
from agent.serving.access import Access
from agent.serving.budget import MemoryBudget
from agent.serving.core import InferRequest, InferResult
from agent.serving.errors import ServeError
from agent.serving.grpc_api import build_grpc_server
from agent.serving.grpc_client import GrpcClient
from agent.serving.grpc_codec import infer_request
from agent.serving.http_client import HttpClient, status_name
from agent.serving.shm import CallerRegions, SharedMemoryRegions
from agent.serving.shm_tensors import RegionInput, RegionRef

TOKEN = "s3cret-token"
PREFIX = "edge-agent-"
LIMIT = 1 << 20
IMAGE_BYTES = 3 * 64 * 64 * 4  # one FP32 image of the demo model
SCORES_BYTES = 10 * 4  # its FP32 probabilities
_serial = itertools.count()


def unique(label: str) -> str:
    """An object name under the prefix, this process's own."""
    return f"{PREFIX}test-{os.getpid()}-{label}-{next(_serial)}"


def image(batch: int = 1, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random((batch, 3, 64, 64), dtype=np.float32)


def expected(models: DemoModels, array: np.ndarray) -> np.ndarray:
    return np.asarray(models.session.run(["probabilities"], {"image": array})[0])


@pytest.fixture(scope="module")
def demo() -> DemoModels:
    return DemoModels()


@dataclass
class Plane:
    """Both front ends over one registry of regions, Triton's clients of each, and the
    /dev/shm objects this test made."""

    models: Any
    regions: SharedMemoryRegions
    http: HttpServer
    grpc_target: str
    http_client: Any
    grpc_client: Any
    handles: list[Any] = field(default_factory=list)
    paths: list[Path] = field(default_factory=list)

    def region(self, byte_size: int, label: str = "r") -> tuple[Any, str]:
        """A tritonclient region of ``byte_size`` bytes and its key ("/name", as Triton's
        examples spell it)."""
        key = "/" + unique(label)
        handle = shm.create_shared_memory_region(key.lstrip("/"), key, byte_size)
        self.handles.append(handle)
        return handle, key

    def raw_object(self, byte_size: int, label: str = "raw") -> Path:
        """A /dev/shm object made by hand, for what tritonclient would never make."""
        path = Path("/dev/shm") / unique(label)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, byte_size)
        os.close(fd)
        self.paths.append(path)
        return path

    def extra_path(self, label: str) -> Path:
        path = Path("/dev/shm") / unique(label)
        self.paths.append(path)
        return path


@pytest.fixture
def start(demo: DemoModels, tmp_path: Path) -> Iterator[Callable[..., Plane]]:
    """Start a plane (``models`` wraps the demo registry when given); stopped after."""
    started: list[tuple[Plane, Any, concurrent.futures.ThreadPoolExecutor]] = []
    access = Access((token_file(tmp_path, TOKEN),), everything=False)

    def run(models: Any = None, regions: SharedMemoryRegions | None = None) -> Plane:
        models = models or demo
        regions = regions or SharedMemoryRegions(PREFIX, max_bytes=16 * LIMIT)
        http = HttpServer(models, access, max_request_bytes=LIMIT, regions=regions)
        executor = concurrent.futures.ThreadPoolExecutor(2)
        server = build_grpc_server(models, access, max_request_bytes=LIMIT, executor=executor,
                                   regions=regions)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        plane = Plane(models, regions, http, f"127.0.0.1:{port}",
                      http_triton.InferenceServerClient(http.url, network_timeout=10.0),
                      grpc_triton.InferenceServerClient(f"127.0.0.1:{port}"))
        started.append((plane, server, executor))
        return plane

    yield run
    for plane, server, executor in started:
        plane.http_client.close()
        plane.grpc_client.close()
        server.stop(None)
        executor.shutdown(wait=True)
        plane.http.stop()
        plane.regions.close()
        for handle in plane.handles:
            shm.destroy_shared_memory_region(handle)
        for path in plane.paths:
            if path.is_dir() and not path.is_symlink():
                path.rmdir()
            else:
                path.unlink(missing_ok=True)


@pytest.fixture
def plane(start: Callable[..., Plane]) -> Plane:
    return start()


HTTP_AUTH = {"Authorization": f"Bearer {TOKEN}"}
GRPC_AUTH = {"authorization": f"Bearer {TOKEN}"}


def auth(client: Any) -> dict[str, str]:
    """The token header for ``client``'s protocol: an inference that references a region
    needs it, as registering one does."""
    return GRPC_AUTH if isinstance(client, grpc_triton.InferenceServerClient) else HTTP_AUTH


def status_of(error: InferenceServerException) -> str:
    """The status name, whichever front end answered (HTTP's status read as ours)."""
    status = str(error.status())
    return status_name(int(status)) if status.isdigit() else status.removeprefix("StatusCode.")


def http_register(plane: Plane, name: str, key: str, byte_size: int, offset: int = 0) -> None:
    plane.http_client.register_system_shared_memory(name, key, byte_size, offset,
                                                    headers=HTTP_AUTH)


def grpc_register(plane: Plane, name: str, key: str, byte_size: int, offset: int = 0) -> None:
    plane.grpc_client.register_system_shared_memory(name, key, byte_size, offset,
                                                    headers=GRPC_AUTH)


# --- tensors both ways through shared memory -----------------------------------------------


def test_http_round_trip_in_shared_memory(plane: Plane) -> None:
    array = image(seed=1)
    source, source_key = plane.region(IMAGE_BYTES, "in")
    target, target_key = plane.region(SCORES_BYTES, "out")
    shm.set_shared_memory_region(source, [array])
    http_register(plane, "in", source_key, IMAGE_BYTES)
    http_register(plane, "out", target_key, SCORES_BYTES)
    tensor = http_triton.InferInput("image", [1, 3, 64, 64], "FP32")
    tensor.set_shared_memory("in", IMAGE_BYTES)
    output = http_triton.InferRequestedOutput("probabilities")
    output.set_shared_memory("out", SCORES_BYTES)

    result = plane.http_client.infer("demo", [tensor], outputs=[output], headers=HTTP_AUTH)

    answer = result.get_output("probabilities")
    assert answer["parameters"] == {"shared_memory_region": "out",
                                    "shared_memory_byte_size": SCORES_BYTES}
    assert "data" not in answer
    assert answer["shape"] == [1, 10]
    scores = shm.get_contents_as_numpy(target, np.float32, [1, 10]).copy()
    np.testing.assert_allclose(scores, expected(plane.models, array), rtol=1e-6)


def test_grpc_round_trip_with_offsets_in_one_region(plane: Plane) -> None:
    """Input at an offset of the object and of the region, output at the region's start."""
    array = image(batch=2, seed=2)
    handle, key = plane.region(4096 + 128 + 2 * IMAGE_BYTES, "both")
    shm.set_shared_memory_region(handle, [array], offset=4096 + 128)
    grpc_register(plane, "both", key, 128 + 2 * IMAGE_BYTES, offset=4096)
    tensor = grpc_triton.InferInput("image", [2, 3, 64, 64], "FP32")
    tensor.set_shared_memory("both", 2 * IMAGE_BYTES, offset=128)
    output = grpc_triton.InferRequestedOutput("probabilities")
    output.set_shared_memory("both", 128)

    result = plane.grpc_client.infer("demo", [tensor], outputs=[output], headers=GRPC_AUTH)

    response = result.get_response()
    (answer,) = response.outputs
    assert answer.parameters["shared_memory_region"].string_param == "both"
    assert answer.parameters["shared_memory_byte_size"].int64_param == 2 * SCORES_BYTES
    assert list(response.raw_output_contents) == [b""]  # keeps its place, carries nothing
    scores = shm.get_contents_as_numpy(handle, np.float32, [2, 10], offset=4096).copy()
    np.testing.assert_allclose(scores, expected(plane.models, array), rtol=1e-6)


def test_raw_contents_count_only_the_inputs_not_in_shared_memory(plane: Plane) -> None:
    handle, key = plane.region(16, "pair")
    shm.set_shared_memory_region(handle, [np.arange(4, dtype=np.float32)])
    plane.regions.register("pair", key, 0, 16)
    request = proto.ModelInferRequest(model_name="m")
    first = request.inputs.add(name="a", datatype="FP32", shape=[4])
    first.parameters["shared_memory_region"].string_param = "pair"
    first.parameters["shared_memory_byte_size"].int64_param = 16
    request.inputs.add(name="b", datatype="INT32", shape=[2])
    request.raw_input_contents.append(np.array([7, -1], dtype="<i4").tobytes())

    a, b = infer_request(request, regions=plane.regions,
                          reservation=MemoryBudget(1 << 30).reserve(0, "test")).inputs

    assert a.array.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert b.array.tolist() == [7, -1]
    request.raw_input_contents.append(b"\0" * 8)  # one entry too many
    with pytest.raises(ServeError) as excinfo:
        infer_request(request, regions=plane.regions,
                          reservation=MemoryBudget(1 << 30).reserve(0, "test"))
    assert "2 raw_input_contents for 1 inputs not in shared memory" in excinfo.value.message


# --- the endpoints: token, status, unregister ----------------------------------------------


def test_an_inference_that_references_a_region_needs_the_token(plane: Plane) -> None:
    """A registered region is another process's memory: a local user without the token
    must not have the root server read it into a model or write outputs over it."""
    handle, key = plane.region(IMAGE_BYTES)
    shm.set_shared_memory_region(handle, [image(seed=3)])
    grpc_register(plane, "theirs", key, IMAGE_BYTES)
    for front, client in (("grpc", plane.grpc_client), ("http", plane.http_client)):
        with pytest.raises(InferenceServerException) as excinfo:
            client.infer("demo", [_shm_input(front, "theirs", IMAGE_BYTES)])
        assert status_of(excinfo.value) in ("UNAUTHENTICATED", "401"), front
        assert "bearer token" in excinfo.value.message()
        answer = client.infer("demo", [_shm_input(front, "theirs", IMAGE_BYTES)],
                              headers=auth(client))
        np.testing.assert_allclose(answer.as_numpy("probabilities"),
                                   expected(plane.models, image(seed=3)), rtol=1e-6)


def test_register_and_unregister_need_the_token(plane: Plane) -> None:
    _, key = plane.region(64)
    with pytest.raises(InferenceServerException) as excinfo:
        plane.http_client.register_system_shared_memory("r", key, 64)
    assert excinfo.value.status() == "401"
    assert "bearer token" in excinfo.value.message()
    with pytest.raises(InferenceServerException) as excinfo:
        plane.grpc_client.register_system_shared_memory("r", key, 64)
    assert status_of(excinfo.value) == "UNAUTHENTICATED"
    assert plane.regions.status() == []
    grpc_register(plane, "r", key, 64)
    for call in (lambda: plane.http_client.unregister_system_shared_memory("r"),
                 lambda: plane.http_client.unregister_system_shared_memory(),
                 lambda: plane.grpc_client.unregister_system_shared_memory("r")):
        with pytest.raises(InferenceServerException):
            call()
    assert [r["name"] for r in plane.regions.status()] == ["r"]


def test_status_lists_what_is_registered_and_unregister_one_or_all(plane: Plane) -> None:
    _, first = plane.region(128, "a")
    _, second = plane.region(8192, "b")
    http_register(plane, "a", first, 100, offset=8)
    grpc_register(plane, "b", second, 4096, offset=4096)
    listed = {"a": {"name": "a", "key": first, "offset": 8, "byte_size": 100},
              "b": {"name": "b", "key": second, "offset": 4096, "byte_size": 4096}}
    assert plane.http_client.get_system_shared_memory_status() == list(listed.values())
    assert plane.http_client.get_system_shared_memory_status("b") == [listed["b"]]
    grpc_status = plane.grpc_client.get_system_shared_memory_status(as_json=True)
    assert {name: {"name": r["name"], "key": r["key"], "offset": int(r["offset"]),
                   "byte_size": int(r["byte_size"])}
            for name, r in grpc_status["regions"].items()} == listed

    plane.http_client.unregister_system_shared_memory("a", headers=HTTP_AUTH)
    assert plane.http_client.get_system_shared_memory_status() == [listed["b"]]
    with pytest.raises(InferenceServerException) as excinfo:
        plane.http_client.get_system_shared_memory_status("a")
    assert excinfo.value.status() == "404"
    assert "'a'" in excinfo.value.message()
    grpc_register(plane, "a", first, 100)
    plane.grpc_client.unregister_system_shared_memory(headers=GRPC_AUTH)
    assert plane.regions.status() == []
    plane.http_client.unregister_system_shared_memory("a", headers=HTTP_AUTH)  # no error


def test_a_name_registered_twice_is_already_exists(plane: Plane) -> None:
    _, key = plane.region(64)
    grpc_register(plane, "twice", key, 64)
    with pytest.raises(InferenceServerException) as excinfo:
        grpc_register(plane, "twice", key, 32)
    assert status_of(excinfo.value) == "ALREADY_EXISTS"
    assert "'twice' is already registered" in excinfo.value.message()
    with pytest.raises(InferenceServerException) as excinfo:
        http_register(plane, "twice", key, 32)
    assert excinfo.value.status() == "400"
    assert plane.regions.status()[0]["byte_size"] == 64


def test_server_metadata_lists_the_extension(plane: Plane) -> None:
    assert "system_shared_memory" in plane.http_client.get_server_metadata()["extensions"]
    assert "system_shared_memory" in plane.grpc_client.get_server_metadata().extensions


# --- what the data plane must not open ------------------------------------------------------


def _symlink(plane: Plane) -> tuple[str, int]:
    link = plane.extra_path("link")
    link.symlink_to(plane.raw_object(64, "target"))
    return link.name, 64


def _hard_link(plane: Plane) -> tuple[str, int]:
    link = plane.extra_path("hard")
    os.link(plane.raw_object(64, "original"), link)
    return link.name, 64


def _directory(plane: Plane) -> tuple[str, int]:
    path = plane.extra_path("dir")
    path.mkdir()
    return path.name, 64


REFUSED: list[tuple[str, Callable[[Plane], tuple[str, int]], int, str, str, str]] = [
    # (case, key and byte size, offset, gRPC status, HTTP status, words)
    ("outside the prefix", lambda p: ("/other-name", 64), 0, "PERMISSION_DENIED", "403",
     f"outside serve.shm_prefix '{PREFIX}'"),
    ("a slash", lambda p: (f"/{PREFIX}x/../../etc/passwd", 64), 0, "INVALID_ARGUMENT", "400",
     "plain name"),
    ("two leading slashes", lambda p: (f"//{PREFIX}x", 64), 0, "INVALID_ARGUMENT", "400",
     "plain name"),
    ("dot dot", lambda p: (f"{PREFIX}..", 64), 0, "INVALID_ARGUMENT", "400", "no '..'"),
    ("too long", lambda p: (PREFIX + "x" * 250, 64), 0, "INVALID_ARGUMENT", "400",
     "longer than 255 bytes"),
    ("no such object", lambda p: (unique("missing"), 64), 0, "NOT_FOUND", "404",
     "no shared memory object"),
    ("a symbolic link", _symlink, 0, "PERMISSION_DENIED", "403", "symbolic link"),
    ("a second hard link", _hard_link, 0, "PERMISSION_DENIED", "403", "2 hard links"),
    ("a directory", _directory, 0, "INVALID_ARGUMENT", "400", "cannot open"),
    ("beyond the object", lambda p: (p.raw_object(64).name, 65), 0, "INVALID_ARGUMENT", "400",
     "beyond the object's 64 bytes"),
    ("offset beyond the object", lambda p: (p.raw_object(64).name, 8), 60, "INVALID_ARGUMENT",
     "400", "at offset 60 is beyond the object's 64 bytes"),
    ("an empty region", lambda p: (p.raw_object(64).name, 0), 0, "INVALID_ARGUMENT", "400",
     "byte_size above 0"),
]


@pytest.mark.parametrize(("case", "build", "offset", "code", "http_status", "words"), REFUSED,
                         ids=[case[0] for case in REFUSED])
def test_objects_it_must_not_open_are_refused(plane: Plane, case: str,
                                              build: Callable[[Plane], tuple[str, int]],
                                              offset: int, code: str, http_status: str,
                                              words: str) -> None:
    key, byte_size = build(plane)
    with pytest.raises(InferenceServerException) as excinfo:
        grpc_register(plane, "bad", key, byte_size, offset)
    assert status_of(excinfo.value) == code
    assert words in excinfo.value.message()
    with pytest.raises(InferenceServerException) as excinfo:
        http_register(plane, "bad", key, byte_size, offset)
    assert excinfo.value.status() == http_status
    assert words in excinfo.value.message()
    assert plane.regions.status() == []


def test_regions_are_bounded_in_count_and_bytes(start: Callable[..., Plane]) -> None:
    plane = start(regions=SharedMemoryRegions(PREFIX, max_bytes=100, max_regions=2))
    _, key = plane.region(128)
    grpc_register(plane, "one", key, 60)
    with pytest.raises(InferenceServerException) as excinfo:
        grpc_register(plane, "two", key, 41)
    assert status_of(excinfo.value) == "RESOURCE_EXHAUSTED"
    assert "beyond 100 bytes" in excinfo.value.message()
    grpc_register(plane, "two", key, 40)
    with pytest.raises(InferenceServerException) as excinfo:
        grpc_register(plane, "three", key, 1)
    assert "2 shared memory regions are registered" in excinfo.value.message()


# --- requests that reference regions wrongly -----------------------------------------------


def _shm_input(front: str, region: str, byte_size: int, offset: int = 0,
               shape: tuple[int, ...] = (1, 3, 64, 64)) -> Any:
    module = http_triton if front == "http" else grpc_triton
    tensor = module.InferInput("image", list(shape), "FP32")
    tensor.set_shared_memory(region, byte_size, offset)
    return tensor


@pytest.mark.parametrize("front", ["http", "grpc"])
def test_bad_references_are_invalid_naming_the_problem(plane: Plane, front: str) -> None:
    handle, key = plane.region(IMAGE_BYTES + 64, "ref")
    shm.set_shared_memory_region(handle, [image()])
    plane.regions.register("ref", key, 0, IMAGE_BYTES + 64)
    client = plane.http_client if front == "http" else plane.grpc_client
    module = http_triton if front == "http" else grpc_triton
    cases = [
        (_shm_input(front, "nowhere", IMAGE_BYTES), None,
         "shared memory region 'nowhere' is not registered"),
        (_shm_input(front, "ref", IMAGE_BYTES, offset=128), None,
         f"offset 128 + byte size {IMAGE_BYTES} is beyond shared memory region 'ref'"),
        (_shm_input(front, "ref", 100), None,
         f"shared_memory_byte_size 100, but shape [1, 3, 64, 64] of FP32 needs {IMAGE_BYTES}"),
        (_shm_input(front, "ref", IMAGE_BYTES), ("ref", 39),
         "its 40 bytes do not fit the 39 given in shared memory region 'ref'"),
        (_shm_input(front, "ref", IMAGE_BYTES), ("gone", 40),
         "shared memory region 'gone' is not registered"),
    ]
    for tensor, target, words in cases:
        outputs = None
        if target is not None:
            outputs = [module.InferRequestedOutput("probabilities")]
            outputs[0].set_shared_memory(*target)
        with pytest.raises(InferenceServerException) as excinfo:
            client.infer("demo", [tensor], outputs=outputs, headers=auth(client))
        assert status_of(excinfo.value) == "INVALID_ARGUMENT", words
        assert words in excinfo.value.message()


def test_http_input_in_shared_memory_and_in_the_body_is_refused(plane: Plane) -> None:
    _, key = plane.region(IMAGE_BYTES)
    plane.regions.register("r", key, 0, IMAGE_BYTES)
    tensor = {"name": "image", "datatype": "FP32", "shape": [1, 3, 64, 64], "data": [0],
              "parameters": {"shared_memory_region": "r",
                             "shared_memory_byte_size": IMAGE_BYTES}}
    reply = plane.http.request("POST", "/v2/models/demo/infer",
                               json.dumps({"inputs": [tensor]}))
    assert reply.status == 400
    assert "in shared memory, so neither data nor binary_data_size" in reply.json()["error"]
    del tensor["data"], tensor["parameters"]["shared_memory_byte_size"]
    reply = plane.http.request("POST", "/v2/models/demo/infer",
                               json.dumps({"inputs": [tensor]}))
    assert reply.status == 400
    assert "shared_memory_byte_size must be an integer" in reply.json()["error"]


# --- the region changes under a request ----------------------------------------------------


class Unregistering:
    """The demo registry, but every region is unregistered while the request runs."""

    def __init__(self, models: DemoModels) -> None:
        self.models = models
        self.regions: SharedMemoryRegions | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.models, name)

    def infer(self, request: InferRequest) -> InferResult:
        assert self.regions is not None
        self.regions.unregister()
        return self.models.infer(request)


def _descriptors_of(path: str) -> list[str]:
    """This process's descriptors open on ``path``."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith(path):
                found.append(fd)
        except OSError:
            continue
    return found


def test_unregister_while_a_request_runs_fails_it_cleanly(demo: DemoModels,
                                                          start: Callable[..., Plane]) -> None:
    models = Unregistering(demo)
    plane = start(models=models)
    models.regions = plane.regions
    handle, key = plane.region(IMAGE_BYTES + 64, "busy")
    shm.set_shared_memory_region(handle, [image()])
    path = "/dev/shm/" + key.lstrip("/")
    clients_own = len(_descriptors_of(path))  # tritonclient's
    grpc_register(plane, "busy", key, IMAGE_BYTES + 64)
    tensor = _shm_input("grpc", "busy", IMAGE_BYTES)
    output = grpc_triton.InferRequestedOutput("probabilities")
    output.set_shared_memory("busy", SCORES_BYTES, offset=IMAGE_BYTES)
    assert len(_descriptors_of(path)) == clients_own + 1

    with pytest.raises(InferenceServerException) as excinfo:
        plane.grpc_client.infer("demo", [tensor], outputs=[output], headers=GRPC_AUTH)

    assert status_of(excinfo.value) == "INVALID_ARGUMENT"
    assert "'busy' was unregistered while the request ran" in excinfo.value.message()
    assert len(_descriptors_of(path)) == clients_own  # ours is closed
    assert plane.grpc_client.is_server_live()


def test_a_region_in_use_stays_open_until_its_request_is_done(plane: Plane) -> None:
    handle, key = plane.region(64, "held")
    shm.set_shared_memory_region(handle, [np.arange(16, dtype=np.float32)])
    path = "/dev/shm/" + key.lstrip("/")
    clients_own = len(_descriptors_of(path))
    plane.regions.register("held", key, 0, 64)
    region = plane.regions.get("held")
    with region.held() as fd:
        plane.regions.unregister("held")
        assert plane.regions.status() == []
        assert os.pread(fd, 4, 4) == np.float32(1).tobytes()  # still the object
        assert len(_descriptors_of(path)) == clients_own + 1
    assert len(_descriptors_of(path)) == clients_own
    with pytest.raises(ServeError) as excinfo:
        region.read(0, 4)
    assert "'held' was unregistered" in excinfo.value.message


def test_an_object_shrunk_after_registering_is_refused_not_a_crash(plane: Plane) -> None:
    path = plane.raw_object(IMAGE_BYTES, "shrink")
    grpc_register(plane, "shrink", path.name, IMAGE_BYTES)
    os.truncate(path, 16)
    for front, client in (("grpc", plane.grpc_client), ("http", plane.http_client)):
        with pytest.raises(InferenceServerException) as excinfo:
            client.infer("demo", [_shm_input(front, "shrink", IMAGE_BYTES)],
                         headers=auth(client))
        assert "shrank below the region" in excinfo.value.message()
    assert plane.http_client.is_server_live()


# --- our own clients ------------------------------------------------------------------------


def test_our_clients_drive_shared_memory(plane: Plane) -> None:
    array = image(seed=5)
    handle, key = plane.region(IMAGE_BYTES + SCORES_BYTES, "ours")
    shm.set_shared_memory_region(handle, [array])
    feeds = {"image": RegionInput("FP32", (1, 3, 64, 64), RegionRef("ours", IMAGE_BYTES))}
    scores_at = {"probabilities": RegionRef("ours", SCORES_BYTES, offset=IMAGE_BYTES)}
    with HttpClient(f"http://{plane.http.url}", token=TOKEN) as http_client, \
            GrpcClient(plane.grpc_target, token=TOKEN) as grpc_client:
        http_client.register_shm("ours", key, IMAGE_BYTES + SCORES_BYTES)
        assert grpc_client.shm_status() == [{"name": "ours", "key": key, "offset": 0,
                                             "byte_size": IMAGE_BYTES + SCORES_BYTES}]
        for client in (http_client, grpc_client):
            shm.set_shared_memory_region(handle, [np.zeros((1, 10), np.float32)],
                                         offset=IMAGE_BYTES)
            assert client.infer("demo", feeds, regions=scores_at) == {}
            scores = shm.get_contents_as_numpy(handle, np.float32, [1, 10],
                                               offset=IMAGE_BYTES).copy()
            np.testing.assert_allclose(scores, expected(plane.models, array), rtol=1e-6)
        answer = grpc_client.infer("demo", feeds)  # the input by reference, the output back
        np.testing.assert_allclose(answer["probabilities"], expected(plane.models, array),
                                   rtol=1e-6)
        grpc_client.unregister_shm("ours")
        assert http_client.shm_status() == []
        grpc_client.register_shm("ours", key, 64)
        http_client.unregister_shm()
        with pytest.raises(ServeError) as excinfo:
            http_client.shm_status("ours")
        assert excinfo.value.code == "NOT_FOUND"


def test_a_request_checks_the_token_once_for_all_its_regions(tmp_path: Path) -> None:
    """An input and an output in shared memory cost one token check (a stat of the token
    file), not one per region; a check that fails still refuses every look-up."""
    regions = SharedMemoryRegions(PREFIX, max_bytes=1 << 20)
    key = f"{PREFIX}once-{os.getpid()}"
    handle = shm.create_shared_memory_region(key, f"/{key}", 64)
    try:
        regions.register("once", f"/{key}", 0, 64)
        checks: list[int] = []
        caller = CallerRegions(regions, lambda: checks.append(1))
        assert caller.get("once") is caller.get("once")
        assert checks == [1]

        def refuse() -> None:
            checks.append(2)
            raise ServeError("UNAUTHENTICATED", "no token")

        refused = CallerRegions(regions, refuse)
        for _ in range(2):
            with pytest.raises(ServeError):
                refused.get("once")
        assert checks == [1, 2, 2]
    finally:
        regions.close()
        shm.destroy_shared_memory_region(handle)
