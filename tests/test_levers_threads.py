"""The ``threads`` and ``cpus`` levers on real ONNX Runtime sessions: the route starts a
threads rebuild and answers at once, the new versions serve once swapped (their threads
really pinned: the thread that calls ORT and ORT's own workers), ``cpus`` alone moves the
serving versions' threads at once, a stream of requests across both fails none, a second
rebuild (or a move of CPUs) while one runs is refused, a failed rebuild leaves the old
versions serving and says why, and a reload serves config.yaml's values again."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx_models
import pytest
from http_helpers import HttpServer
from serving_helpers import cpu_factory, streaming
from test_serve_registry import direct, put, until

from agent.inference.session import BuiltSession
from agent.kernel.parsers import format_cpulist
from agent.serving.access import Access
from agent.serving.core import InferRequest, Tensor
from agent.serving.errors import ServeError
from agent.serving.http_client import HttpClient
from agent.serving.levers import LeverChange, parse_change
from agent.serving.registry import ModelRegistry
from agent.serving.server import DataPlane, ServerSettings
from agent.serving.threads import InferenceThreads

TOKEN = "threads-levers-token"
CPUS = sorted(os.sched_getaffinity(0))
LAST = CPUS[-1]  # a CPU to pin to: on a 2-CPU machine, cpu 1
MODELS = {
    "one": "max_batch_size: 8\ndynamic_batching: {max_queue_delay_us: 500}\n",
    "two": "max_batch_size: 8\ninstances: [{count: 2}]\n",
}
REBUILD_S = 60.0  # a rebuild of two small sessions on a loaded 2-core machine


class Recording:
    """A real session that notes, for each run, the CPUs its calling thread may run on."""

    def __init__(self, session: Any, runs: list[frozenset[int]]) -> None:
        self._session, self._runs = session, runs

    def run(self, names: Any, feeds: Any, options: Any = None) -> Any:
        self._runs.append(frozenset(os.sched_getaffinity(0)))
        return self._session.run(names, feeds, options)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session, name)


class Factory:
    """cpu_factory with a gate (``hold`` set: a build waits for ``release``), a failure
    (a build for ``fail_threads`` threads raises) and recorded runs."""

    def __init__(self) -> None:
        self.hold, self.entered, self.release = (threading.Event(), threading.Event(),
                                                 threading.Event())
        self.fail_threads: int | None = None
        self.runs: list[frozenset[int]] = []

    def __call__(self, path: Path, *, sha256: str | None, providers: Sequence[str] | None,
                 threads: int | None, device: str = "auto",
                 precision: str = "fp32") -> BuiltSession:
        if threads is not None and threads == self.fail_threads:
            raise RuntimeError(f"no session with {threads} threads today")
        if self.hold.is_set():
            self.entered.set()
            assert self.release.wait(REBUILD_S)
        built = cpu_factory(path, sha256=sha256, providers=providers, threads=threads)
        return dataclasses.replace(built, session=Recording(built.session, self.runs))


Served = tuple[ModelRegistry, HttpClient, Path, Factory]


@pytest.fixture()
def served(tmp_path: Path) -> Iterator[Served]:
    repo = tmp_path / "repository"
    for name, config in MODELS.items():
        put(repo, name, 1, onnx_models.dynamic_batch_mlp)
        (repo / name / "config.yaml").write_text(config)
    token = tmp_path / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    factory = Factory()
    # two inference CPUs: config.yaml may give a model 4 threads in all (THREADS_PER_CPU)
    registry = ModelRegistry(repo, {}, factory, probe_interval_s=3600, intra_op_threads=2)
    registry.start()
    server = HttpServer(registry, Access([token], everything=False))
    client = HttpClient(f"http://{server.url}", token=TOKEN, timeout_s=10)
    try:
        yield registry, client, repo, factory
    finally:
        factory.release.set()
        client.close()
        server.stop()
        registry.stop()


def ours(registry: ModelRegistry, model: str) -> dict[str, Any]:
    return dict(registry.statistics(model, "1")[0]["edge_agent"])


def rebuilt(registry: ModelRegistry, model: str) -> dict[str, Any]:
    """The model's rebuild once it ended (done or failed)."""
    until(lambda: (ours(registry, model)["rebuild"] or {}).get("state") in ("done", "failed"),
          REBUILD_S)
    return dict(ours(registry, model)["rebuild"])


def x(mark: float = 0.25) -> tuple[Tensor, ...]:
    return (Tensor("x", np.full((1, 64), mark, np.float32)),)


def cpus_allowed(tid: int) -> str:
    status = Path(f"/proc/self/task/{tid}/status").read_text()
    return next(line.split()[1] for line in status.splitlines()
                if line.startswith("Cpus_allowed_list:"))


def test_the_route_starts_a_rebuild_that_serves_the_new_threads_once_swapped(
        served: Served) -> None:
    registry, client, _, _ = served
    before = ours(registry, "one")
    assert (before["levers"]["threads"], before["levers"]["cpus"]) == (2, None)
    assert before["configured"]["threads"] == 2 and before["rebuild"] is None
    status, _, body = client.request("POST", "/v2/repository/models/one/levers",
                                     b'{"threads": 3, "max_queue_delay_us": 0}')
    assert status == 200
    answer = json.loads(body)
    assert answer["rebuilding"] is True
    assert answer["versions"]["1"]["max_queue_delay_us"] == 0  # instant: at once
    state = rebuilt(registry, "one")
    assert (state["state"], state["threads"], state["cpus"], state["error"]) == (
        "done", 3, None, "")
    now = ours(registry, "one")
    assert (now["levers"]["threads"], now["threads"]) == (3, [3])
    assert now["levers"]["max_queue_delay_us"] == 0  # the instant lever was carried over
    assert (now["configured"]["threads"], now["configured"]["cpus"]) == (2, None)
    assert registry.infer(InferRequest("one", "", x())).version == "1"


def test_placed_versions_run_only_on_their_cpus_and_a_reload_puts_config_back(
        served: Served) -> None:
    registry, client, _, factory = served
    assert ours(registry, "two")["levers"]["threads"] == 1  # 2 CPUs shared by 2 sessions
    client.set_levers("two", {"cpus": [LAST], "threads": 2})
    assert rebuilt(registry, "two")["state"] == "done"
    levers = ours(registry, "two")["levers"]
    assert (levers["threads"], levers["cpus"]) == (2, [LAST])
    version = registry._served("two").versions[1]
    ort_workers = {tid for session in version.sessions for tid in session.built.worker_tids}
    schedulers = {thread.native_id for thread in version.scheduler._threads}
    assert len(ort_workers) == 2 and len(schedulers) == 2  # one intra-op worker a session
    for tid in ort_workers | schedulers:
        assert cpus_allowed(tid) == str(LAST), tid
    factory.runs.clear()
    for _ in range(20):
        registry.infer(InferRequest("two", "", x()))
    assert factory.runs and set(factory.runs) == {frozenset([LAST])}  # never on ours
    registry.load("two", {})  # config.yaml's: no placement, its threads
    after = ours(registry, "two")
    assert (after["levers"]["threads"], after["levers"]["cpus"]) == (1, None)
    factory.runs.clear()
    for _ in range(5):
        registry.infer(InferRequest("two", "", x()))
    assert set(factory.runs) == {frozenset(CPUS)}


def threads_of(registry: ModelRegistry, model: str) -> set[int]:
    """The threads that compute the model's runs: ORT's intra-op workers, the scheduler's."""
    version = registry._served(model).versions[1]
    return ({tid for session in version.sessions for tid in session.built.worker_tids}
            | set(version.scheduler.tids()))


def test_cpus_alone_move_the_serving_threads_at_once_and_a_rebuild_keeps_them(
        served: Served) -> None:
    """No rebuild for a placement: the route's answer already shows it, the same version
    serves with every thread of its runs on the CPUs, ``null`` puts them back on every CPU,
    a threads rebuild afterwards builds on the CPUs placed, and a reload drops them."""
    registry, client, _, factory = served
    client.set_levers("two", {"threads": 2})  # an intra-op worker each, beside the caller
    last = rebuilt(registry, "two")
    assert last["state"] == "done"
    version = registry._served("two").versions[1]
    tids = threads_of(registry, "two")
    assert len(tids) == 4 and {cpus_allowed(tid) for tid in tids} == {format_cpulist(CPUS)}
    status, _, body = client.request("POST", "/v2/repository/models/two/levers",
                                     b'{"cpus": [%d]}' % LAST)
    answer = json.loads(body)
    assert status == 200 and answer["rebuilding"] is False
    assert answer["versions"]["1"]["cpus"] == [LAST]
    assert ours(registry, "two")["rebuild"] == last  # none since
    assert registry._served("two").versions[1] is version
    assert {cpus_allowed(tid) for tid in tids} == {str(LAST)}
    factory.runs.clear()
    for _ in range(20):
        registry.infer(InferRequest("two", "", x()))
    assert factory.runs and set(factory.runs) == {frozenset([LAST])}  # never on ours
    client.set_levers("two", {"cpus": None})
    assert {cpus_allowed(tid) for tid in tids} == {format_cpulist(CPUS)}
    assert ours(registry, "two")["levers"]["cpus"] is None
    client.set_levers("two", {"cpus": [CPUS[0]]})
    client.set_levers("two", {"threads": 1})
    assert rebuilt(registry, "two")["cpus"] == [CPUS[0]]
    assert registry._served("two").versions[1] is not version
    assert {cpus_allowed(tid) for tid in threads_of(registry, "two")} == {str(CPUS[0])}
    registry.load("two", {})  # config.yaml's threads: built anew, on every CPU
    assert ours(registry, "two")["levers"]["cpus"] is None
    assert {cpus_allowed(tid) for tid in threads_of(registry, "two")} == {
        format_cpulist(CPUS)}
    unchanged = registry._served("two").versions[1]
    client.set_levers("two", {"cpus": [LAST]})
    registry.load("two", {})  # as config.yaml but for its CPUs: unpinned where it is
    assert registry._served("two").versions[1] is unchanged
    assert ours(registry, "two")["levers"]["cpus"] is None
    assert {cpus_allowed(tid) for tid in threads_of(registry, "two")} == {
        format_cpulist(CPUS)}


def test_a_version_is_built_only_once_its_workers_have_started(tmp_path: Path) -> None:
    """Each scheduler worker runs its start (adopted as an inference thread, pinned) before
    its version can serve: a move of the CPUs then finds every worker adopted, and none
    pins itself afterwards to the CPUs it was built with."""
    go, started = threading.Event(), []

    def worker_start() -> None:
        go.wait(REBUILD_S)
        started.append(threading.get_native_id())

    repo = tmp_path / "repository"
    put(repo, "one", 1, onnx_models.dynamic_batch_mlp)
    registry = ModelRegistry(repo, {}, cpu_factory, probe_interval_s=3600,
                             worker_start=worker_start)
    registry.start_loading()
    try:
        assert not registry.wait_loaded(0.5), "served before its worker started"
        go.set()
        assert registry.wait_loaded(REBUILD_S)
        assert set(registry._served("one").versions[1].scheduler.tids()) <= set(started)
    finally:
        go.set()
        registry.stop()


def test_rebuilds_under_a_stream_of_requests_fail_none(served: Served) -> None:
    registry, client, repo, _ = served
    expected = direct(repo / "two" / "1" / "model.onnx", x())
    with streaming(registry, "two", x(), expected) as (failures, answered):
        for change in ({"threads": 1}, {"cpus": [LAST]}, {"threads": 2, "cpus": [CPUS[0]]},
                       {"cpus": None, "threads": None}):
            at = answered[0]
            client.set_levers("two", change)
            assert rebuilt(registry, "two")["state"] == "done"
            until(lambda at=at: answered[0] > at + 10, REBUILD_S)  # served after the swap
    assert not failures, failures[:3]
    levers = ours(registry, "two")["levers"]
    assert (levers["threads"], levers["cpus"]) == (1, None)  # config.yaml's again


def test_a_second_rebuild_while_one_runs_is_refused(served: Served) -> None:
    registry, client, _, factory = served
    factory.hold.set()
    client.set_levers("one", {"threads": 1})
    assert factory.entered.wait(REBUILD_S)
    assert ours(registry, "one")["rebuild"]["state"] == "rebuilding"
    for change in ({"threads": 2, "max_queue_delay_us": 0},
                   {"cpus": [LAST], "max_queue_delay_us": 0}):  # its versions are replaced
        with pytest.raises(ServeError) as refused:
            client.set_levers("one", change)
        assert refused.value.code == "UNAVAILABLE"
        assert "model one is rebuilding already" in refused.value.message
    assert ours(registry, "one")["levers"]["max_queue_delay_us"] == 500  # nothing changed
    assert registry.infer(InferRequest("one", "", x())).version == "1"  # the old one serves
    factory.hold.clear()
    factory.release.set()
    assert rebuilt(registry, "one")["threads"] == 1
    assert ours(registry, "one")["levers"]["cpus"] is None


def test_a_failed_rebuild_leaves_the_old_versions_serving_and_says_why(
        served: Served, caplog: pytest.LogCaptureFixture) -> None:
    registry, client, _, factory = served
    factory.fail_threads = 4
    with caplog.at_level(logging.WARNING, "agent.serving.rebuild"):
        client.set_levers("one", {"threads": 4})
        state = rebuilt(registry, "one")
    assert state["state"] == "failed"
    assert "model one version 1: no session with 4 threads today" in state["error"]
    assert any("rebuild for threads 4, cpus None failed" in r.getMessage()
               for r in caplog.records)
    assert ours(registry, "one")["levers"]["threads"] == 2
    assert registry.infer(InferRequest("one", "", x())).version == "1"
    client.set_levers("one", {"threads": 1})  # a failure does not block the next one
    assert rebuilt(registry, "one")["state"] == "done"


def test_values_out_of_range_are_refused_naming_the_key_and_change_nothing(
        served: Served) -> None:
    registry, client, _, _ = served
    allowed = format_cpulist(CPUS)
    cases = {
        # 2 inference CPUs, 2 sessions: at most 2 threads each
        ("two", '{"threads": 3}'): "threads must be null (config.yaml's) or an integer "
                                   "1..2 for model two (2 sessions, at most 2 threads per "
                                   "inference CPU, 2 CPUs)",
        ("one", '{"threads": 5}'): "threads must be null (config.yaml's) or an integer "
                                   "1..4 for model one (1 sessions, at most 2 threads per "
                                   "inference CPU, 2 CPUs)",
        ("one", '{"threads": 0}'): "threads must be null (config.yaml's) or an integer "
                                   "1..1024",
        ("one", '{"threads": 1.5}'): "threads must be null (config.yaml's) or an integer "
                                     "1..1024",
    }
    for cpus in ("[4096]", "[]", f"[{LAST}, {LAST}]", '"0"', "[true]", "[-1]"):
        cases[("one", f'{{"cpus": {cpus}}}')] = (
            "cpus must be null (no placement) or a list of distinct CPU ids this data plane "
            f"may run on (allowed: {allowed})")
    for (model, body), message in cases.items():
        reply = client.request("POST", f"/v2/repository/models/{model}/levers",
                               body.encode(), {"Authorization": f"Bearer {TOKEN}"})
        assert reply[0] == 400, body
        assert message in reply[2].decode(), (body, reply[2])
    for model in MODELS:
        assert ours(registry, model)["rebuild"] is None
        assert ours(registry, model)["levers"]["cpus"] is None


def test_parse_change_reads_threads_and_cpus() -> None:
    assert parse_change({"threads": 2}) == LeverChange(rethread=True, threads=2)
    assert parse_change({"threads": None}) == LeverChange(rethread=True)
    assert parse_change({"cpus": [LAST, CPUS[0]]}) == LeverChange(
        place=True, cpus=tuple(sorted({LAST, CPUS[0]})))
    assert not parse_change({"cpus": None}).rebuilds  # moved where they are
    assert parse_change({"cpus": None, "threads": 2}).rebuilds
    assert not parse_change({"admit_rps": None}).rebuilds


def test_a_placement_outlives_a_profile_switch(tmp_path: Path) -> None:
    pool = InferenceThreads(None)
    ready, done = threading.Event(), threading.Event()
    tid = [0]

    def worker() -> None:
        pool.adopt_current()
        tid[0] = threading.get_native_id()
        ready.set()
        done.wait(10)

    thread = threading.Thread(target=worker, name="infer-test")
    thread.start()
    try:
        assert ready.wait(10)
        pool.place([tid[0]], [LAST])
        assert cpus_allowed(tid[0]) == str(LAST)
        pool.switch(None)  # the baseline is every CPU, but for a placed thread its own
        assert cpus_allowed(tid[0]) == str(LAST)
        assert not pool.errors
    finally:
        done.set()
        thread.join(10)


def test_a_rebuild_that_ends_after_stop_installs_nothing(
        served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    registry, client, _, factory = served
    monkeypatch.setattr("agent.serving.registry.STOP_WAIT_S", 0.1)
    factory.hold.set()
    client.set_levers("one", {"threads": 1})
    assert factory.entered.wait(REBUILD_S)
    registry.stop()  # gives up waiting for the rebuild's lock
    factory.release.set()
    until(lambda: (registry._rebuilds.view("one") or {}).get("state") == "failed", REBUILD_S)
    assert registry._rebuilds.view("one")["error"] == "the server stopped during the rebuild"
    assert registry._slots["one"].served is None


def test_the_data_planes_placement_holds_through_a_profile_switch(tmp_path: Path) -> None:
    """The server's wiring: its factory adopts each session's ORT workers as inference
    threads (the profile's CPUs), then the lever pins them, and a switch keeps the pin."""
    repository = tmp_path / "repository"
    put(repository, "one", 1, onnx_models.dynamic_batch_mlp)
    plane = DataPlane(ServerSettings(
        http="127.0.0.1:0", grpc="127.0.0.1:0", repository=repository, builtins={},
        pins={}, token_files=[], max_request_bytes=1 << 20,
        providers=["CPUExecutionProvider"], threads=(2, 1), cache_dir=None,
        ready_file=tmp_path / "ready.json", metrics="127.0.0.1:0"))
    plane.registry.start()
    try:
        plane.registry.set_levers("one", parse_change({"cpus": [LAST]}))
        tids = threads_of(plane.registry, "one")
        assert len(tids) == 2
        assert {cpus_allowed(tid) for tid in tids} == {str(LAST)}
        plane.threads.switch(None)  # a rollback to no profile: every CPU, but not for these
        assert {cpus_allowed(tid) for tid in tids} == {str(LAST)}
        plane.registry.set_levers("one", parse_change({"cpus": None}))  # the profile's again
        assert {cpus_allowed(tid) for tid in tids} == {format_cpulist(CPUS)}
        assert not plane.threads.errors
    finally:
        plane.registry.stop()
