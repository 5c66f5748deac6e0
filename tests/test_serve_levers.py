"""The QoS controller's instant levers executed by the data plane, live, on real ONNX Runtime
sessions behind the real HTTP front end: a shorter queue delay frees a batch waiting for
company at once, an admission cap refuses above its rate and lifts, levers toggled under a
stream of requests fail none of them, and the route takes only the token and only a
well-formed request."""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx_models
import pytest
from http_helpers import HttpServer
from serving_helpers import cpu_factory, streaming
from test_serve_registry import direct, put, until

from agent.serving.access import Access
from agent.serving.core import InferRequest, Tensor
from agent.serving.errors import ServeError
from agent.serving.http_client import HttpClient
from agent.serving.levers import Admission, LeverChange, parse_change
from agent.serving.registry import ModelRegistry

TOKEN = "levers-test-token"
MODELS = {
    # a batch of one waits up to 10 s for company: only a lever change frees it sooner
    "waits": "max_batch_size: 8\ndynamic_batching: {preferred_batch_size: [8], "
             "max_queue_delay_us: 10000000}\n",
    "busy": "max_batch_size: 8\ninstances: [{count: 2}]\n"
            "dynamic_batching: {preferred_batch_size: [4, 8], max_queue_delay_us: 2000}\n",
    "alone": "max_batch_size: 0\n",
}


@pytest.fixture()
def served(tmp_path: Path) -> Iterator[tuple[ModelRegistry, HttpClient, Path]]:
    repo = tmp_path / "repository"
    for name, config in MODELS.items():
        make = onnx_models.mlp if name == "alone" else onnx_models.dynamic_batch_mlp
        put(repo, name, 1, make)
        (repo / name / "config.yaml").write_text(config)
    token = tmp_path / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)  # a token others can read proves nothing (access.read_token)
    registry = ModelRegistry(repo, {}, cpu_factory, probe_interval_s=3600, intra_op_threads=4)
    registry.start()
    server = HttpServer(registry, Access([token], everything=False))
    client = HttpClient(f"http://{server.url}", token=TOKEN, timeout_s=10)
    try:
        yield registry, client, repo
    finally:
        client.close()
        server.stop()
        registry.stop()


def x(mark: float, rows: int = 1) -> tuple[Tensor, ...]:
    return (Tensor("x", np.full((rows, 64), mark, np.float32)),)


def levers(registry: ModelRegistry, model: str) -> dict[str, Any]:
    return dict(registry.statistics(model, "1")[0]["edge_agent"]["levers"])


def test_a_shorter_queue_delay_frees_the_waiting_batch_at_once(
        served: tuple[ModelRegistry, HttpClient, Path]) -> None:
    registry, client, repo = served
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        waiting = pool.submit(registry.infer, InferRequest("waits", "", x(0.5)))
        until(lambda: registry.statistics("waits", "1")[0]["edge_agent"]["queue"]["depth"]
              == 1)
        assert not waiting.done()
        answer = client.set_levers("waits", {"max_queue_delay_us": 0})
        assert answer == {"1": {"max_queue_delay_us": 0, "preferred_batch_size": [8],
                                "max_batch_size": 8, "admit_rps": None, "not_admitted": 0,
                                "threads": 4, "cpus": None,
                                "realtime": None}}  # its 4 threads spin: no lever
        # well inside the 10 s it would otherwise have waited
        result = waiting.result(timeout=8)
        np.testing.assert_array_equal(result.outputs[0].array,
                                      direct(repo / "waits" / "1" / "model.onnx", x(0.5)))
    finally:
        pool.shutdown(wait=True)
    entry = registry.statistics("waits", "1")[0]["edge_agent"]
    assert entry["levers"]["max_queue_delay_us"] == 0
    assert entry["configured"]["max_queue_delay_us"] == 10_000_000  # config.yaml's, kept


def test_a_load_serves_the_files_levers_again_and_keeps_the_sessions(
        served: tuple[ModelRegistry, HttpClient, Path]) -> None:
    """The README's promise ('a reload serves the file's values again'): the version kept
    (its sessions and figures) had kept the controller's queue delay and cap."""
    registry, client, _ = served
    configured = levers(registry, "busy")
    client.set_levers("busy", {"max_queue_delay_us": 0, "preferred_batch_size": [2],
                               "admit_rps": 3})
    registry.infer(InferRequest("busy", "", x(0.5)))
    before = registry.statistics("busy", "1")[0]
    client.load("busy")
    after = registry.statistics("busy", "1")[0]
    assert after["edge_agent"]["levers"] == configured | {"not_admitted": 0}
    assert (configured["max_queue_delay_us"], configured["preferred_batch_size"],
            configured["admit_rps"]) == (2000, [4, 8], None)  # config.yaml's
    assert after["inference_count"] == before["inference_count"] == 1  # the same version


def test_levers_moved_under_a_stream_of_requests_fail_none(
        served: tuple[ModelRegistry, HttpClient, Path]) -> None:
    registry, client, repo = served
    expected = direct(repo / "busy" / "1" / "model.onnx", x(0.25))
    with streaming(registry, "busy", x(0.25), expected) as (failures, answered):
        settings = [{"max_queue_delay_us": 0, "preferred_batch_size": [2]},
                    {"max_queue_delay_us": 5000, "preferred_batch_size": [4, 8]},
                    {"preferred_batch_size": []}, {"max_queue_delay_us": 100},
                    {"admit_rps": 1_000_000}, {"admit_rps": None}]
        for turn in range(60):
            client.set_levers("busy", settings[turn % len(settings)])
    assert not failures, failures[:3]
    assert answered[0] > 0
    assert levers(registry, "busy")["admit_rps"] is None


def test_an_admission_cap_refuses_above_its_rate_and_lifts(
        served: tuple[ModelRegistry, HttpClient, Path]) -> None:
    registry, client, _ = served
    client.set_levers("alone", {"admit_rps": 0.001})  # one request, then one per 1,000 s
    assert registry.infer(InferRequest("alone", "", x(0.1))).version == "1"
    with pytest.raises(ServeError) as refused:
        registry.infer(InferRequest("alone", "", x(0.1)))
    assert refused.value.code == "UNAVAILABLE" and refused.value.http_status == 503
    assert refused.value.message == (
        "model alone version 1 admits at most 0.001 requests/s now (the QoS controller "
        "holds it for a model of a higher class); try again")
    now = levers(registry, "alone")
    assert (now["admit_rps"], now["not_admitted"]) == (0.001, 1)
    client.set_levers("alone", {"admit_rps": None})
    for _ in range(5):
        assert registry.infer(InferRequest("alone", "", x(0.1))).version == "1"


def test_the_route_takes_only_the_token_and_a_well_formed_request(
        served: tuple[ModelRegistry, HttpClient, Path], tmp_path: Path) -> None:
    registry, client, _ = served
    anonymous = HttpClient(client.base_url, timeout_s=10)
    try:
        with pytest.raises(ServeError) as refused:
            anonymous.set_levers("busy", {"max_queue_delay_us": 0})
        assert refused.value.code == "UNAUTHENTICATED"
    finally:
        anonymous.close()
    cases = {
        "alone": ({"max_queue_delay_us": 0}, "INVALID_ARGUMENT",
                  "model alone version 1 does not batch (max_batch_size 0): it has no queue "
                  "delay or preferred batch size to change"),
        "busy": ({"preferred_batch_size": [16]}, "INVALID_ARGUMENT",
                 "preferred_batch_size 16 is above the max_batch_size 8 of model busy "
                 "version 1"),
        "nothing": ({"admit_rps": 1}, "NOT_FOUND", "unknown model 'nothing'"),
    }
    for model, (document, code, message) in cases.items():
        with pytest.raises(ServeError) as caught:
            client.set_levers(model, document)
        assert (caught.value.code, caught.value.message) == (code, message)
    # a refused request changed nothing
    assert levers(registry, "busy")["preferred_batch_size"] == [4, 8]
    for body in ("[]", "{}", '{"max_queue_delay_us": -1}', '{"speed": 1}',
                 '{"admit_rps": true}', '{"preferred_batch_size": [0]}', "not json"):
        reply = client.request("POST", "/v2/repository/models/busy/levers", body.encode(),
                               {"Authorization": f"Bearer {TOKEN}"})
        assert reply[0] == 400, body
        assert "error" in json.loads(reply[2])


def test_parse_change_bounds_every_value() -> None:
    assert parse_change({"max_queue_delay_us": 0, "preferred_batch_size": [4, 2, 4],
                         "admit_rps": 2}) == LeverChange(0, (2, 4), True, 2.0)
    assert parse_change({"admit_rps": None}) == LeverChange(admit=True)
    assert parse_change({"max_queue_delay_us": 7}) == LeverChange(delay_us=7)
    refused = [{"max_queue_delay_us": 10_000_001}, {"max_queue_delay_us": 1.5},
               {"max_queue_delay_us": False}, {"preferred_batch_size": list(range(1, 18))},
               {"preferred_batch_size": [1 << 17]}, {"preferred_batch_size": "4"},
               {"admit_rps": 0}, {"admit_rps": 1e7}, {"admit_rps": "1"}, {"x" * 5000: 1},
               [], None, {}]
    for document in refused:
        with pytest.raises(ServeError) as caught:
            parse_change(document)
        assert caught.value.code == "INVALID_ARGUMENT"
        assert len(caught.value.message) < 200


def test_admission_without_a_cap_admits_everything_and_counts_nothing() -> None:
    admission = Admission()
    assert all(admission.admit() for _ in range(10_000)) and admission.refused == 0
    admission.set_rate(0.001)
    assert [admission.admit() for _ in range(3)] == [True, False, False]
    assert admission.refused == 2


def admitted(cap: float, offered: float, seconds: float, jitter: float) -> int:
    """Requests an admission cap of ``cap``/s lets through from ``offered``/s arriving for
    ``seconds``, each up to ``jitter`` of its period late (seeded: a client's own delays)."""
    rng = np.random.default_rng(7)
    now = [0]
    admission = Admission(clock=lambda: now[0])
    admission.set_rate(cap)
    period = 1e9 / offered
    passed = 0
    for n in range(int(offered * seconds)):
        now[0] = int((n + rng.uniform(0.0, jitter)) * period)
        passed += admission.admit()
    return passed


def test_admission_cap_admits_its_rate_from_a_late_client_and_no_more() -> None:
    # as many offered as the cap, each up to half a period late: all but the odd one pass
    assert admitted(4.0, 4.0, 100, 0.5) >= 396
    # three times the cap, jittered: the cap's rate, never more than a burst above it
    assert 396 <= admitted(4.0, 12.0, 100, 0.5) <= 402
    assert 1990 <= admitted(20.0, 60.0, 100, 0.9) <= 2002
    # the burst: at most max(2, 10 % of the rate) at once after a quiet stretch
    now = [0]
    admission = Admission(clock=lambda: now[0])
    admission.set_rate(4.0)
    now[0] = 10 ** 10
    assert [admission.admit() for _ in range(4)] == [True, True, False, False]
