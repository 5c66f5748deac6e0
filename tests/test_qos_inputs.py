"""What the QoS controller reads each window: figures and levers from a real registry's
statistics, the requests it shapes for the levers route, and objectives from config.yaml."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx_models
import pytest
from serving_helpers import cpu_factory
from test_serve_registry import put

from agent.control.qos import ADMIT, DELAY, PREFERRED, Figures, Levers, Objective
from agent.service.qos_inputs import Objectives, Served, Windows, lever_request, levers_of
from agent.serving.core import InferRequest, Tensor
from agent.serving.errors import ServeError
from agent.serving.levers import LeverChange
from agent.serving.registry import ModelRegistry


def view(delay: int, preferred: list[int], batch: int, rate: float | None = None
         ) -> dict[str, object]:
    return {"max_queue_delay_us": delay, "preferred_batch_size": preferred,
            "max_batch_size": batch, "admit_rps": rate, "not_admitted": 0}


def test_levers_of_reads_the_largest_preferred_size_or_the_max_batch() -> None:
    assert levers_of(view(2000, [2, 4], 8)) == Levers(2000, 4)
    assert levers_of(view(2000, [], 8, 3.5)) == Levers(2000, 8, 3.5)
    assert levers_of(view(0, [], 0)) == Levers(0, 0)  # no batching: no batching levers
    assert levers_of(view(0, [], 0) | {"realtime": True}).realtime is True
    assert levers_of(view(0, [], 0) | {"realtime": None}).realtime is None  # no lever


@pytest.mark.parametrize(("configured", "largest", "sent"), [
    ([2, 4, 8], 4, [2, 4]), ([2, 4, 8], 3, [2]), ([2, 4, 8], 1, [1]), ([2, 4, 8], 8, [2, 4, 8]),
    ([], 4, [4]), ([], 8, []),
])
def test_a_preferred_step_keeps_config_yamls_sizes_up_to_it(
        configured: list[int], largest: int, sent: list[int]) -> None:
    configured_levers = levers_of(view(100, configured, 8))
    served = Served(Figures(1.0), configured_levers, configured_levers, tuple(configured))
    assert lever_request(served, PREFERRED, largest) == {PREFERRED: sent}
    assert lever_request(served, DELAY, 250) == {DELAY: 250}
    assert lever_request(served, ADMIT, None) == {ADMIT: None}


def test_windows_count_the_calls_and_refusals_between_two_reads(tmp_path: Path) -> None:
    repo = tmp_path / "repository"
    put(repo, "m", 1, onnx_models.dynamic_batch_mlp)
    (repo / "m" / "config.yaml").write_text(
        "max_batch_size: 4\ndynamic_batching: {preferred_batch_size: [2, 4], "
        "max_queue_delay_us: 300}\n")
    put(repo, "m", 2, onnx_models.dynamic_batch_mlp)
    registry = ModelRegistry(repo, {}, cpu_factory, probe_interval_s=3600)
    registry.start()
    try:
        x = (Tensor("x", np.full((1, 64), 0.5, np.float32)),)
        windows = Windows()
        for _ in range(3):
            registry.infer(InferRequest("m", "", x))
        first = windows.advance(1, registry.statistics("", ""), now_s=100.0)
        assert first["m"].figures.count == 0  # no window before the first read
        registry.set_levers("m", LeverChange(delay_us=100, admit=True, admit_rps=0.001))
        registry.infer(InferRequest("m", "", x))
        for _ in range(2):
            with pytest.raises(ServeError):
                registry.infer(InferRequest("m", "", x))
        later = windows.advance(1, registry.statistics("", ""), now_s=102.0)["m"]
        assert later.figures.count == 1 and later.figures.rate_rps == 0.5
        assert later.figures.rejections == 2 and later.figures.p99_ms > 0
        assert later.levers == Levers(100, 4, 0.001, realtime=False)
        assert later.configured == Levers(300, 4, realtime=False)
        assert later.preferred == (2, 4)
        again = windows.advance(1, registry.statistics("", ""), now_s=103.0)["m"]
        assert (again.figures.count, again.figures.rejections) == (0, 0)
        broken = [{"name": "m", "version": "2", "edge_agent": {"window": "junk"}}]
        assert windows.advance(1, broken, now_s=104.0) == {}
    finally:
        registry.stop()


def test_objectives_follow_config_yaml_and_skip_what_has_none(tmp_path: Path) -> None:
    (tmp_path / "lc").mkdir()
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "config.yaml").write_text("max_batch_size: 4\n")
    config = tmp_path / "lc" / "config.yaml"
    config.write_text("qos: {class: latency_critical, p99_ms: 12}\n")
    objectives = Objectives(tmp_path)
    models = ["lc", "plain", "builtin"]
    assert objectives(models) == {"lc": Objective("latency_critical", 12, None)}
    config.write_text("qos: {class: best_effort, min_rps: 3}\n")
    os.utime(config, ns=(1, 2))  # another signature even within one clock tick
    assert objectives(models) == {"lc": Objective("best_effort", None, 3)}
    config.write_text("qos: {class: urgent}\n")
    os.utime(config, ns=(3, 4))
    assert objectives(models) == {}  # refused (and logged), as the data plane refuses it
