"""The scheduler of a served version on real ONNX Runtime sessions: priorities, deadlines, a
bounded queue, dynamic batching (outputs identical to unbatched runs), instances sharing
one queue, a failing run, a swap that drains the old queue, and priority/timeout through
tritonclient over gRPC and HTTP.

Ordering is made deterministic with a gate: a session wrapper that holds the run of a
request marked HOLD until the test releases it, so everything sent meanwhile queues; the
wrapper records each run's requests (by the marker in their first element) in order.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx_models
import onnxruntime as ort
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from http_helpers import HttpServer
from hypothesis import given, settings
from hypothesis import strategies as st
from serving_helpers import WrappedSession, cpu_factory
from test_serve_registry import direct, put, until
from tritonclient.utils import InferenceServerException

from agent.inference.session import BuiltSession
from agent.serving.access import Access
from agent.serving.batching import cut, signature
from agent.serving.core import InferRequest, InferResult, Tensor
from agent.serving.errors import ServeError
from agent.serving.grpc_api import build_grpc_server
from agent.serving.pending import Pending, PendingQueue
from agent.serving.policy import SchedulePolicy
from agent.serving.registry import ModelRegistry

HOLD = 1000.0  # a request whose first element is this is held in its run
BROKEN = 666.0  # ... makes its run fail


class Gate:
    """Holds the run of a HOLD request until ``release``; records every run's markers."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.released = threading.Event()
        self.lock = threading.Lock()
        self.runs: list[list[float]] = []
        self.threads: dict[float, str] = {}  # a marked request's run: its thread

    def release(self) -> None:
        self.released.set()

    def reset(self) -> None:
        """Ready to hold the next HOLD request (after the last one was released)."""
        self.entered.clear()
        self.released.clear()

    def served(self) -> list[list[float]]:
        """The runs of marked requests (markers 1 and above), HOLD's left out."""
        with self.lock:
            runs = [[m for m in run if m >= 1 and m != HOLD] for run in self.runs]
        return [run for run in runs if run]


class Gated(WrappedSession):
    def __init__(self, session: Any, gate: Gate) -> None:
        super().__init__(session)
        self.gate = gate

    def run(self, names: Any, feeds: Any, options: Any = None) -> Any:
        first = next(iter(feeds.values()))
        marks = [float(v) for v in first.reshape(first.shape[0], -1)[:, 0]]
        with self.gate.lock:
            self.gate.runs.append(marks)
            self.gate.threads.update((m, threading.current_thread().name) for m in marks)
        if HOLD in marks:
            self.gate.entered.set()
            assert self.gate.released.wait(10), "the test never released its gate"
        if BROKEN in marks:
            raise RuntimeError("[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : broken input")
        return self.session.run(names, feeds, options)


def gated_factory(gate: Gate) -> Callable[..., BuiltSession]:
    def factory(path: Path, **kw: Any) -> BuiltSession:
        built = cpu_factory(path, **kw)
        return dataclasses.replace(built, session=Gated(built.session, gate))
    return factory


MODELS = {
    # fixed batch 1: max_batch_size 0, but the queue's priorities and bounds apply
    "prio": (onnx_models.mlp, "dynamic_batching: {priority_levels: 3, "
             "default_priority_level: 3, preferred_batch_size: [4]}\n"),
    "queued": (onnx_models.mlp, "dynamic_batching: {queue: {max_size: 2, timeout_us: 50000}}\n"),
    # no timeout: a refused request can only have been refused at once, however busy the box
    "full": (onnx_models.mlp, "dynamic_batching: {queue: {max_size: 2}}\n"),
    # three levels in a queue of three, no timeout: what is refused or shed is so at once
    "levels": (onnx_models.mlp, "dynamic_batching: {priority_levels: 3, "
               "default_priority_level: 3, queue: {max_size: 3}}\n"),
    "override": (onnx_models.mlp, "dynamic_batching: {queue: {allow_timeout_override: true}}\n"),
    "fixed": (onnx_models.mlp, "dynamic_batching: {queue: {allow_timeout_override: false}}\n"),
    "batch": (onnx_models.dynamic_batch_mlp, "max_batch_size: 8\n"
              "dynamic_batching: {preferred_batch_size: [4], max_queue_delay_us: 0}\n"),
    "cnn": (onnx_models.conv_net, "max_batch_size: 8\n"
            "dynamic_batching: {preferred_batch_size: [2, 6]}\n"),
    "twice": (onnx_models.dynamic_batch_mlp, "instances: [{count: 2}]\n"),
    "busy": (onnx_models.dynamic_batch_mlp, "max_batch_size: 8\ninstances: [{count: 2}]\n"
             "dynamic_batching: {preferred_batch_size: [4, 8], max_queue_delay_us: 2000}\n"),
}


@pytest.fixture()
def repo(tmp_path: Path) -> Path:
    path = tmp_path / "repository"
    for name, (make, config) in MODELS.items():
        put(path, name, 1, make)
        (path / name / "config.yaml").write_text(config)
    return path


@pytest.fixture()
def gate() -> Iterator[Gate]:
    made = Gate()
    yield made
    made.release()  # never leave a worker held


@pytest.fixture()
def registry(repo: Path, gate: Gate) -> Iterator[ModelRegistry]:
    made = ModelRegistry(repo, {}, gated_factory(gate), probe_interval_s=3600,
                         intra_op_threads=4)
    made.start()
    yield made
    made.stop()


def x(mark: float, rows: int = 1, features: int = 64) -> tuple[Tensor, ...]:
    array = np.random.default_rng(int(mark)).standard_normal((rows, features))
    array = array.astype(np.float32)
    array[:, 0] = mark
    return (Tensor("x", array),)


def image(mark: float, rows: int = 1) -> tuple[Tensor, ...]:
    array = np.random.default_rng(int(mark)).random((rows, 3, 64, 64)).astype(np.float32)
    array[:, 0, 0, 0] = mark
    return (Tensor("image", array),)


def req(model: str, inputs: tuple[Tensor, ...], **parameters: Any) -> InferRequest:
    return InferRequest(model, "", inputs, parameters=parameters)


class Sender:
    """Requests sent from threads, each answer (or error) kept by its marker."""

    def __init__(self, registry: ModelRegistry) -> None:
        self.registry = registry
        self.pool = concurrent.futures.ThreadPoolExecutor(16)
        self.sent: dict[float, concurrent.futures.Future[InferResult]] = {}

    def send(self, request: InferRequest, queued: int | None = None) -> None:
        """Send from a thread; with ``queued``, wait until the queue holds that many, so
        the order of arrival is the order of sending."""
        mark = float(request.inputs[0].array.reshape(-1)[0])
        self.sent[mark] = self.pool.submit(self.registry.infer, request)
        if queued is not None:
            until(lambda: depth(self.registry, request.model) == queued)

    def result(self, mark: float) -> InferResult:
        return self.sent[mark].result(10)

    def close(self) -> None:
        self.pool.shutdown(wait=True)


@pytest.fixture()
def sender(registry: ModelRegistry) -> Iterator[Sender]:
    made = Sender(registry)
    yield made
    made.close()


def stats(registry: ModelRegistry, model: str) -> dict[str, Any]:
    return registry.statistics(model, "1")[0]


def depth(registry: ModelRegistry, model: str) -> int:
    return int(stats(registry, model)["edge_agent"]["queue"]["depth"])


def hold(sender: Sender, gate: Gate, model: str, inputs: tuple[Tensor, ...] | None = None
         ) -> None:
    """Keep the model's worker busy with a HOLD request until ``gate.release``."""
    sender.send(req(model, inputs or x(HOLD)))
    assert gate.entered.wait(10)


def code(call: Callable[[], Any]) -> tuple[str, str]:
    with pytest.raises(ServeError) as caught:
        call()
    return caught.value.code, caught.value.message


# --- priorities ----------------------------------------------------------------------------


def test_higher_priority_first_fifo_within_a_level(registry: ModelRegistry, gate: Gate,
                                                   sender: Sender) -> None:
    hold(sender, gate, "prio")
    for queued, (mark, priority) in enumerate([(1, 0), (2, 3), (3, 0), (10, 1), (20, 2),
                                               (11, 1), (21, 2)], 1):
        sender.send(req("prio", x(mark), priority=priority), queued=queued)
    gate.release()
    for mark in (1, 2, 3, 10, 11, 20, 21):
        assert sender.result(mark).version == "1"
    assert gate.served() == [[10], [11], [20], [21], [1], [2], [3]]  # never batched: mbs 0
    entry = stats(registry, "prio")
    assert entry["execution_count"] == entry["inference_count"] == 8
    assert [b["batch_size"] for b in entry["batch_stats"]] == [1]


def test_bad_priority_and_timeout_parameters_are_refused(registry: ModelRegistry) -> None:
    levels = "parameter priority must be an integer 0..3 (this model's priority_levels"
    timeout = "parameter timeout must be an integer 0..1099511627776 (microseconds), not "
    for parameters, words in [({"priority": 4}, f"{levels}: 1 is the highest, 0 its default "
                                                "3), not 4"),
                              ({"priority": True}, f"{levels}"),
                              ({"priority": True}, "not True"),
                              ({"priority": "1"}, "not '1'"),
                              ({"priority": -1}, "not -1"),
                              ({"priority": 1.0}, "not 1.0"),
                              ({"priority": 10**5000}, "not an integer of 16610 bits"),
                              ({"timeout": -1}, f"{timeout}-1"),
                              # past ~9.2e15 us a wait overflowed (and the request still ran)
                              ({"timeout": 10**16}, f"{timeout}10000000000000000"),
                              ({"timeout": 2**64}, f"{timeout}an integer of 65 bits"),
                              ({"timeout": float("inf")}, f"{timeout}inf"),
                              ({"timeout": 1.5}, f"{timeout}1.5"),
                              ({"timeout": "100"}, f"{timeout}'100'"),
                              ({"timeout": [1]}, f"{timeout}a list")]:
        status, message = code(lambda p=parameters: registry.infer(req("prio", x(1), **p)))
        assert status == "INVALID_ARGUMENT" and words in message, parameters
    # a model without priority levels has one: 1 (or 0, the default) only
    assert registry.infer(req("batch", x(1), priority=1)).version == "1"
    assert code(lambda: registry.infer(req("batch", x(1), priority=2)))[0] == (
        "INVALID_ARGUMENT")
    assert stats(registry, "prio")["inference_stats"]["fail"]["count"] == 14


def test_an_overflowing_timeout_is_400_over_http_and_never_runs(
        registry: ModelRegistry, gate: Gate, sender: Sender) -> None:
    """A queued request whose timeout no clock can wait for was a 500 (OverflowError) and
    still ran; it is a 400 naming the parameter, and nothing of it runs."""
    server = HttpServer(registry, Access([], everything=False))
    try:
        hold(sender, gate, "override")  # the request would queue behind it
        body = {"inputs": [{"name": "x", "shape": [1, 64], "datatype": "FP32",
                            "data": x(5)[0].array.reshape(-1).tolist()}]}
        for value in (10**16, 2**63 - 1, 2**64, -5, 1.5, "1000", True):
            reply = server.request("POST", "/v2/models/override/infer", json.dumps(
                {**body, "parameters": {"timeout": value}}))
            assert reply.status == 400, (value, reply.body)
            assert "parameter timeout must be an integer 0..1099511627776" in (
                reply.json()["error"])
        gate.release()
        assert sender.result(HOLD).version == "1"
        assert gate.served() == []  # none of them ran
    finally:
        server.stop()


# --- deadlines and bounds ------------------------------------------------------------------


def test_the_queue_timeout_answers_deadline_exceeded_unrun(registry: ModelRegistry,
                                                           gate: Gate, sender: Sender) -> None:
    hold(sender, gate, "queued")
    started = time.monotonic()
    status, message = code(lambda: registry.infer(req("queued", x(1))))
    assert time.monotonic() - started >= 0.05
    assert status == "DEADLINE_EXCEEDED"
    assert message == ("the request waited in the queue of model queued version 1 past its "
                       "timeout of 50 ms")
    until(lambda: stats(registry, "queued")["edge_agent"]["cancelled"] == 1)
    gate.release()  # the held run (on its caller's thread) meets the terminate flag in ORT
    # it went past the same timeout: cancelled, its request answered DEADLINE_EXCEEDED
    with pytest.raises(ServeError) as caught:
        sender.result(HOLD)
    assert caught.value.code == "DEADLINE_EXCEEDED"
    assert caught.value.message.startswith("model queued version 1: the run was cancelled "
                                           "after ")
    assert caught.value.message.endswith(" ms, past the request's timeout of 50 ms")
    assert gate.served() == []  # it never ran
    entry = stats(registry, "queued")
    assert entry["inference_stats"]["fail"]["count"] == 2
    assert entry["edge_agent"]["queue"]["expired"] == 1
    assert entry["edge_agent"]["cancelled"] == 1


def test_a_request_timeout_is_honoured_only_when_the_queue_allows_it(
        registry: ModelRegistry, gate: Gate, sender: Sender) -> None:
    hold(sender, gate, "override")
    status, _ = code(lambda: registry.infer(req("override", x(1), timeout=20_000)))
    assert status == "DEADLINE_EXCEEDED"
    sender.send(req("override", x(2)), queued=1)  # no timeout: waits as long as it takes
    gate.release()
    assert sender.result(2).version == "1" and gate.served() == [[2]]

    gate.reset()
    hold(sender, gate, "fixed")
    sender.send(req("fixed", x(3), timeout=1000), queued=1)
    time.sleep(0.05)  # let its 1 ms pass: the queue does not allow the override
    gate.release()
    assert sender.result(3).version == "1"


def test_a_full_queue_answers_unavailable_at_once(registry: ModelRegistry, gate: Gate,
                                                  sender: Sender) -> None:
    hold(sender, gate, "full")
    sender.send(req("full", x(1)), queued=1)
    sender.send(req("full", x(2)), queued=2)
    started = time.monotonic()
    status, message = code(lambda: registry.infer(req("full", x(3))))
    assert time.monotonic() - started < 1.0  # nothing to wait for: refused, not queued
    assert (status, message) == ("UNAVAILABLE", "queue of model full version 1 is full (2)")
    gate.release()
    assert sender.result(1).version == sender.result(2).version == "1"
    entry = stats(registry, "full")
    assert entry["edge_agent"]["queue"]["full"] == 1
    assert entry["inference_stats"]["fail"]["count"] == 1


def test_a_full_queue_sheds_its_newest_lowest_request_for_a_higher_one(
        registry: ModelRegistry, gate: Gate, sender: Sender) -> None:
    """Clients flooding the lowest level cannot starve a higher one: a full queue admits
    it by shedding the newest request of the lowest level below it (503 saying so)."""
    hold(sender, gate, "levels")
    sender.send(req("levels", x(1)), queued=1)  # the default level, 3
    sender.send(req("levels", x(2), priority=2), queued=2)
    sender.send(req("levels", x(3)), queued=3)  # level 3, the newest: shed first
    assert code(lambda: registry.infer(req("levels", x(4)))) == (  # nothing below 3
        "UNAVAILABLE", "queue of model levels version 1 is full (3)")
    sender.send(req("levels", x(10), priority=1))
    with pytest.raises(ServeError) as caught:
        sender.result(3)
    assert caught.value.code == "UNAVAILABLE" and caught.value.http_status == 503
    assert caught.value.message == (
        "queue of model levels version 1 is full (3): this request (priority level 3) was "
        "shed for one of higher priority 1; try again")
    sender.send(req("levels", x(11), priority=2))  # sheds 1, the last one at level 3
    with pytest.raises(ServeError) as caught:
        sender.result(1)
    assert "(priority level 3) was shed for one of higher priority 2" in caught.value.message
    assert code(lambda: registry.infer(req("levels", x(5), priority=2)))[0] == (
        "UNAVAILABLE")  # only levels 1 and 2 are queued: nothing below 2 to shed
    gate.release()
    for mark in (10, 2, 11):
        assert sender.result(mark).version == "1"
    assert gate.served() == [[10], [2], [11]]
    queue = stats(registry, "levels")["edge_agent"]["queue"]
    assert (queue["shed"], queue["full"]) == (2, 2)


def test_privileged_levels_need_the_token(repo: Path, gate: Gate) -> None:
    """serve.privileged_priority 1: only a caller with the token (``trusted``) may ask for
    level 1; the default level is open to all, also where it is level 1 (one-level models)."""
    made = ModelRegistry(repo, {}, gated_factory(gate), probe_interval_s=3600,
                         intra_op_threads=4, privileged_priority=1)
    made.start()
    server = HttpServer(made, Access([], everything=False))
    pool = concurrent.futures.ThreadPoolExecutor(4)
    grpc_server = build_grpc_server(made, Access([], everything=False),
                                    max_request_bytes=1 << 20, executor=pool)
    try:
        refusal = ("priority 1 needs the bearer token (serve.privileged_priority 1); without "
                   "it ask for 2..3, or 0 for the default 3")
        with pytest.raises(ServeError) as caught:
            made.infer(req("prio", x(1), priority=1))
        assert (caught.value.code, caught.value.message) == ("PERMISSION_DENIED", refusal)
        assert caught.value.http_status == 403
        body = {"inputs": [{"name": "x", "shape": [1, 64], "datatype": "FP32",
                            "data": x(1)[0].array.reshape(-1).tolist()}],
                "parameters": {"priority": 1}}
        reply = server.request("POST", "/v2/models/prio/infer", json.dumps(body))
        assert (reply.status, reply.json()) == (403, {"error": refusal})
        port = grpc_server.add_insecure_port("127.0.0.1:0")
        grpc_server.start()
        client = triton_grpc.InferenceServerClient(url=f"127.0.0.1:{port}")
        with pytest.raises(InferenceServerException) as refused:
            client.infer("prio", [_grpc_input(x(1)[0].array)], priority=1)
        client.close()
        assert refused.value.status() == "StatusCode.PERMISSION_DENIED"
        assert refusal in str(refused.value.message())
        for parameters in ({"priority": 2}, {"priority": 3}, {"priority": 0}, {}):
            assert made.infer(req("prio", x(2), **parameters)).version == "1"
        trusted = InferRequest("prio", "", x(3), parameters={"priority": 1}, trusted=True)
        assert made.infer(trusted).version == "1"
        # one level (no priority_levels): 1 is the default, what every client gets anyway
        assert made.infer(req("batch", x(4), priority=1)).version == "1"
        assert gate.served() == [[2], [2], [2], [2], [3], [4]]
    finally:
        grpc_server.stop(None)
        pool.shutdown(wait=True)
        server.stop()
        made.stop()


# --- dynamic batching ----------------------------------------------------------------------


def test_batches_form_at_the_preferred_size_and_split_back_exactly(
        registry: ModelRegistry, gate: Gate, sender: Sender, repo: Path) -> None:
    hold(sender, gate, "batch")
    sizes = {1: 1, 2: 1, 3: 2, 4: 1, 5: 3, 6: 1}
    for queued, (mark, rows) in enumerate(sizes.items(), 1):
        sender.send(req("batch", x(mark, rows)), queued=queued)
    gate.release()
    path = repo / "batch" / "1" / "model.onnx"
    for mark, rows in sizes.items():
        got = sender.result(mark).outputs[0].array
        assert got.shape == (rows, 10)
        np.testing.assert_array_equal(got, direct(path, x(mark, rows)))  # bit for bit
    # 1+1+2 = 4 preferred: cut there; 1+3 = 4 again; the last one alone (no delay)
    assert gate.served() == [[1, 2, 3, 3], [4, 5, 5, 5], [6]]
    entry = stats(registry, "batch")
    assert entry["inference_count"] == 1 + 9 and entry["execution_count"] == 4
    assert [(b["batch_size"], b["compute_infer"]["count"]) for b in entry["batch_stats"]] == [
        (1, 2), (4, 2)]
    inference = entry["inference_stats"]
    assert inference["success"]["count"] == inference["queue"]["count"] == 7
    assert inference["compute_infer"]["count"] == 7  # per request, as Triton counts
    assert entry["edge_agent"]["queue"]["wait_ms"]["max"] > 0


def test_the_demo_cnn_batched_equals_its_unbatched_runs(registry: ModelRegistry, gate: Gate,
                                                         sender: Sender, repo: Path) -> None:
    hold(sender, gate, "cnn", image(HOLD))
    sizes = {1: 2, 2: 1, 3: 3, 4: 1}
    for queued, (mark, rows) in enumerate(sizes.items(), 1):
        sender.send(req("cnn", image(mark, rows)), queued=queued)
    gate.release()
    path = repo / "cnn" / "1" / "model.onnx"
    for mark, rows in sizes.items():
        np.testing.assert_array_equal(sender.result(mark).outputs[0].array,
                                      direct(path, image(mark, rows)))
    assert gate.served() == [[1, 1, 2, 3, 3, 3], [4]]  # 6 preferred, then what is left
    assert stats(registry, "cnn")["execution_count"] == 3


def test_cut_and_the_queue_keep_order_and_shapes() -> None:
    assert cut([1, 1, 2], [4], can_grow=True, waited=False) == 3  # the largest preferred
    assert cut([1, 1], [4], can_grow=True, waited=False) == 0  # wait for more
    assert cut([1, 2, 1], [3, 8], can_grow=False, waited=False) == 2  # full: the preferred
    assert cut([1, 2, 2], [4], can_grow=True, waited=True) == 3  # waited: what is there
    policy = SchedulePolicy(max_batch=8)
    queue = PendingQueue(policy, "model m version 1")
    wide, narrow = x(1)[0], Tensor("x", np.zeros((1, 32), np.float32))
    items = [Pending((t,), ("y",), 1, 1, signature((t,))) for t in (wide, wide, narrow, wide)]
    for item in items:
        queue.put(item)
    assert queue.take() == items[:2]  # the other shape stops the batch: never overtaken
    assert queue.take() == items[2:3]
    assert queue.take() == items[3:]


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(st.integers(1, 8), min_size=1, max_size=30),
       preferred=st.lists(st.integers(1, 8), max_size=3), max_batch=st.integers(1, 8))
def test_a_draining_queue_runs_everything_once_in_order_within_bounds(
        rows: list[int], preferred: list[int], max_batch: int) -> None:
    policy = SchedulePolicy(max_batch=max_batch, delay_ns=10**12,
                            preferred=tuple(sorted({p for p in preferred if p <= max_batch})))
    queue = PendingQueue(policy, "model m version 1")
    items = [Pending(x(1, min(r, max_batch)), ("y",), min(r, max_batch), 1,
                     signature(x(1, 1))) for r in rows]
    for item in items:
        queue.put(item)
    queue.close()  # draining: nothing waits for the delay
    runs = []
    while (run := queue.take()) is not None:
        runs.append(run)
    assert [item for run in runs for item in run] == items
    assert all(sum(item.rows for item in run) <= max_batch for run in runs)


def test_sixteen_clients_on_two_instances_get_their_own_rows(registry: ModelRegistry,
                                                              repo: Path) -> None:
    alone = ort.InferenceSession(str(repo / "busy" / "1" / "model.onnx"),
                                 providers=["CPUExecutionProvider"])

    def client(seed: int) -> list[str]:
        wrong = []
        for n in range(10):
            mark, rows = 1 + seed * 10 + n, 1 + (seed + n) % 3
            got = registry.infer(req("busy", x(mark, rows))).outputs[0].array
            if not np.array_equal(got, alone.run(None, {"x": x(mark, rows)[0].array})[0]):
                wrong.append(f"{mark}")
        return wrong

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        assert [w for w in pool.map(client, range(16)) if w] == []
    entry = stats(registry, "busy")
    assert entry["inference_stats"]["success"]["count"] == 160
    assert entry["execution_count"] < 160  # requests did share runs
    assert max(b["batch_size"] for b in entry["batch_stats"]) > 1
    assert all(i["executions"] > 0 for i in entry["edge_agent"]["instances"])


# --- instances, failures, swaps ------------------------------------------------------------


def test_two_instances_share_one_queue(registry: ModelRegistry, gate: Gate,
                                       sender: Sender) -> None:
    hold(sender, gate, "twice")  # one instance held ...
    assert registry.infer(req("twice", x(1))).version == "1"  # ... the other serves
    gate.release()
    sender.result(HOLD)
    entry = stats(registry, "twice")
    assert sorted(i["executions"] for i in entry["edge_agent"]["instances"]) == [1, 1]
    assert all(i["busy_ns"] > 0 for i in entry["edge_agent"]["instances"])
    assert entry["edge_agent"]["threads"] == [2, 2]  # the server's 4 shared out


def test_an_idle_instance_runs_the_request_on_its_callers_thread(registry: ModelRegistry,
                                                                 gate: Gate) -> None:
    registry.infer(req("twice", x(1)))  # nothing queued, no batching: no hand-off
    registry.infer(req("batch", x(2)))  # a batch waits for company on a worker
    assert gate.threads[1] == threading.current_thread().name
    assert gate.threads[2] == "infer-batch-0"
    assert stats(registry, "twice")["execution_count"] == 1


class WatchedCondition(threading.Condition):
    """A queue's condition that says when a thread first waits on it."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = threading.Event()
        self.waits = 0

    def wait(self, timeout: float | None = None) -> bool:
        self.waits += 1
        self.waiting.set()
        return super().wait(timeout)


def test_a_restored_instance_is_claimable_again_without_waking_its_worker() -> None:
    """Back-to-back requests at concurrency 1 all run on their callers' threads: an instance
    handed back with nothing queued is idle again at once, its worker left asleep (waking it
    only to wait again cost each request a thread switch, and a request that came before
    the worker had listed itself idle again went through the queue)."""
    queue = PendingQueue(SchedulePolicy(), "model m version 1")
    ready = WatchedCondition()
    queue._ready = ready
    worker = threading.Thread(target=queue.take, args=(0,), daemon=True)
    worker.start()
    assert ready.waiting.wait(10)
    with ready:  # the worker cannot take the lock in here: nothing but restore relists it
        assert queue.claim() == 0
        queue.restore(0)
        assert queue.claim() == 0
        queue.restore(0)
    assert ready.waits == 1  # never woken by the two restores
    queue.close()  # closing wakes it, and with nothing queued it is done
    worker.join(10)
    assert not worker.is_alive()


def test_a_failing_batch_fails_its_requests_and_the_worker_goes_on(
        registry: ModelRegistry, gate: Gate, sender: Sender) -> None:
    hold(sender, gate, "batch")
    sender.send(req("batch", x(BROKEN)), queued=1)
    sender.send(req("batch", x(2)), queued=2)
    gate.release()
    for mark in (BROKEN, 2):  # joined in one run: both get its error
        with pytest.raises(ServeError) as caught:
            sender.result(mark)
        assert caught.value.code == "INVALID_ARGUMENT"
        assert caught.value.message == ("model batch version 1: onnxruntime: broken input")
    assert gate.served()[-1] == [BROKEN, 2]
    assert registry.infer(req("batch", x(3))).version == "1"  # the worker lives
    assert stats(registry, "batch")["inference_stats"]["fail"]["count"] == 2


def test_a_swap_drains_the_old_queue_and_sends_new_requests_on(
        registry: ModelRegistry, gate: Gate, sender: Sender, repo: Path) -> None:
    hold(sender, gate, "batch")
    sender.send(req("batch", x(1)), queued=1)
    old = registry._served("batch").versions[1]
    put(repo, "batch", 2, onnx_models.dynamic_batch_mlp)
    registry.load("batch", {})
    assert old.closed
    assert registry.infer(req("batch", x(2))).version == "2"  # the new version serves
    gate.release()
    assert sender.result(HOLD).version == sender.result(1).version == "1"  # drained
    assert old.scheduler.join(5)  # and its workers are gone
    with pytest.raises(ServeError) as caught:
        old.infer(req("batch", x(3)))
    assert caught.value.message == "model batch version 1 no longer serves"


# --- through the front ends ----------------------------------------------------------------


def _grpc_input(array: np.ndarray) -> Any:
    tensor = triton_grpc.InferInput("x", list(array.shape), "FP32")
    tensor.set_data_from_numpy(array)
    return tensor


def test_priority_and_timeout_through_tritonclient_grpc(registry: ModelRegistry,
                                                        gate: Gate) -> None:
    pool = concurrent.futures.ThreadPoolExecutor(16)
    server = build_grpc_server(registry, Access([], everything=False),
                               max_request_bytes=1 << 20, executor=pool)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    client = triton_grpc.InferenceServerClient(url=f"127.0.0.1:{port}")
    try:
        def infer(model: str, mark: float, **kw: Any) -> Any:
            return client.infer(model, [_grpc_input(x(mark)[0].array)], **kw)

        sends = concurrent.futures.ThreadPoolExecutor(8)
        held = sends.submit(infer, "prio", HOLD)
        assert gate.entered.wait(10)
        low = sends.submit(infer, "prio", 1.0)  # no priority: the default level 3
        until(lambda: depth(registry, "prio") == 1)
        high = sends.submit(infer, "prio", 10.0, priority=1)
        until(lambda: depth(registry, "prio") == 2)
        gate.release()
        for future in (held, low, high):
            assert future.result(10).as_numpy("y").shape == (1, 10)
        assert gate.served() == [[10], [1]]

        gate.reset()
        held = sends.submit(infer, "override", HOLD)
        assert gate.entered.wait(10)
        with pytest.raises(InferenceServerException) as caught:
            infer("override", 2.0, priority=1, timeout=20_000)
        assert caught.value.status() == "StatusCode.DEADLINE_EXCEEDED"
        gate.release()
        assert held.result(10).as_numpy("y").shape == (1, 10)
        sends.shutdown(wait=True)
    finally:
        client.close()
        server.stop(None)
        pool.shutdown(wait=True)


def test_deadline_exceeded_is_504_over_http(registry: ModelRegistry, gate: Gate,
                                            sender: Sender) -> None:
    server = HttpServer(registry, Access([], everything=False))
    client = triton_http.InferenceServerClient(server.url)
    try:
        hold(sender, gate, "override")
        tensor = triton_http.InferInput("x", [1, 64], "FP32")
        tensor.set_data_from_numpy(x(1)[0].array)
        with pytest.raises(InferenceServerException) as caught:
            client.infer("override", [tensor], priority=1, timeout=20_000)
        assert caught.value.status() == "504"
        assert "past its timeout of 20 ms" in str(caught.value.message())
        gate.release()
        assert sender.result(HOLD).version == "1"
    finally:
        client.close()
        server.stop()
