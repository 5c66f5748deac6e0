"""The backend interface in serving: a real ORT CPU model through it with the outputs of a
bare session, instances on mixed devices fed from one queue with per-instance labels (the
RKNN ones on the fake rknnlite), devices checked against discovery, the version-skew refusal
before a hot swap, and TensorRT sessions kept out of the optimised-graph cache."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from onnx_models import conv_net, dynamic_batch_mlp
from rknn_helpers import rknn_bytes, use_fake_rknnlite

from agent.discovery import discover
from agent.discovery.model import Topology
from agent.inference import graph_cache, session
from agent.inference.backends.onnx import OnnxBackend
from agent.inference.provider_options import RuntimeVersions
from agent.kernel.fsroot import Root
from agent.serving.core import InferRequest, Tensor
from agent.serving.errors import ServeError
from agent.serving.metrics import ServingCollector
from agent.serving.registry import ModelRegistry
from agent.serving.server import ServerSettings, _device_check, session_factory
from agent.serving.threads import InferenceThreads

FIXTURES = Path(__file__).parent / "fixtures"
CPU = "CPUExecutionProvider"


@cache
def board(name: str) -> Topology:
    return discover(Root(FIXTURES / name))


def settings(repo: Path, topology: Topology | None, librknnrt: str | None = "2.3.0",
             **kw: Any) -> ServerSettings:
    return ServerSettings(http="127.0.0.1:0", grpc="127.0.0.1:0", repository=repo,
                          builtins={}, pins={}, token_files=[], max_request_bytes=1 << 20,
                          providers=[CPU], threads=(1, 1), cache_dir=None,
                          topology=topology, state_dir=repo.parent / "state",
                          available=[CPU],
                          versions=RuntimeVersions(ort.__version__, librknnrt=librknnrt),
                          **kw)


def registry(config: ServerSettings) -> ModelRegistry:
    made = ModelRegistry(config.repository, {}, session_factory(config, InferenceThreads(None)),
                         probe_interval_s=3600, device_problem=_device_check(config))
    made.start()
    return made


def version_dir(repo: Path, model: str, number: int, config: str = "") -> Path:
    directory = repo / model / str(number)
    directory.mkdir(parents=True)
    if config:
        (repo / model / "config.yaml").write_text(config)
    return directory


def test_a_cpu_instance_is_the_sessions_own_run_with_identical_outputs(tmp_path: Path) -> None:
    repo = tmp_path / "repository"
    path = dynamic_batch_mlp(version_dir(repo, "mlp", 1, "instances: [{device: cpu}]\n")
                             / "model.onnx")
    made = registry(settings(repo, board("bare-vm")))
    try:
        version = made._slots["mlp"].served.versions[1]  # type: ignore[union-attr]
        [(_, backend)] = version.instances
        assert isinstance(backend, OnnxBackend)
        assert backend.run == backend.session.run  # nothing between the queue and ORT
        assert backend.describe()["device"] == "cpu" and backend.providers == [CPU]
        x = np.random.default_rng(3).random((2, 64), dtype=np.float32)
        served = made.infer(InferRequest("mlp", "", (Tensor("x", x),))).outputs[0].array
        bare = ort.InferenceSession(str(path), providers=[CPU]).run(None, {"x": x})[0]
        np.testing.assert_array_equal(served, bare)
    finally:
        made.stop()


def test_npu_cores_and_the_cpu_share_one_queue_with_labels(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    lite = use_fake_rknnlite(monkeypatch)
    repo = tmp_path / "repository"
    directory = version_dir(repo, "det", 1, "precision: int8\ninstances: [{device: npu:0}, "
                            "{device: npu:1}, {device: npu:2}, {device: cpu}]\n")
    conv_net(directory / "model.onnx")
    (directory / "model.rknn").write_bytes(rknn_bytes("2.3.0"))
    made = registry(settings(repo, board("rk3588-vendor")))
    try:
        assert made.index(False)[0].state == "READY", made.index(False)[0].reason
        assert sorted(r.core_mask for r in lite.made) == [1, 2, 4]
        image = np.random.default_rng(4).random((1, 3, 64, 64), dtype=np.float32)
        bare = ort.InferenceSession(str(directory / "model.onnx"), providers=[CPU]).run(
            None, {"image": image})[0]
        request = InferRequest("det", "", (Tensor("image", image),))
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda _: made.infer(request), range(64)))
        for answer in answers:
            np.testing.assert_allclose(answer.outputs[0].array, bare, rtol=1e-5)
        [entry] = made.statistics("det", "")
        instances = entry["edge_agent"]["instances"]
        assert [(i["backend"], i["device"], i["precision"]) for i in instances] == [
            ("rknn", "npu:0", "int8"), ("rknn", "npu:1", "int8"), ("rknn", "npu:2", "int8"),
            ("onnxruntime", "cpu", "fp32")]
        assert sum(i["executions"] for i in instances) == entry["execution_count"] >= 64 // 4
        labels = {(s.labels["model_instance"], s.labels["device"], s.labels["backend"])
                  for family in ServingCollector(made).collect()
                  if family.name == "edge_agent_instance_request_duration_seconds"
                  for s in family.samples}
        assert labels == {("0", "npu:0", "rknn"), ("1", "npu:1", "rknn"),
                          ("2", "npu:2", "rknn"), ("3", "cpu", "onnxruntime")}
    finally:
        made.stop()


def test_a_device_the_board_lacks_names_file_key_and_what_it_has(tmp_path: Path) -> None:
    repo = tmp_path / "repository"
    dynamic_batch_mlp(version_dir(repo, "m", 1, "instances: [{device: gpu:0}, "
                                  "{device: dla:2}]\n") / "model.onnx")
    made = registry(settings(repo, board("jetson-agx-orin-jp6")))
    try:
        [row] = made.index(False)
        assert row.reason == (f"{repo / 'm' / 'config.yaml'}: instances[1].device: 'dla:2' "
                              "is not on this board (discovered here: auto, cpu, gpu:0, "
                              "dla:0, dla:1)")
    finally:
        made.stop()


def test_a_newer_toolkit_is_refused_before_the_swap(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    use_fake_rknnlite(monkeypatch)
    repo = tmp_path / "repository"
    config = "precision: int8\ninstances: [{device: npu:0-2}]\n"
    for number, toolkit in ((1, "2.0.0+1"), (2, "2.3.0+2")):
        directory = version_dir(repo, "det", number, config if number == 1 else "")
        conv_net(directory / "model.onnx")
        (directory / "model.rknn").write_bytes(rknn_bytes(toolkit))
    (repo / "det" / "2").rename(tmp_path / "held")  # version 2 arrives later
    made = registry(settings(repo, board("rk3588-vendor"), librknnrt="2.0.0"))
    try:
        image = (Tensor("image", np.zeros((1, 3, 64, 64), np.float32)),)
        assert made.infer(InferRequest("det", "", image)).version == "1"
        (tmp_path / "held").rename(repo / "det" / "2")
        with pytest.raises(ServeError) as caught:
            made.load("det", {})
        assert "rknn-toolkit2 2.3.0+2, newer than this board's librknnrt 2.0.0" in \
            caught.value.message
        assert made.infer(InferRequest("det", "", image)).version == "1"  # still serving
    finally:
        made.stop()


def test_a_tensorrt_session_never_enters_the_graph_cache(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    built: list[Any] = []

    def fake_session(path: Path, model: bytes, options: Any, providers: list[Any]) -> str:
        built.append((options.optimized_model_filepath, providers))
        return "session"

    monkeypatch.setattr(graph_cache, "_session", fake_session)
    trt = ("TensorrtExecutionProvider", {"trt_fp16_enable": "1"})
    result = graph_cache.create_session(tmp_path / "m.onnx", b"", "ab" * 32, [trt, CPU],
                                        ort.SessionOptions, tmp_path / "cache", "all")
    assert result == ("session", "off")
    assert built == [("", [trt, CPU])] and not (tmp_path / "cache").exists()


def test_a_compiling_build_reports_it_is_still_going(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    model = dynamic_batch_mlp(tmp_path / "model.onnx")
    real = session.create_session

    def slow(*args: Any) -> Any:
        time.sleep(0.35)
        return real(args[0], args[1], args[2], [CPU], *args[4:])

    monkeypatch.setattr(session, "create_session", slow)
    monkeypatch.setattr(session, "BUILDING_EVERY_S", 0.1)
    seen: list[float] = []
    lock = threading.Lock()

    def building(seconds: float) -> None:
        with lock:
            seen.append(seconds)

    session.build_session(model, providers=[("TensorrtExecutionProvider", {}), CPU],
                          intra_op=1, inter_op=1, cache_dir=None, building=building)
    assert len(seen) >= 2 and seen == sorted(seen) and seen[0] >= 0.1
    seen.clear()
    session.build_session(model, providers=[CPU], intra_op=1, inter_op=1, cache_dir=None,
                          building=building)
    assert seen == []  # a CPU session builds in milliseconds: nothing to report


class _Heard:
    def __init__(self) -> None:
        self.messages: list[dict[str, object]] = []

    def notify(self, **fields: object) -> None:
        self.messages.append(fields)


def test_each_building_report_extends_systemds_start_timeout(tmp_path: Path) -> None:
    from agent.service.building import BuildWatch
    from agent.serving.building import BUILDING_FILE, write_building

    heard = _Heard()
    watch = BuildWatch(tmp_path / BUILDING_FILE, heard)  # type: ignore[arg-type]
    assert not watch.check()  # nothing building
    write_building(tmp_path / BUILDING_FILE, 12.34)
    assert watch.check() and not watch.check()  # one report, one extension
    assert heard.messages == [{"EXTEND_TIMEOUT_USEC": 60_000_000,
                               "STATUS": "starting: the data plane is building engines "
                                         "(12 s so far)"}]
    watch.reset()
    assert not (tmp_path / BUILDING_FILE).exists() and not watch.check()
