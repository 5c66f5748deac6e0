"""Real rknn-toolkit2 conversions on its simulator, compared with ONNX Runtime.

Marked ``rknn_toolkit`` and skipped without the converter venv, which CI does not have:
``scripts/setup_rknn_converter.sh .rknn-venv`` then ``pytest -m rknn_toolkit -s`` (``-s``
shows the figures). The venv is found as the agent finds it (EDGE_AGENT_RKNN_PYTHON, the
default /opt/edge-agent/rknn-venv), and also as .rknn-venv in this checkout.
"""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from onnx_models import small_nchw_cnn

from agent.modelbuild import rknn
from agent.modelbuild.request import BuildError, Feed

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


def metadata(data: bytes) -> dict[str, Any]:
    """The JSON document at the end of a .rknn export (its u64 length before it), found
    without assuming the header's size: 2.5.0 writes a 64-byte header for format 6."""
    assert data[:4] == b"RKNN"
    for start in range(len(data) - 2, 8, -1):
        if data[start:start + 1] == b"{" and \
                struct.unpack_from("<Q", data, start - 8)[0] == len(data) - start:
            document: dict[str, Any] = json.loads(data[start:])
            return document
    raise AssertionError("no metadata document at the end of the .rknn")


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
    document = metadata(result.model.read_bytes())
    assert document["version"].startswith(TOOLKIT)
    assert platform in document["target_platform"]
    quantized = {tensor["dtype"]["qnt_type"] for tensor in document["norm_tensor"]}
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
