"""The ``realtime`` lever on real ONNX Runtime sessions in a real data plane: it lifts the
threads that compute a model's runs to SCHED_FIFO, and the front ends' request threads one
priority below them while any model is lifted (none under a real-time profile, which gives
them its own); it outlives a profile switch and a threads rebuild, a reload drops it, a
version whose intra-op workers spin has no such lever, a lift the kernel refuses leaves
nothing lifted (on any version) and makes it no lever, and no request runs on a thread of
another priority than its model's workers."""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import onnx_models
import pytest
from serving_helpers import cpu_factory
from test_serve_registry import put, until, x

from agent.inference.session import BuiltSession
from agent.kernel.sched import ThreadSched
from agent.serving.core import InferRequest
from agent.serving.errors import ServeError
from agent.serving.levers import LeverChange, parse_change
from agent.serving.registry import ModelRegistry
from agent.serving.server import DataPlane, ServerSettings
from agent.serving.threads import FRONT_PRIORITY, LIFTED_PRIORITY

CPUS = sorted(os.sched_getaffinity(0))
OTHER, FIFO = os.SCHED_OTHER, os.SCHED_FIFO


def data_plane(tmp_path: Path, threads: int = 1) -> DataPlane:
    """Models ``one`` and ``two``, each session with ``threads`` intra-op threads."""
    repository = tmp_path / "repository"
    for model in ("one", "two"):
        put(repository, model, 1, onnx_models.dynamic_batch_mlp)
    return DataPlane(ServerSettings(
        http="127.0.0.1:0", grpc="127.0.0.1:0", repository=repository, builtins={},
        pins={}, token_files=[], max_request_bytes=1 << 20,
        providers=["CPUExecutionProvider"], threads=(threads, 1), cache_dir=None,
        ready_file=tmp_path / "ready.json", metrics="127.0.0.1:0"))


@pytest.fixture
def plane(tmp_path: Path) -> Iterator[DataPlane]:
    made = data_plane(tmp_path)
    made.registry.start()
    yield made
    made.registry.stop()
    made.http_pool.shutdown()


def sched(tid: int) -> tuple[int, int]:
    return os.sched_getscheduler(tid), os.sched_getparam(tid).sched_priority


def model_threads(registry: ModelRegistry, model: str) -> set[int]:
    version = registry._served(model).versions[1]
    return ({tid for session in version.sessions for tid in session.built.worker_tids}
            | set(version.scheduler.tids()))


def front_thread(plane: DataPlane) -> int:
    """A thread of the HTTP front end's pool, started as a request would start it."""
    return int(plane.http_pool.submit(threading.get_native_id).result(timeout=30))


def lift(registry: ModelRegistry, model: str, on: bool) -> None:
    registry.set_levers(model, parse_change({"realtime": on}))


def test_parse_change_reads_realtime() -> None:
    assert parse_change({"realtime": True}) == LeverChange(lift=True, realtime=True)
    assert parse_change({"realtime": False}) == LeverChange(lift=True)
    assert not parse_change({"realtime": True}).rebuilds
    for bad in ("yes", None, 1):
        with pytest.raises(ServeError, match="realtime must be true") as refused:
            parse_change({"realtime": bad})
        assert refused.value.code == "INVALID_ARGUMENT"


def test_a_lift_takes_the_models_threads_and_the_front_ends_while_any_model_is(
        plane: DataPlane) -> None:
    registry, front = plane.registry, front_thread(plane)
    one, two = model_threads(registry, "one"), model_threads(registry, "two")
    assert one and two
    assert registry.statistics("one", "1")[0]["edge_agent"]["levers"]["realtime"] is False
    lift(registry, "one", True)
    assert {sched(tid) for tid in one} == {(FIFO, LIFTED_PRIORITY)}
    assert sched(front) == (FIFO, FRONT_PRIORITY) and FRONT_PRIORITY < LIFTED_PRIORITY
    assert {sched(tid) for tid in two} == {(OTHER, 0)}
    assert registry.statistics("one", "1")[0]["edge_agent"]["levers"]["realtime"] is True
    assert registry.infer(InferRequest("one", "", x())).outputs  # it serves, lifted
    lift(registry, "two", True)
    lift(registry, "one", False)  # two is still lifted: the front end stays
    assert {sched(tid) for tid in one} == {(OTHER, 0)}
    assert {sched(tid) for tid in two} == {(FIFO, LIFTED_PRIORITY)}
    assert sched(front) == (FIFO, FRONT_PRIORITY)
    lift(registry, "two", False)
    assert {sched(tid) for tid in one | two | {front}} == {(OTHER, 0)}
    assert not plane.threads.errors


def test_a_lift_outlives_a_profile_switch_and_a_rebuild_and_a_reload_drops_it(
        plane: DataPlane) -> None:
    registry, front = plane.registry, front_thread(plane)
    lift(registry, "one", True)
    plane.threads.switch(ThreadSched("fifo", 10, CPUS))  # a profile with rt.inference
    assert {sched(tid) for tid in model_threads(registry, "one")} == {(FIFO, 11)}
    assert {sched(tid) for tid in model_threads(registry, "two") | {front}} == {(FIFO, 10)}
    plane.threads.switch(None)
    assert {sched(tid) for tid in model_threads(registry, "one")} == {(FIFO, LIFTED_PRIORITY)}
    assert sched(front) == (FIFO, FRONT_PRIORITY)
    before = registry._served("one").versions[1]
    registry.set_levers("one", parse_change({"threads": 1}))
    until(lambda: registry._served("one").versions[1] is not before, 60)
    rebuilt = model_threads(registry, "one")
    assert rebuilt and {sched(tid) for tid in rebuilt} == {(FIFO, LIFTED_PRIORITY)}
    registry.load("one", {})  # config.yaml's levers again: not lifted
    version = registry._served("one").versions[1]
    assert not version.realtime
    assert {sched(tid) for tid in model_threads(registry, "one") | {front}} == {(OTHER, 0)}
    assert not plane.threads.errors


def test_a_version_whose_workers_spin_has_no_realtime_lever(tmp_path: Path) -> None:
    plane = data_plane(tmp_path, threads=2)  # an ORT worker each, spinning (no profile)
    plane.registry.start()
    try:
        entry = plane.registry.statistics("one", "1")[0]["edge_agent"]
        assert entry["levers"]["realtime"] is None and entry["configured"]["realtime"] is None
        with pytest.raises(ServeError, match="spin") as refused:
            lift(plane.registry, "one", True)
        assert refused.value.code == "FAILED_PRECONDITION"
        assert {sched(tid) for tid in model_threads(plane.registry, "one")} == {(OTHER, 0)}
    finally:
        plane.registry.stop()
        plane.http_pool.shutdown()


class Refusing:
    """A Scheduling whose kernel refuses the last thread of each lift of the model's
    ``refused``-th version and after (no CAP_SYS_NICE for them)."""

    def __init__(self, refused: int = 1) -> None:
        self.calls: list[tuple[list[int], bool]] = []
        self.refused = refused

    def place(self, tids: Iterable[int], cpus: Sequence[int] | None) -> None:
        raise AssertionError("not placed here")

    def lift(self, tids: Iterable[int], on: bool) -> list[str]:
        listed = list(tids)
        self.calls.append((listed, on))
        lifts = sum(1 for _, lifted in self.calls if lifted)
        return [f"thread {listed[-1]}: Operation not permitted"] if on and \
            lifts >= self.refused else []


@pytest.mark.parametrize("refused", [1, 2])
def test_a_lift_the_kernel_refuses_is_put_back_and_answered(tmp_path: Path,
                                                            refused: int) -> None:
    """Refused on the model's first version, or only on its second: either way no version
    stays lifted, the route answers why, and realtime is no lever for the refusing version
    any more (the QoS controller stops asking)."""
    repository = tmp_path / "repository"
    for number in (1, 2):
        put(repository, "one", number, onnx_models.dynamic_batch_mlp)
    (repository / "one" / "config.yaml").write_text(
        "version_policy: {specific: [1, 2]}\n")
    refusing = Refusing(refused)
    registry = ModelRegistry(repository, {}, cpu_factory, probe_interval_s=3600,
                             sched=refusing)
    registry.start()
    try:
        with pytest.raises(ServeError, match="Operation not permitted") as answer:
            lift(registry, "one", True)
        assert answer.value.code == "FAILED_PRECONDITION"
        lifted = [tids for tids, on in refusing.calls if on]
        put_back = [tids for tids, on in refusing.calls if not on]
        assert sorted(map(sorted, lifted)) == sorted(map(sorted, put_back))  # all back
        views = {n: registry.statistics("one", n)[0]["edge_agent"]["levers"]["realtime"]
                 for n in ("1", "2")}
        assert views == ({"1": None, "2": False} if refused == 1 else
                         {"1": False, "2": None}), views
    finally:
        registry.stop()


class Where:
    """A real session that notes the thread each of its runs ran on."""

    def __init__(self, session: Any, ran: list[int]) -> None:
        self._session, self._ran = session, ran

    def run(self, names: Any, feeds: Any, options: Any = None) -> Any:
        self._ran.append(threading.get_native_id())
        return self._session.run(names, feeds, options)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session, name)


def test_a_lifted_caller_runs_no_other_models_request_on_its_own_thread(
        tmp_path: Path) -> None:
    """A request that finds an idle instance runs on its caller's thread, but not where the
    caller runs at another priority than the model's workers: a lifted caller would lend
    an unlifted model's run its lift, an unlifted one take a lifted model's away."""
    repository = tmp_path / "repository"
    for model in ("one", "two"):
        put(repository, model, 1, onnx_models.dynamic_batch_mlp)
    ran: list[int] = []

    def factory(path: Path, **kwargs: Any) -> BuiltSession:
        built = cpu_factory(path, **kwargs)
        return dataclasses.replace(built, session=Where(built.session, ran))

    registry = ModelRegistry(repository, {}, factory, probe_interval_s=3600)
    registry.start()
    try:
        lift(registry, "one", True)
        answers: dict[str, int] = {}

        def lifted_caller() -> None:  # as a front end's thread while "one" is lifted
            os.sched_setscheduler(0, FIFO, os.sched_param(FRONT_PRIORITY))
            for model in ("one", "two"):
                ran.clear()
                registry.infer(InferRequest(model, "", x()))
                answers[model] = ran[-1]
            answers["caller"] = threading.get_native_id()

        caller = threading.Thread(target=lifted_caller)
        caller.start()
        caller.join(30)
        assert answers["one"] in model_threads(registry, "one")  # on its lifted worker
        assert answers["two"] in model_threads(registry, "two")  # not on the lifted caller
        ran.clear()
        registry.infer(InferRequest("two", "", x()))  # an unlifted caller: inline
        assert ran == [threading.get_native_id()]
        ran.clear()
        registry.infer(InferRequest("one", "", x()))  # on the lifted worker, not here
        assert ran[0] in model_threads(registry, "one")
    finally:
        registry.stop()
