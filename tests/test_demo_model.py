"""The shipped demo model and the test models run in a real onnxruntime session."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx_models
import onnxruntime as ort  # type: ignore[import-untyped]
import pytest

from agent.inference.demo_model import (
    DEMO_CLASSES,
    DEMO_INPUT,
    DEMO_MODEL_PATH,
    DEMO_OUTPUT,
    build_demo_cnn,
)


def _session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _input(shape: list[int], seed: int = 0) -> np.ndarray:
    return np.random.RandomState(seed).standard_normal(shape).astype(np.float32)


def test_shipped_demo_model_classifies_an_image() -> None:
    session = _session(DEMO_MODEL_PATH)
    [arg] = session.get_inputs()
    assert (arg.name, arg.shape, arg.type) == (DEMO_INPUT, ["N", 3, 64, 64], "tensor(float)")
    [probabilities] = session.run([DEMO_OUTPUT], {DEMO_INPUT: _input([1, 3, 64, 64])})
    assert probabilities.shape == (1, DEMO_CLASSES)
    assert (probabilities >= 0).all()
    assert probabilities.sum() == pytest.approx(1.0, abs=1e-5)
    assert probabilities.max() < 0.99  # weights are not degenerate: no saturated softmax


def test_shipped_demo_model_is_what_the_builder_makes() -> None:
    # Fails after a builder change until `python scripts/make_demo_model.py` is run.
    shipped = DEMO_MODEL_PATH.read_bytes()
    assert shipped == build_demo_cnn().SerializeToString()
    assert len(shipped) < 200_000


def test_runtime_modules_do_not_import_onnx() -> None:
    code = ("import sys, agent.inference.demo_model, agent.inference.stats; "
            "sys.exit('onnx' in sys.modules or 'numpy' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


MODELS: dict[str, tuple[Callable[[Path], Path], dict[str, list[int]], list[int]]] = {
    # helper, {input name: shape fed}, output shape
    "conv_net": (onnx_models.conv_net, {DEMO_INPUT: [3, 3, 64, 64]}, [3, 10]),
    "mlp": (onnx_models.mlp, {"x": [1, 64]}, [1, 10]),
    "dynamic_batch_mlp": (onnx_models.dynamic_batch_mlp, {"x": [7, 64]}, [7, 10]),
    "slow_model": (onnx_models.slow_model, {"x": [1, 64]}, [1, 10]),
    "nan_model": (onnx_models.nan_model, {"x": [1, 64]}, [1, 10]),
    "incompatible_model": (onnx_models.incompatible_model, {"x": [1, 32]}, [1, 10]),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_test_model_runs_with_expected_shapes(name: str, tmp_path: Path) -> None:
    build, feeds, output_shape = MODELS[name]
    path = build(tmp_path / f"{name}.onnx")
    session = _session(path)
    [output] = session.run(None, {key: _input(shape) for key, shape in feeds.items()})
    assert list(output.shape) == output_shape
    assert output.dtype == np.float32
    if name == "nan_model":
        assert np.isnan(output).all()
    else:
        assert np.isfinite(output).all()


def test_mlp_family_shares_one_interface_except_the_incompatible_one(tmp_path: Path) -> None:
    def interface(path: Path) -> list[tuple[str, list[int]]]:
        session = _session(path)
        return [(a.name, a.shape) for a in [*session.get_inputs(), *session.get_outputs()]]

    expected = interface(onnx_models.mlp(tmp_path / "mlp.onnx"))
    assert interface(onnx_models.slow_model(tmp_path / "slow.onnx")) == expected
    assert interface(onnx_models.nan_model(tmp_path / "nan.onnx")) == expected
    assert interface(onnx_models.incompatible_model(tmp_path / "bad.onnx")) != expected


def test_conv_net_takes_a_fixed_batch(tmp_path: Path) -> None:
    session = _session(onnx_models.conv_net(tmp_path / "conv.onnx", batch=1))
    assert session.get_inputs()[0].shape == [1, 3, 64, 64]


def test_models_are_deterministic(tmp_path: Path) -> None:
    first = onnx_models.slow_model(tmp_path / "a.onnx", 3).read_bytes()
    assert onnx_models.slow_model(tmp_path / "b.onnx", 3).read_bytes() == first


def _median_ns(session: ort.InferenceSession, feeds: dict[str, np.ndarray]) -> float:
    for _ in range(3):  # warm-up: first runs allocate
        session.run(None, feeds)
    times = []
    for _ in range(20):
        start = time.perf_counter_ns()
        session.run(None, feeds)
        times.append(time.perf_counter_ns() - start)
    return float(np.median(times))


def test_slow_model_is_measurably_slower_than_mlp(tmp_path: Path) -> None:
    feeds = {"x": _input([1, 64])}
    fast = _median_ns(_session(onnx_models.mlp(tmp_path / "mlp.onnx")), feeds)
    slow = _median_ns(_session(onnx_models.slow_model(tmp_path / "slow.onnx")), feeds)
    assert slow >= 3 * fast, (slow, fast)
