"""Models load in the background while the front ends answer: a model whose session build
hangs keeps only itself from serving, never the health endpoints or the other models.

A real registry over real ONNX Runtime sessions behind the real HTTP front end; the one
model that hangs is built by a factory that waits on an Event before it builds."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agent.inference.demo_model import DEMO_INPUT, DEMO_MODEL_PATH
from agent.serving.access import Access
from agent.serving.http_client import HttpClient
from agent.serving.registry import STOP_WAIT_S, ModelRegistry
from tests.http_helpers import HttpServer, token_file
from tests.mqtt_helpers import wait_until
from tests.serving_helpers import cpu_factory
from tests.test_serve_process import demo_input


class HangingFactory:
    """CPU sessions, except that a build of a model under ``hang`` waits for ``release``."""

    def __init__(self, hang: Path) -> None:
        self.hang = hang
        self.release = threading.Event()
        self.waiting = threading.Event()

    def __call__(self, path: Path, *, sha256: str | None, providers: Sequence[str] | None,
                 threads: int | None, device: str = "auto", precision: str = "fp32") -> Any:
        if self.hang in path.parents:
            self.waiting.set()
            self.release.wait()
        return cpu_factory(path, sha256=sha256, providers=providers, threads=threads,
                           device=device, precision=precision)


def infer_body() -> tuple[bytes, dict[str, str]]:
    import json

    x = demo_input()
    document = {"inputs": [{"name": DEMO_INPUT, "shape": list(x.shape), "datatype": "FP32",
                            "data": x.ravel().tolist()}]}
    return json.dumps(document).encode(), {"Content-Type": "application/json"}


def test_a_model_whose_build_hangs_leaves_health_and_the_other_models_serving(
        tmp_path: Path) -> None:
    """``aslow`` loads first (models load in name order, one at a time): ``demo`` starts
    beside it once it took longer than ``load_alone_s``."""
    repository = tmp_path / "repository"
    (repository / "aslow" / "1").mkdir(parents=True)
    shutil.copy(DEMO_MODEL_PATH, repository / "aslow" / "1" / "model.onnx")
    factory = HangingFactory(repository / "aslow")
    models = ModelRegistry(repository, {"demo": DEMO_MODEL_PATH}, factory,
                           probe_interval_s=3600, load_alone_s=0.5)
    server = HttpServer(models, Access((token_file(tmp_path),), everything=False))
    try:
        started = time.monotonic()
        models.start_loading()
        assert time.monotonic() - started < 5  # it did not wait for the loads
        assert factory.waiting.wait(30)
        # live at once; ready only once the first round finished, which "aslow" holds up
        assert server.request("GET", "/v2/health/live").status == 200
        assert server.request("GET", "/v2/health/ready").status == 503
        assert wait_until(lambda: server.request(
            "GET", "/v2/models/demo/ready").status == 200, 30)
        body, headers = infer_body()
        answer = server.request("POST", "/v2/models/demo/infer", body, headers)
        assert answer.status == 200, answer.body
        assert server.request("GET", "/v2/models/aslow/ready").status != 200
        refused = server.request("POST", "/v2/models/aslow/infer", body, headers)
        assert refused.status == 503 and b"loading" in refused.body
        index = {(row["name"], row["state"]) for row in server.request(
            "POST", "/v2/repository/index", "{}").json()}
        assert index == {("demo", "READY"), ("aslow", "LOADING")}
        assert not models.wait_loaded(0.1)
        factory.release.set()  # the build goes on: the round finishes, the server is ready
        assert models.wait_loaded(30)
        assert server.request("GET", "/v2/health/ready").status == 200
        assert server.request("GET", "/v2/models/aslow/ready").status == 200
    finally:
        factory.release.set()
        server.stop()
        models.stop()


def test_stop_does_not_wait_for_a_load_that_hangs(tmp_path: Path) -> None:
    """It waits STOP_WAIT_S for the load; what that load builds afterwards never serves."""
    repository = tmp_path / "repository"
    (repository / "slow" / "1").mkdir(parents=True)
    shutil.copy(DEMO_MODEL_PATH, repository / "slow" / "1" / "model.onnx")
    factory = HangingFactory(repository / "slow")
    models = ModelRegistry(repository, {}, factory, probe_interval_s=3600)
    models.start_loading()
    assert factory.waiting.wait(30)
    started = time.monotonic()
    models.stop()
    assert time.monotonic() - started < STOP_WAIT_S + 5
    factory.release.set()
    assert models.wait_loaded(30)
    assert models.index(ready_only=True) == []
    assert not models.ready()


def test_the_data_plane_listens_and_writes_its_ready_file_before_the_models_load(
        tmp_path: Path) -> None:
    """``DataPlane.start`` with the hanging build: it returns, the ready file names the
    addresses, both front ends answer, and ``demo`` serves while ``slow`` still loads."""
    import asyncio
    import json

    import tritonclient.grpc as grpcclient

    from agent.serving.server import DataPlane, ServerSettings

    repository = tmp_path / "repository"
    (repository / "slow" / "1").mkdir(parents=True)
    shutil.copy(DEMO_MODEL_PATH, repository / "slow" / "1" / "model.onnx")
    ready = tmp_path / "ready.json"
    plane = DataPlane(ServerSettings(
        http="127.0.0.1:0", grpc="127.0.0.1:0", repository=repository,
        builtins={"demo": DEMO_MODEL_PATH}, pins={}, token_files=[token_file(tmp_path)],
        max_request_bytes=1 << 20, providers=["CPUExecutionProvider"], threads=(1, 1),
        cache_dir=None, ready_file=ready, metrics="127.0.0.1:0"))
    factory = HangingFactory(repository / "slow")
    plane.registry.factory = factory
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(plane.start(), loop).result(30)
        assert factory.waiting.wait(30)
        addresses = json.loads(ready.read_text())
        assert set(addresses) == {"pid", "http", "grpc", "metrics"}
        with HttpClient(f"http://{addresses['http']}") as http:
            assert http.live() and not http.ready()
        grpc = grpcclient.InferenceServerClient(addresses["grpc"])
        assert grpc.is_server_live() and not grpc.is_server_ready()
        assert wait_until(lambda: grpc.is_model_ready("demo"), 30)
        assert not grpc.is_model_ready("slow")
        factory.release.set()
        assert wait_until(grpc.is_server_ready, 30)
    finally:
        factory.release.set()
        asyncio.run_coroutine_threadsafe(plane.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()

