"""The model registry on real ONNX Runtime sessions: start, load/unload and the index, every
error code, probes and readiness, swaps under traffic, the canary and the statistics."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_models
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from serving_helpers import WrappedSession, cpu_factory

import agent
from agent.inference.demo_model import DEMO_MODEL_PATH, finish_model
from agent.inference.session import BuiltSession
from agent.serving.core import InferRequest, OutputRequest, Tensor
from agent.serving.errors import ServeError
from agent.serving.registry import ModelRegistry

CANARY = {"canary_s": 0.5, "max_p99_ratio": 2.0, "max_error_rate": 0.01}


class Flaky(WrappedSession):
    """A session that fails every call while ``broken`` is set (a device lost mid-serve)."""

    def __init__(self, session: Any, broken: threading.Event) -> None:
        super().__init__(session)
        self.broken = broken

    def run(self, names: Any, feeds: Any, options: Any = None) -> Any:
        if self.broken.is_set():
            raise RuntimeError("device lost")
        return super().run(names, feeds, options)


def put(repo: Path, model: str, number: int, make: Callable[..., Path], **kw: Any) -> Path:
    path = repo / model / str(number) / "model.onnx"
    path.parent.mkdir(parents=True, exist_ok=True)
    return make(path, **kw)


def x(batch: int = 1, value: float = 0.25) -> tuple[Tensor, ...]:
    return (Tensor("x", np.full((batch, 64), value, np.float32)),)


def request(model: str = "mlp", version: str = "", inputs: tuple[Tensor, ...] | None = None,
            outputs: tuple[OutputRequest, ...] = ()) -> InferRequest:
    return InferRequest(model, version, x() if inputs is None else inputs, outputs)


def direct(path: Path, inputs: tuple[Tensor, ...]) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return np.asarray(session.run(None, {t.name: t.array for t in inputs})[0])


def until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll with a deadline: for what a background thread does in its own time."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


def code(call: Callable[[], Any]) -> tuple[str, str]:
    with pytest.raises(ServeError) as caught:
        call()
    return caught.value.code, caught.value.message


@pytest.fixture()
def repo(tmp_path: Path) -> Path:
    path = tmp_path / "repository"
    put(path, "mlp", 1, onnx_models.mlp)
    return path


@pytest.fixture()
def registry(repo: Path) -> Iterator[ModelRegistry]:
    made = ModelRegistry(repo, {"demo": DEMO_MODEL_PATH}, cpu_factory, probe_interval_s=60)
    made.start()
    yield made
    made.stop()


class Traffic:
    """Threads sending requests back to back, keeping every answer's version and error."""

    def __init__(self, registry: ModelRegistry, threads: int = 4) -> None:
        self.registry = registry
        self.stop = threading.Event()
        self.versions: list[list[str]] = [[] for _ in range(threads)]
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._send, args=(i,)) for i in range(threads)]

    def _send(self, index: int) -> None:
        while not self.stop.is_set():
            try:
                self.versions[index].append(self.registry.infer(request()).version)
            except Exception as error:
                self.errors.append(repr(error))

    def __enter__(self) -> Traffic:
        for thread in self.threads:
            thread.start()
        until(lambda: all(len(v) >= 5 for v in self.versions))
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join()

    def seen(self, version: str) -> bool:
        return all(version in v for v in self.versions)


def test_start_serves_the_repository_and_the_builtins(registry: ModelRegistry) -> None:
    assert registry.live() and registry.ready()
    assert [(e.name, e.version, e.state) for e in registry.index(False)] == [
        ("demo", "1", "READY"), ("mlp", "1", "READY")]
    assert registry.server_metadata() == {
        "name": "edge-agent", "version": agent.__version__,
        "extensions": ["binary_tensor_data", "model_repository", "model_configuration",
                       "parameters", "statistics", "system_shared_memory"]}
    meta = registry.model_metadata("demo", "")
    assert meta.versions == ("1",)
    assert [s.to_dict() for s in meta.inputs] == [
        {"name": "image", "datatype": "FP32", "shape": [-1, 3, 64, 64]}]


def test_infer_equals_onnxruntime_run_directly(registry: ModelRegistry, repo: Path) -> None:
    inputs = (Tensor("x", np.linspace(-1, 1, 64, dtype=np.float32).reshape(1, 64)),)
    result = registry.infer(request(inputs=inputs))
    assert (result.model, result.version) == ("mlp", "1")
    assert [t.name for t in result.outputs] == ["y"]
    np.testing.assert_array_equal(result.outputs[0].array,
                                  direct(repo / "mlp" / "1" / "model.onnx", inputs))
    image = (Tensor("image", np.random.RandomState(1).rand(2, 3, 64, 64).astype(np.float32)),)
    demo = registry.infer(InferRequest("demo", "1", image, (OutputRequest("probabilities"),)))
    np.testing.assert_array_equal(demo.outputs[0].array, direct(DEMO_MODEL_PATH, image))


def _broadcast_model(path: Path) -> Path:
    """a[N] + b[M]: ORT refuses lengths that do not broadcast, past every shape check."""
    a = helper.make_tensor_value_info("a", TensorProto.FLOAT, ["N"])
    b = helper.make_tensor_value_info("b", TensorProto.FLOAT, ["M"])
    out = helper.make_tensor_value_info("sum", TensorProto.FLOAT, [None])
    graph = helper.make_graph([helper.make_node("Add", ["a", "b"], ["sum"])], "add", [a, b],
                              [out])
    model: onnx.ModelProto = finish_model(graph)
    path.write_bytes(model.SerializeToString())
    return path


def test_every_error_code(registry: ModelRegistry, repo: Path) -> None:
    put(repo, "add", 1, _broadcast_model)
    (repo / "add" / "config.yaml").write_text("max_batch_size: 0\n")
    registry.load("add", {})
    assert code(lambda: registry.infer(request("nope")))[0] == "NOT_FOUND"
    assert code(lambda: registry.infer(request(version="2"))) == (
        "NOT_FOUND", "model mlp has no version '2' serving (serving: 1)")
    assert code(lambda: registry.infer(request(version="one")))[0] == "NOT_FOUND"
    assert code(lambda: registry.model_metadata("nope", ""))[0] == "NOT_FOUND"
    assert code(lambda: registry.model_ready("nope", ""))[0] == "NOT_FOUND"
    assert code(lambda: registry.statistics("nope", ""))[0] == "NOT_FOUND"
    assert code(lambda: registry.load("nope", {}))[0] == "NOT_FOUND"
    assert code(lambda: registry.unload("nope", {}))[0] == "NOT_FOUND"
    wrong_name = (Tensor("z", np.zeros((1, 64), np.float32)),)
    assert code(lambda: registry.infer(request(inputs=wrong_name))) == (
        "INVALID_ARGUMENT", "model mlp has no input 'z' (its inputs: x)")
    wrong_type = (Tensor("x", np.zeros((1, 64), np.float64)),)
    assert "datatype FP64" in code(lambda: registry.infer(request(inputs=wrong_type)))[1]
    wrong_shape = (Tensor("x", np.zeros((1, 63), np.float32)),)
    assert "shape [1, 63]" in code(lambda: registry.infer(request(inputs=wrong_shape)))[1]
    assert code(lambda: registry.infer(request(outputs=(OutputRequest("logits"),)))) == (
        "INVALID_ARGUMENT", "model mlp version 1 has no output 'logits' (its outputs: y)")
    big = (Tensor("image", np.zeros((5, 3, 64, 64), np.float32)),)
    assert code(lambda: registry.infer(InferRequest("demo", "", big))) == (
        "INVALID_ARGUMENT", "model demo version 1: batch size 5 is above its max_batch_size 4")
    mismatched = (Tensor("a", np.ones(2, np.float32)), Tensor("b", np.ones(3, np.float32)))
    status, message = code(lambda: registry.infer(InferRequest("add", "", mismatched)))
    assert status == "INVALID_ARGUMENT"
    assert message.startswith("model add version 1: onnxruntime: ") and "\n" not in message
    assert "[ONNXRuntimeError]" not in message
    ok = registry.infer(InferRequest("add", "", (Tensor("a", np.ones(2, np.float32)),
                                                  Tensor("b", np.ones(1, np.float32)))))
    np.testing.assert_array_equal(ok.outputs[0].array, [2.0, 2.0])
    assert code(lambda: registry.load("mlp", {"config": "{}"}))[0] == "INVALID_ARGUMENT"
    assert code(lambda: registry.load("mlp", {"canary": {"canary_s": -1}})) == (
        "INVALID_ARGUMENT", "load parameters: canary.canary_s: -1 is not allowed: expected "
        "a number 0.01..3600")
    registry.unload("mlp", {})
    assert code(lambda: registry.infer(request())) == (
        "UNAVAILABLE", "model mlp is not loaded (unloaded)")
    assert code(lambda: registry.model_metadata("mlp", ""))[0] == "UNAVAILABLE"


def test_unload_load_and_the_index(registry: ModelRegistry, repo: Path) -> None:
    registry.unload("mlp", {})
    assert registry.model_ready("mlp", "") is False
    assert registry.ready()  # an unloaded model does not make the server unready
    rows = registry.index(False)
    assert [(e.name, e.version, e.state, e.reason) for e in rows] == [
        ("demo", "1", "READY", ""), ("mlp", "", "UNAVAILABLE", "unloaded")]
    assert [e.name for e in registry.index(True)] == ["demo"]
    assert registry.statistics("mlp", "") == []
    registry.load("mlp", {})
    assert registry.model_ready("mlp", "") and registry.model_ready("mlp", "1")
    with pytest.raises(ServeError) as unserved:
        registry.model_ready("mlp", "2")
    assert unserved.value.code == "NOT_FOUND"
    assert registry.infer(request()).version == "1"
    put(repo, "later", 1, onnx_models.mlp)  # added after start: listed, served once loaded
    assert ("later", "", "UNAVAILABLE", "not loaded") in [
        (e.name, e.version, e.state, e.reason) for e in registry.index(False)]
    assert code(lambda: registry.infer(request("later")))[0] == "UNAVAILABLE"
    registry.load("later", {})
    assert registry.infer(request("later")).version == "1"


def test_a_bad_model_at_start_is_listed_with_its_error(repo: Path) -> None:
    put(repo, "broken", 1, lambda path: path.write_bytes(b"not onnx") and path)
    (repo / "badcfg").mkdir()
    (repo / "badcfg" / "config.yaml").write_text("precision: bf16\n")
    made = ModelRegistry(repo, {}, cpu_factory, probe_interval_s=60)
    made.start()
    try:
        rows = {e.name: e for e in made.index(False)}
        assert made.ready() and rows["mlp"].state == "READY"
        assert rows["broken"].state == "UNAVAILABLE"
        assert rows["broken"].reason.startswith("model broken version 1: ")
        assert "not an ONNX model" in rows["broken"].reason
        assert rows["badcfg"].reason == (f"{repo / 'badcfg' / 'config.yaml'}: precision: "
                                         "'bf16' is not allowed: expected one of fp32, "
                                         "fp16, int8")
        status, message = code(lambda: made.load("badcfg", {}))
        assert status == "INVALID_ARGUMENT" and "precision" in message
        assert code(lambda: made.infer(request("broken")))[0] == "UNAVAILABLE"
    finally:
        made.stop()


def test_a_pinned_digest_that_does_not_match_is_refused(registry: ModelRegistry,
                                                        repo: Path) -> None:
    import hashlib

    path = put(repo, "mlp", 2, onnx_models.dynamic_batch_mlp)
    actual = hashlib.sha256(path.read_bytes()).hexdigest()
    pinned = "0" * 64
    (repo / "mlp" / "config.yaml").write_text(f"sha256: {{2: '{pinned}'}}\n")
    status, message = code(lambda: registry.load("mlp", {}))
    assert status == "INVALID_ARGUMENT"
    assert actual in message and pinned in message and "version 2" in message
    assert registry.infer(request()).version == "1"  # what served before still serves
    (repo / "mlp" / "config.yaml").write_text(f"sha256: {{2: '{actual}'}}\n")
    registry.load("mlp", {})
    assert registry.infer(request()).version == "2"
    assert registry.model_config("mlp").parameters["sha256.2"] == actual


def test_version_policies_pick_what_serves(registry: ModelRegistry, repo: Path) -> None:
    for number in (2, 3):
        put(repo, "mlp", number, onnx_models.mlp)
    cfg = repo / "mlp" / "config.yaml"
    for text, versions in (("version_policy: {latest: 2}", ("2", "3")),
                           ("version_policy: all", ("1", "2", "3")),
                           ("version_policy: {specific: [1, 3]}", ("1", "3")),
                           ("", ("3",))):
        cfg.write_text(text + "\n")
        registry.load("mlp", {})
        assert registry.model_metadata("mlp", "").versions == versions, text
        assert registry.infer(request()).version == "3"
        assert [e.version for e in registry.index(False) if e.name == "mlp"] == list(versions)
    assert registry.model_config("mlp").version_policy == {"latest": 1}


def test_an_unchanged_version_is_kept_by_a_load(registry: ModelRegistry, repo: Path) -> None:
    registry.infer(request())
    put(repo, "mlp", 2, onnx_models.mlp)
    (repo / "mlp" / "config.yaml").write_text("version_policy: all\n")
    registry.load("mlp", {})
    first = registry.statistics("mlp", "1")[0]
    assert first["execution_count"] == 1  # version 1 kept its session and its figures
    (repo / "mlp" / "config.yaml").write_text("version_policy: all\n"
                                              "instances: [{count: 2, threads: 2}]\n")
    registry.load("mlp", {})  # instances changed: rebuilt
    stats = registry.statistics("mlp", "1")[0]
    assert stats["execution_count"] == 0
    assert stats["edge_agent"]["threads"] == [2, 2]
    assert [i["index"] for i in stats["edge_agent"]["instances"]] == [0, 1]


def test_model_config_view(registry: ModelRegistry, repo: Path) -> None:
    put(repo, "dyn", 1, onnx_models.dynamic_batch_mlp)
    (repo / "dyn" / "config.yaml").write_text(
        "max_batch_size: 8\n"
        "instances: [{count: 2, device: cpu, threads: 1}, {device: gpu:1}]\n"
        "dynamic_batching: {max_queue_delay_us: 100}\n"
        "qos: {class: latency_critical, p99_ms: 12.5, min_rps: 30}\n")
    registry.load("dyn", {})
    view = registry.model_config("dyn")
    assert view.max_batch_size == 8
    assert [s.to_dict() for s in view.inputs] == [
        {"name": "x", "datatype": "FP32", "shape": [64]}]
    assert [s.to_dict() for s in view.outputs] == [
        {"name": "y", "datatype": "FP32", "shape": [10]}]
    assert [(g.kind, g.count, g.gpus) for g in view.instance_groups] == [
        ("KIND_CPU", 2, ()), ("KIND_GPU", 1, (1,))]
    assert view.parameters["dynamic_batching"] == "active"
    assert view.parameters["providers"] == "CPUExecutionProvider"
    # cpu_factory serves every device on the CPU; the server's factory picks backends
    assert view.parameters["backends"] == ("cpu: onnxruntime fp32; cpu: onnxruntime fp32; "
                                           "gpu:1: onnxruntime fp32")
    assert view.parameters["precision"] == "fp32"
    assert {k: v for k, v in view.parameters.items() if k.startswith("qos.")} == {
        "qos.class": "latency_critical", "qos.p99_ms": "12.5", "qos.min_rps": "30"}
    fixed = registry.model_config("mlp")  # [1, 64]: no dynamic first dimension, no batching
    assert fixed.max_batch_size == 0
    assert [s.to_dict() for s in fixed.inputs] == [
        {"name": "x", "datatype": "FP32", "shape": [1, 64]}]
    assert registry.model_config("demo").max_batch_size == 4  # Triton's ONNX default
    (repo / "mlp" / "config.yaml").write_text("max_batch_size: 4\n")
    status, message = code(lambda: registry.load("mlp", {}))
    assert status == "INVALID_ARGUMENT" and "needs a dynamic first dimension" in message


def flaky_factory(broken: threading.Event) -> Callable[..., BuiltSession]:
    """CPU sessions whose calls fail while ``broken`` is set."""
    def factory(path: Path, **kw: Any) -> BuiltSession:
        built = cpu_factory(path, **kw)
        return dataclasses.replace(built, session=Flaky(built.session, broken))
    return factory


def test_a_failing_probe_makes_the_model_unready_until_it_passes(repo: Path) -> None:
    broken = threading.Event()
    factory = flaky_factory(broken)
    made = ModelRegistry(repo, {}, factory, probe_interval_s=0.01)
    made.start()
    try:
        assert made.ready() and made.model_ready("mlp", "")
        broken.set()
        until(lambda: not made.ready())  # the background probe found it
        assert made.model_ready("mlp", "") is False and made.model_ready("mlp", "1") is False
        assert [(e.state, e.reason) for e in made.index(False)] == [
            ("UNAVAILABLE", "probe failed: device lost")]
        assert made.index(True) == []
        assert code(lambda: made.infer(request())) == (
            "UNAVAILABLE", "model mlp version 1 is not ready: probe failed: device lost")
        broken.clear()
        until(made.ready)
        assert made.infer(request()).version == "1"
    finally:
        made.stop()
    assert not made.ready()


def test_a_version_that_fails_its_load_probe_never_serves(repo: Path) -> None:
    broken = threading.Event()
    factory = flaky_factory(broken)
    made = ModelRegistry(repo, {}, factory, probe_interval_s=60)
    made.start()
    try:
        put(repo, "mlp", 2, onnx_models.mlp)
        broken.set()
        status, message = code(lambda: made.load("mlp", {}))
        assert (status, message) == ("INVALID_ARGUMENT",
                                     "model mlp version 2: probe failed: device lost")
        broken.clear()
        assert made.infer(request()).version == "1"
    finally:
        made.stop()


def test_a_new_version_under_traffic_fails_no_request(registry: ModelRegistry,
                                                      repo: Path) -> None:
    put(repo, "mlp", 2, onnx_models.mlp, hidden=64)  # other weights: other answers
    with Traffic(registry) as traffic:
        registry.load("mlp", {})
        until(lambda: traffic.seen("2"))
    assert traffic.errors == []
    for versions in traffic.versions:  # each thread: 1 ... 1 then 2 ... 2
        switch = versions.index("2")
        assert set(versions[:switch]) == {"1"} and set(versions[switch:]) == {"2"}
    np.testing.assert_array_equal(registry.infer(request()).outputs[0].array,
                                  direct(repo / "mlp" / "2" / "model.onnx", x()))
    assert registry.model_metadata("mlp", "").versions == ("2",)


def test_a_failed_load_keeps_the_old_version_serving(registry: ModelRegistry,
                                                     repo: Path) -> None:
    (repo / "mlp" / "2").mkdir()
    (repo / "mlp" / "2" / "model.onnx").write_bytes(b"\x00garbage")
    with Traffic(registry) as traffic:
        status, message = code(lambda: registry.load("mlp", {}))
    assert status == "INVALID_ARGUMENT" and message.startswith("model mlp version 2: ")
    assert traffic.errors == [] and all(set(v) == {"1"} for v in traffic.versions)
    rows = [(e.version, e.state) for e in registry.index(False) if e.name == "mlp"]
    assert rows == [("1", "READY"), ("2", "UNAVAILABLE")]
    assert registry.ready()


def test_canary_of_the_same_model_passes_and_drops_the_old(registry: ModelRegistry,
                                                           repo: Path) -> None:
    put(repo, "mlp", 2, onnx_models.mlp)
    # the same model: only errors could fail it; a p99 bound loose enough that a scheduler
    # stall on a loaded 2-core machine cannot (the latency rule has its own test below)
    registry.load("mlp", {"canary": {**CANARY, "max_p99_ratio": 1000}})
    assert registry.model_metadata("mlp", "").versions == ("2",)
    stats = registry.statistics("mlp", "")
    assert [s["version"] for s in stats] == ["2"]
    assert stats[0]["execution_count"] >= 20  # the probe load ran through infer
    assert registry.index(False)[-1] == registry.index(True)[-1]  # mlp 2 READY


def test_canary_of_a_slow_version_switches_back(registry: ModelRegistry, repo: Path) -> None:
    # ~50 ms a call against the mlp's ~0.03 ms: on a machine busy enough to stall the old
    # version's calls for a time slice or two (seen at factor 300, ~12 ms, with two busy
    # loops beside the suite), its p99 stays far below half of this one's
    put(repo, "mlp", 2, onnx_models.slow_model, factor=1200)
    status, message = code(lambda: registry.load("mlp", {"canary": CANARY}))
    assert status == "FAILED_PRECONDITION"
    assert message.startswith("model mlp version 2: canary failed: p99 ")
    assert "ms above 2x the " in message and message.endswith("version 1 serves again")
    assert registry.model_metadata("mlp", "").versions == ("1",)
    assert registry.infer(request()).version == "1"
    rows = [(e.version, e.state, e.reason) for e in registry.index(False) if e.name == "mlp"]
    assert rows[0] == ("1", "READY", "")
    assert rows[1][:2] == ("2", "UNAVAILABLE") and rows[1][2].startswith("canary failed: p99")


def test_canary_of_a_nan_version_under_traffic_switches_back(registry: ModelRegistry,
                                                             repo: Path) -> None:
    put(repo, "mlp", 2, onnx_models.nan_model)
    with Traffic(registry) as traffic:
        before = sum(map(len, traffic.versions))
        status, message = code(lambda: registry.load("mlp", {"canary": CANARY}))
        after = [len(v) for v in traffic.versions]
        until(lambda: all(len(v) > n + 1 for v, n in zip(traffic.versions, after,
                                                                     strict=True)))
    assert status == "FAILED_PRECONDITION"
    assert "canary failed: error rate 100.0%" in message and "above 1.0%" in message
    assert traffic.errors == []  # the clients got answers all along
    assert sum(map(len, traffic.versions)) > before
    assert all(v[-1] == "1" for v in traffic.versions)
    assert any("2" in v for v in traffic.versions)  # live traffic did reach the canary
    assert registry.model_metadata("mlp", "").versions == ("1",)


def test_statistics_count_the_calls(registry: ModelRegistry, repo: Path) -> None:
    put(repo, "dyn", 1, onnx_models.dynamic_batch_mlp)
    registry.load("dyn", {})
    for batch in (1, 3, 4):
        registry.infer(request("dyn", inputs=x(batch)))
    with pytest.raises(ServeError):
        registry.infer(request("dyn", inputs=x(5)))  # above max_batch_size 4
    with pytest.raises(ServeError):
        registry.infer(request("dyn", inputs=(Tensor("x", np.zeros((1, 3), np.float32)),)))
    before_ms = time.time_ns() // 1_000_000
    registry.infer(request("dyn", "1"))
    [entry] = registry.statistics("dyn", "1")
    assert entry["name"] == "dyn" and entry["version"] == "1"
    assert entry["inference_count"] == 1 + 3 + 4 + 1
    assert entry["execution_count"] == 4
    assert before_ms <= entry["last_inference"] <= time.time_ns() // 1_000_000
    inference = entry["inference_stats"]
    assert inference["success"]["count"] == 4 and inference["fail"]["count"] == 2
    for kind in ("compute_input", "compute_infer", "compute_output"):
        assert inference[kind]["count"] == 4 and inference[kind]["ns"] > 0
    assert inference["success"]["ns"] >= inference["compute_infer"]["ns"]
    assert inference["queue"]["count"] == 4 and inference["queue"]["ns"] > 0
    assert [(b["batch_size"], b["compute_infer"]["count"]) for b in entry["batch_stats"]] == [
        (1, 2), (3, 1), (4, 1)]  # no dynamic_batching: each request ran alone
    ours = entry["edge_agent"]
    assert ours["snapshot"]["count"] == 4 and ours["snapshot"]["errors"] == 2
    assert ours["snapshot"]["latency_ms"]["max"] > 0
    assert ours["stuck"] is False
    assert ours["providers"] == ["CPUExecutionProvider"] and ours["threads"] == [1]
    every = registry.statistics("", "")
    assert [(s["name"], s["version"]) for s in every] == [("demo", "1"), ("dyn", "1"),
                                                          ("mlp", "1")]
    assert code(lambda: registry.statistics("dyn", "7"))[0] == "NOT_FOUND"


def test_a_version_being_built_shows_loading(repo: Path) -> None:
    building, release = threading.Event(), threading.Event()

    def factory(path: Path, **kw: Any) -> BuiltSession:
        if path.parent.name == "2":
            building.set()
            release.wait(10)
        return cpu_factory(path, **kw)

    made = ModelRegistry(repo, {}, factory, probe_interval_s=60)
    made.start()
    try:
        put(repo, "mlp", 2, onnx_models.mlp)
        loader = threading.Thread(target=made.load, args=("mlp", {}))
        loader.start()
        assert building.wait(10)
        assert [(e.version, e.state) for e in made.index(False)] == [
            ("1", "READY"), ("2", "LOADING")]
        assert made.infer(request()).version == "1"  # serves on while the load builds
        release.set()
        loader.join()
        assert [(e.version, e.state) for e in made.index(False)] == [("2", "READY")]
    finally:
        release.set()
        made.stop()


def test_telemetry_reads_each_instances_backend_from_the_statistics(
        registry: ModelRegistry) -> None:
    """What the control plane's telemetry reads comes from the real data plane's entry."""
    from agent.telemetry.backends import instance_backends

    (row,) = instance_backends(registry.statistics("mlp", "1")[0]) or []
    assert (row["instance"], row["backend"], row["precision"]) == (0, "onnxruntime", "fp32")
    assert row["device"] and "CPUExecutionProvider" in (row["providers"] or [])
