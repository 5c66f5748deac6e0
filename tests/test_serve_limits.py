"""A slow run is one request's problem: on real ONNX Runtime sessions, a run past its model's
max_run_ms is cancelled (RunOptions.terminate) and answered DEADLINE_EXCEEDED while another
model keeps answering, and the version is "stuck" (what the supervisor kills for) only when a
cancelled run does not come back; inputs above max_input_elements are refused before any
run; a config.yaml with more threads than the inference CPUs allow is refused at load."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx_models
import pytest
import tritonclient.http as httpclient
from serving_helpers import WrappedSession, cpu_factory
from test_serve_registry import code, direct, put, until
from tritonclient.utils import InferenceServerException

from agent.inference.session import BuiltSession
from agent.serving import scheduler
from agent.serving.core import InferRequest, Tensor
from agent.serving.registry import ModelRegistry
from agent.serving.versions import DYNAMIC_INPUT_ELEMENTS
from agent.serving.watchdog import COMPACT_AT, Watchdog
from tests.test_serve_process import demo_input, http_infer, serve_process


def image(side: int) -> tuple[Tensor, ...]:
    return (Tensor("image", np.full((1, 3, side, side), 0.5, np.float32)),)


def x(value: float = 0.25) -> tuple[Tensor, ...]:
    return (Tensor("x", np.full((1, 64), value, np.float32)),)


@pytest.fixture()
def repo(tmp_path: Path) -> Path:
    path = tmp_path / "repository"
    put(path, "slow", 1, onnx_models.slow_image_model)
    (path / "slow" / "config.yaml").write_text("max_run_ms: 300\n")
    put(path, "mlp", 1, onnx_models.mlp)
    put(path, "batched", 1, onnx_models.slow_image_model, layers=1, batch="N")  # batches 4
    return path


@pytest.fixture()
def registry(repo: Path) -> Iterator[ModelRegistry]:
    made = ModelRegistry(repo, {}, cpu_factory, probe_interval_s=3600, intra_op_threads=1)
    made.start()
    yield made
    made.stop()


def entry(registry: ModelRegistry, model: str) -> dict[str, Any]:
    return registry.statistics(model, "1")[0]


def test_a_run_past_max_run_ms_is_cancelled_while_another_model_answers(
        registry: ModelRegistry, repo: Path) -> None:
    small = registry.infer(InferRequest("slow", "", image(8)))  # the session works
    assert small.outputs[0].array.shape == (1, 3, 8, 8)
    mlp_answer = direct(repo / "mlp" / "1" / "model.onnx", x())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        slow = pool.submit(registry.infer, InferRequest("slow", "", image(1024)))
        answered = 0
        while not slow.done():  # the other model answers all along
            result = registry.infer(InferRequest("mlp", "", x()))
            np.testing.assert_allclose(result.outputs[0].array, mlp_answer, rtol=1e-6)
            answered += 1
        took = time.monotonic() - started
        status, message = code(slow.result)
    assert status == "DEADLINE_EXCEEDED"
    assert message.startswith("model slow version 1: the run was cancelled after ")
    assert message.endswith(" ms, past its max_run_ms 300 (config.yaml)")
    assert answered >= 1
    # cut at 300 ms and one operator later: the whole run takes seconds (300 convolutions
    # over 1024 x 1024, ~15 ms each on one core)
    assert took < 3.0
    stats = entry(registry, "slow")
    assert stats["edge_agent"]["stuck"] is False
    assert stats["edge_agent"]["cancelled"] == 1
    assert stats["inference_stats"]["fail"]["count"] == 1
    assert stats["execution_count"] == 1  # the small run; the cancelled one is not counted
    # the same session serves the next request
    assert registry.infer(InferRequest("slow", "", image(8))).outputs[0].array.shape == (
        1, 3, 8, 8)


class Unstoppable(WrappedSession):
    """A run that ignores ``terminate`` until released: a runtime that does not come back."""

    entered = threading.Event()
    released = threading.Event()

    def run(self, names: Any, feeds: Any, options: Any = None) -> Any:
        if next(iter(feeds.values())).shape[-1] == 16:
            self.entered.set()
            assert self.released.wait(30)
        return super().run(names, feeds, options)


def unstoppable_factory(path: Path, **kw: Any) -> BuiltSession:
    built = cpu_factory(path, **kw)
    return dataclasses.replace(built, session=Unstoppable(built.session))


def test_stuck_means_cancelled_and_not_back_within_the_grace(
        repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scheduler, "CANCEL_GRACE_S", 3600.0)
    made = ModelRegistry(repo, {}, unstoppable_factory, probe_interval_s=3600,
                         intra_op_threads=1)
    made.start()
    Unstoppable.entered.clear()
    Unstoppable.released.clear()
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            held = pool.submit(made.infer, InferRequest("slow", "", image(16)))
            assert Unstoppable.entered.wait(10)
            assert entry(made, "slow")["edge_agent"]["stuck"] is False  # slow, not stuck
            until(lambda: entry(made, "slow")["edge_agent"]["cancelled"] == 1)
            assert entry(made, "slow")["edge_agent"]["stuck"] is False  # within the grace
            monkeypatch.setattr(scheduler, "CANCEL_GRACE_S", 0.05)
            until(lambda: entry(made, "slow")["edge_agent"]["stuck"])  # past it: stuck
            Unstoppable.released.set()
            status, message = code(held.result)
            assert status == "DEADLINE_EXCEEDED" and "max_run_ms 300" in message
        until(lambda: not entry(made, "slow")["edge_agent"]["stuck"])  # it came back
    finally:
        Unstoppable.released.set()
        made.stop()


def test_inputs_above_max_input_elements_are_refused_before_any_run(
        registry: ModelRegistry, repo: Path) -> None:
    # dynamic H and W: DYNAMIC_INPUT_ELEMENTS; the 46 MB request of the report is above
    assert DYNAMIC_INPUT_ELEMENTS == 8_388_608
    refusal = ("INVALID_ARGUMENT", "input image: shape [1, 3, 2000, 2000] holds 12000000 "
               "elements, above the 8388608 model slow version 1 takes for it (config.yaml "
               "max_input_elements)")
    # what a front end calls with the declared shape, before decoding the tensor
    assert code(lambda: registry.check_elements("slow", "", "image", [1, 3, 2000, 2000])) == (
        refusal)
    registry.check_elements("slow", "", "image", [1, 3, 1080, 1920])  # a 1080p frame fits
    # the same cap in all where the batch is dynamic too: four rows do not let it through
    assert code(lambda: registry.check_elements("batched", "", "image", [1, 3, 2000, 2000]))[
        1].endswith("above the 8388608 model batched version 1 takes for it (config.yaml "
                    "max_input_elements)")
    registry.check_elements("batched", "", "image", [4, 3, 640, 640])
    # a dimension alone above the cap, however few elements the shape holds
    assert "has a dimension above the 8388608 elements" in code(
        lambda: registry.check_elements("slow", "1", "image", [1, 3, 10**7, 0]))[1]
    assert code(lambda: registry.check_elements("slow", "", "label", [1]))[1] == (
        "model slow has no input 'label' (its inputs: image)")
    # a static shape: exactly its elements (mlp: [1, 64])
    assert "holds 65 elements, above the 64 model mlp version 1" in code(
        lambda: registry.check_elements("mlp", "", "x", [1, 65]))[1]
    # infer checks again (the backstop): refused without a run
    assert code(lambda: registry.infer(InferRequest("slow", "", image(2000)))) == refusal
    assert entry(registry, "slow")["execution_count"] == 0
    # config.yaml's max_input_elements replaces the default
    (repo / "slow" / "config.yaml").write_text("max_input_elements: 1000\n")
    registry.load("slow", {})
    assert "above the 1000 model slow version 1" in code(
        lambda: registry.infer(InferRequest("slow", "", image(32))))[1]
    assert registry.infer(InferRequest("slow", "", image(16))).version == "1"


class Counting:
    """A factory that counts the sessions it was asked for and builds them on the CPU."""

    def __init__(self) -> None:
        self.threads: list[int | None] = []

    def __call__(self, path: Path, **kw: Any) -> BuiltSession:
        self.threads.append(kw["threads"])
        return cpu_factory(path, **{**kw, "threads": 1})


def test_more_threads_than_the_inference_cpus_allow_are_refused_at_load(
        tmp_path: Path) -> None:
    repo = tmp_path / "repository"
    for name, instances in (("wide", "[{count: 4, threads: 1024}]"),
                            ("many", "[{count: 64}]"),
                            ("fits", "[{count: 2, threads: 2}]")):
        put(repo, name, 1, onnx_models.mlp)
        (repo / name / "config.yaml").write_text(f"instances: {instances}\n")
    factory = Counting()
    made = ModelRegistry(repo, {}, factory, probe_interval_s=3600, intra_op_threads=2)
    made.start()
    try:
        assert factory.threads == [2, 2]  # only "fits" was built
        reasons = {row.name: row.reason for row in made.index(ready_only=False)}
        assert reasons["wide"] == (
            f"{repo}/wide/config.yaml: instances: 4 x 1024 threads is above 2 per CPU that "
            "inference runs on (2 CPUs; allowed: at most 4 threads across the model's "
            "instances, count x threads)")
        assert reasons["many"].startswith(f"{repo}/many/config.yaml: instances: 64 x 1 "
                                          "threads is above 2 per CPU")
        assert reasons["fits"] == ""
        status, message = code(lambda: made.load("wide", {}))
        assert status == "INVALID_ARGUMENT" and message == f"model wide: {reasons['wide']}"
        assert factory.threads == [2, 2]
    finally:
        made.stop()


def test_the_watchdog_cancels_in_deadline_order_and_forgets_finished_runs() -> None:
    watchdog = Watchdog("test-watchdog")
    cancelled: list[str] = []
    done = threading.Event()
    now = time.perf_counter_ns()
    late = watchdog.watch(now + 400_000_000, lambda _: (cancelled.append("late"), done.set()))
    watchdog.watch(now + 100_000_000, lambda _: cancelled.append("early"))
    finished = watchdog.watch(now + 10**10, lambda _: cancelled.append("finished"))
    assert finished.finish()  # came back in time: never cancelled
    assert done.wait(10)
    assert cancelled == ["early", "late"]
    assert not late.finish() and late.cancelled_ns >= now + 400_000_000
    # runs that finish before their deadlines do not pile up in the heap
    for _ in range(5 * COMPACT_AT):
        assert watchdog.watch(time.perf_counter_ns() + 10**12, lambda _: None).finish()
    assert len(watchdog._heap) < 2 * COMPACT_AT


def test_edge_agent_serve_answers_a_slow_request_504_and_a_huge_one_400_and_serves_on(
        tmp_path: Path) -> None:
    """The report's case against the real process: a valid request whose run is slow costs
    that request (504), not the process; the 46 MB [1, 3, 2000, 2000] request is a 400."""
    repository = tmp_path / "state" / "repository"
    put(repository, "slow", 1, onnx_models.slow_image_model)
    (repository / "slow" / "config.yaml").write_text(
        "max_run_ms: 300\ninstances: [{count: 1, threads: 1}]\n")
    with serve_process(tmp_path) as plane:
        http = httpclient.InferenceServerClient(plane["http"], network_timeout=60)

        def send(side: int) -> None:
            given = httpclient.InferInput("image", [1, 3, side, side], "FP32")
            given.set_data_from_numpy(np.full((1, 3, side, side), 0.5, np.float32))
            http.infer("slow", [given])

        with pytest.raises(InferenceServerException) as caught:
            send(1024)
        assert caught.value.status() == "504"
        assert "model slow version 1: the run was cancelled after " in str(
            caught.value.message())
        assert "past its max_run_ms 300 (config.yaml)" in str(caught.value.message())
        with pytest.raises(InferenceServerException) as caught:
            send(2000)
        assert caught.value.status() == "400"
        assert "shape [1, 3, 2000, 2000] holds 12000000 elements, above the 8388608" in str(
            caught.value.message())
        output, version = http_infer(http, "demo", demo_input())  # the process serves on
        assert output.shape == (1, 10) and version == "1"
        assert plane["process"].poll() is None
