"""Real rknn-toolkit2 conversions on its simulator, compared with ONNX Runtime.

Marked ``rknn_toolkit`` and skipped without the converter venv, which CI does not have:
``scripts/setup_rknn_converter.sh .rknn-venv`` then ``pytest -m rknn_toolkit -s`` (``-s``
shows the figures). The venv is found as the agent finds it (EDGE_AGENT_RKNN_PYTHON, the
default /opt/edge-agent/rknn-venv), and also as .rknn-venv in this checkout.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from agent.cli import main
from agent.inference.backends.rknn_file import parse_rknn
from agent.modelbuild import rknn
from agent.modelbuild.request import BuildError, Feed
from tests.onnx_models import small_nchw_cnn

pytestmark = pytest.mark.rknn_toolkit

CHECKOUT_VENV = Path(__file__).resolve().parents[1] / ".rknn-venv"
TOOLKIT = "2.5.0"  # what scripts/setup_rknn_converter.sh pins
MIN_COSINE = {"fp16": 0.999, "int8": 0.99}


@pytest.fixture(scope="module")
def converter() -> Path:
    for candidate in (os.environ.get(rknn.ENV), CHECKOUT_VENV, rknn.DEFAULT_PYTHON):
        if candidate:
            try:
                return rknn.converter_python(str(candidate))
            except BuildError:
                continue
    pytest.skip(f"no rknn converter venv ({rknn.ENV}, {CHECKOUT_VENV} or "
                f"{rknn.DEFAULT_PYTHON}): scripts/setup_rknn_converter.sh .rknn-venv")


def feeds(seed: int, count: int, batch: int = 1) -> list[Feed]:
    rng = np.random.RandomState(seed)
    return [{"image": rng.standard_normal((batch, 3, 32, 32)).astype(np.float32)}
            for _ in range(count)]


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def compare(source: Path, heldout: list[Feed], outputs: list[list[np.ndarray]]) -> list[float]:
    """The first output's cosine with ONNX Runtime's, per held-out feed."""
    session = ort.InferenceSession(str(source), providers=["CPUExecutionProvider"])
    found = []
    for feed, simulated in zip(heldout, outputs, strict=True):
        [expected] = session.run(None, feed)
        assert simulated[0].shape == expected.shape
        found.append(cosine(simulated[0], expected))
    return found


@pytest.mark.parametrize("platform", rknn.PLATFORMS)
@pytest.mark.parametrize("precision", rknn.PRECISIONS)
def test_converted_model_matches_onnx_runtime_on_the_simulator(
        converter: Path, tmp_path: Path, platform: str, precision: str) -> None:
    source = small_nchw_cnn(tmp_path / "model.onnx")
    calibration = feeds(1, 20) if precision == "int8" else []
    heldout = feeds(2, 10)
    progress: list[str] = []
    started = time.monotonic()
    result = rknn.convert(source, tmp_path / "out", platform, precision, calibration, heldout,
                          converter, 600, progress.append)
    seconds = time.monotonic() - started

    cosines = compare(source, heldout, result.outputs)
    print(f"\nrknn-toolkit2 {result.toolkit_version} {platform} {precision}: cosine mean "
          f"{np.mean(cosines):.7f} min {min(cosines):.7f} over {len(cosines)} held-out "
          f"inputs, {seconds:.1f} s")
    assert min(cosines) >= MIN_COSINE[precision]
    assert result.toolkit_version == TOOLKIT
    info = parse_rknn(result.model.read_bytes())  # as the RKNN backend reads it on a board
    assert info.toolkit_version is not None and info.toolkit_version.startswith(TOOLKIT)
    assert platform in info.target_platform
    quantized = {tensor["dtype"]["qnt_type"] for tensor in info.metadata["norm_tensor"]}
    assert quantized == ({"int8"} if precision == "int8" else {""})
    assert progress[-1] == "running 10 held-out inputs on the simulator"


def test_dynamic_batch_is_fixed_to_one_and_a_batch_runs_sample_by_sample(
        converter: Path, tmp_path: Path) -> None:
    source = small_nchw_cnn(tmp_path / "model.onnx", batch="N")
    heldout = feeds(3, 1, batch=3) + feeds(4, 1)
    result = rknn.convert(source, tmp_path / "out", "rk3588", "int8", feeds(1, 20, batch=2),
                          heldout, converter, 600, lambda _: None)
    assert [outputs[0].shape for outputs in result.outputs] == [(3, 10), (1, 10)]
    assert min(compare(source, heldout, result.outputs)) >= MIN_COSINE["int8"]


def test_an_unconvertible_model_fails_with_the_toolkits_reason(converter: Path,
                                                               tmp_path: Path) -> None:
    source = tmp_path / "model.onnx"
    source.write_bytes(b"not an onnx model")
    with pytest.raises(BuildError, match=r"^rknn converter failed at load_onnx: "
                                         r"google.protobuf.message.DecodeError: Error "
                                         r"parsing message\n") as caught:
        rknn.convert(source, tmp_path / "out", "rk3588", "fp16", [], feeds(2, 1), converter,
                     600, lambda _: None)
    assert "its stderr ends:" in str(caught.value)


def test_model_build_installs_a_passing_rknn_with_its_onnx_and_report(
        converter: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The whole command: the gate compares the simulator with ONNX Runtime, and the version
    holds model.rknn, the source as model.onnx (the backend reads its I/O) and build.json."""
    source = small_nchw_cnn(tmp_path / "model.onnx")
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    for i, feed in enumerate(feeds(5, 24)):
        np.save(inputs / f"{i:02}.npy", feed["image"])
    status = main(["model", "build", str(source), "--name", "cnn", "--target", "rknn:rk3588",
                   "--calibration", str(inputs), "--repository", str(tmp_path / "repo"),
                   "--rknn-python", str(converter), "--gate", "top1=0.9,cosine=0.99", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert status == 0, report
    version = tmp_path / "repo" / "cnn" / "1"
    assert sorted(p.name for p in version.iterdir()) == ["build.json", "model.onnx",
                                                         "model.rknn"]
    assert report["chosen"] == "rknn-rk3588-int8" and report["tools"]["rknn-toolkit2"] == TOOLKIT
    assert report["variants"][0]["agreement"]["cosine_mean"] >= 0.99
    assert report["variants"][0]["speed_ratio"] is None and "simulator" in report["speed_note"]
    assert parse_rknn((version / "model.rknn").read_bytes()).target_platform == ("rk3588",)
