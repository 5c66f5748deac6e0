"""What ``model build`` refuses and how it reads and judges, on small models: every refusal
names the file or flag and what is allowed, and nothing is installed by a build that fails
its gate, is not faster, or breaks part-way."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from PIL import Image

from agent.cli import main
from agent.modelbuild import install as install_module
from agent.modelbuild import measure, variants
from agent.modelbuild.build import build_candidate
from agent.modelbuild.compare import agreement
from agent.modelbuild.install import install, next_version
from agent.modelbuild.request import BuildError, BuildRequest, Gate, parse_gate, parse_preprocess
from tests.onnx_models import conv_net


def fixed(ratio: float) -> Any:
    return lambda original, built, feed: ratio


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return conv_net(tmp_path / "cnn.onnx", batch="N")  # image [N,3,64,64] -> [N,10]


def arrays(directory: Path, count: int = 12, shape: tuple[int, ...] = (1, 3, 64, 64)) -> Path:
    directory.mkdir(exist_ok=True)
    rng = np.random.default_rng(7)
    for i in range(count):
        np.save(directory / f"{i:03}.npy", rng.standard_normal(shape).astype(np.float32))
    return directory


def request(model: Path, calibration: Path, **fields: Any) -> BuildRequest:
    return BuildRequest(model, "cnn", calibration=calibration, **fields)


def test_npy_inputs_alternate_between_calibration_and_held_out(model: Path,
                                                              tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    report = build_candidate(request(model, arrays(tmp_path / "in", 9),
                                     gate=Gate(top1=0.0, cosine=0.9)), work,
                             measure=fixed(1.5))
    assert report.inputs == {"calibration": 5, "heldout": 4}
    assert report.passed and sorted(p.name for p in work.iterdir()) == ["build.json",
                                                                        "model.onnx"]


def test_a_gate_set_impossibly_high_refuses_every_variant_and_installs_nothing(
        model: Path, tmp_path: Path) -> None:
    repository = tmp_path / "repository"
    work = tmp_path / "work"
    work.mkdir()
    report = build_candidate(request(model, arrays(tmp_path / "in"),
                                     gate=Gate(top1=0.0, cosine=0.0, speed=100)),
                             work, measure=fixed(1.8))
    assert not report.passed and report.model_file is None
    assert [t.verdict for t in report.tried] == ["refused"] * 4
    assert all("1.80x the original's speed, below 100x" in t.reason for t in report.tried)
    assert [p.name for p in work.iterdir()] == ["build.json"]
    with pytest.raises(BuildError, match="did not pass its gate"):
        install(report, work, repository)
    assert not repository.exists()


def test_a_build_that_is_not_faster_is_refused_and_the_next_remedy_tried(
        model: Path, tmp_path: Path) -> None:
    ratios = iter([0.9, 1.3])
    work = tmp_path / "work"
    work.mkdir()
    report = build_candidate(request(model, arrays(tmp_path / "in"),
                                     gate=Gate(top1=0.0, cosine=0.9)), work,
                             measure=lambda a, b, feed: next(ratios))
    assert [(t.name, t.verdict) for t in report.tried] == [
        ("u8s8-per-channel", "refused"), ("u8s8-per-tensor", "passed")]
    assert "not faster here" in report.tried[0].reason and report.chosen == "u8s8-per-tensor"


def test_images_are_resized_laid_out_and_mirrored(model: Path, tmp_path: Path) -> None:
    images = tmp_path / "images"
    images.mkdir()
    for i in range(4):
        pixels = np.full((40, 50, 3), (10 * i, 100, 200), np.uint8)
        Image.fromarray(pixels).save(images / f"{i}.png")
    work = tmp_path / "work"
    work.mkdir()
    report = build_candidate(request(model, images, gate=Gate(0.0, 0.0, 0.0),
                                     preprocess=parse_preprocess("mean=100,std=2,order=bgr")),
                             work)
    assert report.inputs == {"calibration": 4, "heldout": 4}  # 2 images each, and mirrors
    from agent.modelbuild.inputs import InputSpec, load

    loaded = load(images, [InputSpec("image", (None, 3, 64, 64), "tensor(float)")],
                  parse_preprocess("mean=100,std=2,order=bgr"))
    first = loaded.calibration[0]["image"]
    assert first.shape == (1, 3, 64, 64) and first.dtype == np.float32
    # BGR: channel 0 is the blue 200 -> (200 - 100) / 2
    assert np.allclose(first[0, 0], 50.0) and np.allclose(first[0, 2], -50.0)


def test_fp16_keeps_float32_inputs_and_outputs(model: Path, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    report = build_candidate(request(model, arrays(tmp_path / "in"), precision="fp16",
                                     gate=Gate(0.9, 0.999, 1.0)), work, measure=fixed(1.2))
    assert report.passed and report.chosen == "fp16"
    built = onnx.load(str(work / "model.onnx"))
    assert built.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert any(i.data_type == onnx.TensorProto.FLOAT16 for i in built.graph.initializer)


def test_a_tensorrt_build_is_symmetric_s8s8_and_says_why_no_speed_was_measured(
        model: Path, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    report = build_candidate(request(model, arrays(tmp_path / "in"), target="tensorrt",
                                     gate=Gate(0.0, 0.9)), work, measure=fixed(9.0))
    assert report.passed and report.chosen == "s8s8-symmetric-per-channel"
    assert report.tried[0].speed_ratio is None  # the injected measure is never asked
    assert report.speed_note is not None and "TensorrtExecutionProvider" in report.speed_note
    built = onnx.load(str(work / "model.onnx"))
    points = [onnx.numpy_helper.to_array(i) for i in built.graph.initializer
              if i.name.endswith("zero_point")]
    assert points and not any(p.any() for p in points)  # symmetric: every zero point is 0
    assert {p.dtype for p in points} <= {np.dtype(np.int8), np.dtype(np.int32)}  # int32: bias
    assert np.dtype(np.int8) in {p.dtype for p in points}


def test_variants_follow_the_isa(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(variants.platform, "machine", lambda: "aarch64")
    assert variants.for_target("cpu")[0].name == "s8s8-per-channel"
    monkeypatch.setattr(variants.platform, "machine", lambda: "x86_64")
    assert [v.name for v in variants.for_target("openvino")][:2] == [
        "u8s8-per-channel", "u8s8-per-tensor"]


@pytest.mark.parametrize(("setup", "message"), [
    (lambda d: arrays(d, 1), "needs at least 2 files"),
    (lambda d: arrays(d, 3, (1, 3, 32, 32)), "has shape 1x3x32x32, the model wants ?x3x64x64"),
    (lambda d: (arrays(d, 3), (d / "x.png").write_bytes(b"\x89PNG")), "mixes images and arrays"),
    (lambda d: (d.mkdir(), [(d / f"{i}.png").write_bytes(b"not a png") for i in range(2)]),
     "not a readable image"),
    (lambda d: (d.mkdir(), [np.save(d / f"{i}.npy", np.array([{"a": 1}], dtype=object))
                            for i in range(2)]), "not a numpy array file"),
    (lambda d: (d.mkdir(), [np.save(d / f"{i}.npy", np.zeros((1, 3, 64, 64), np.int64))
                            for i in range(2)]), "is int64, the model wants float32"),
    (lambda d: (d.mkdir(), [np.save(d / f"{i}.npy", np.full((1, 3, 64, 64), np.nan, np.float32))
                            for i in range(2)]), "NaN or infinity"),
    (lambda d: (d.mkdir(), [np.savez(d / f"{i}.npz", other=np.zeros(3)) for i in range(2)]),
     "holds ['other']; the model's inputs are ['image']"),
])
def test_calibration_sets_that_do_not_fit_are_refused_naming_the_file(
        model: Path, tmp_path: Path, setup: Any, message: str) -> None:
    directory = tmp_path / "in"
    setup(directory)
    work = tmp_path / "work"
    work.mkdir()
    with pytest.raises(BuildError, match=re.escape(message)) as raised:
        build_candidate(request(model, directory), work)
    assert str(directory) in str(raised.value)  # names the file (or the directory)


def test_a_source_that_is_no_model_is_refused(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\x00" * 100)
    with pytest.raises(BuildError, match="ONNX Runtime cannot load it"):
        build_candidate(request(garbage, arrays(tmp_path / "in")), tmp_path)
    with pytest.raises(BuildError, match=r"\.onnx"):
        build_candidate(request(tmp_path / "model.pt", arrays(tmp_path / "in")), tmp_path)


@pytest.mark.parametrize(("argv", "message"), [
    (["--target", "cuda"], "--target 'cuda': allowed cpu, tensorrt, openvino, rknn:rk3588"),
    (["--precision", "int4"], "--precision 'int4': allowed int8, fp16"),
    (["--gate", "top5=0.9"], "expected KEY=VALUE with KEY one of top1, cosine, speed"),
    (["--gate", "cosine=nan"], "--gate cosine=nan: expected a number from 0 to 1"),
    (["--preprocess", "order=rbg"], "order=rbg: allowed rgb, bgr"),
    (["--preprocess", "std=0"], "std=0: expected a number from 1e-06 to 255"),
    (["--name", "../x"], "--name '../x'"),
    (["--target", "rknn:rk3588", "--rknn-python", "/nonexistent/python"],
     "/nonexistent/python is not an executable python; set the rknn converter up with "
     "setup_rknn_converter.sh"),
])
def test_bad_flags_end_with_status_2_naming_the_flag(
        model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        argv: list[str], message: str) -> None:
    base = ["model", "build", str(model), "--name", "cnn", "--calibration",
            str(arrays(tmp_path / "in")), "--repository", str(tmp_path / "repo")]
    assert main(base + argv) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "repo").exists()


def test_the_command_line_installs_and_prints_the_report(
        model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("agent.modelbuild.build.interleaved", fixed(1.4))
    argv = ["model", "build", str(model), "--name", "cnn", "--calibration",
            str(arrays(tmp_path / "in")), "--repository", str(tmp_path / "repo"),
            "--gate", "top1=0,cosine=0.9"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "passed  u8s8-per-channel" in out and "installed as version 1" in out
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["version"] == 2
    assert sorted(p.name for p in (tmp_path / "repo" / "cnn").iterdir()) == ["1", "2"]


def test_an_install_that_breaks_part_way_leaves_no_version(
        model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    work = tmp_path / "work"
    work.mkdir()
    report = build_candidate(request(model, arrays(tmp_path / "in"),
                                     gate=Gate(0.0, 0.9)), work, measure=fixed(2.0))

    def full_disk(source: Path, target: Path) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(install_module, "_copy", full_disk)
    with pytest.raises(BuildError, match="No space left on device"):
        install(report, work, tmp_path / "repo")
    assert list((tmp_path / "repo" / "cnn").iterdir()) == [] and report.version is None


def test_next_version_is_above_every_version_and_the_builtin(tmp_path: Path) -> None:
    assert next_version(tmp_path / "absent", builtin=False) == 1
    assert next_version(tmp_path / "absent", builtin=True) == 2
    for name in ("2", "7", "latest", ".8.partial"):
        (tmp_path / name).mkdir()
    assert next_version(tmp_path, builtin=True) == 8


def test_agreement_counts_a_broken_output_as_full_disagreement() -> None:
    scores = [np.array([[0.1, 0.9]], np.float32)]
    same = agreement([scores, scores], [scores, scores])
    assert same.top1 == 1.0 and same.cosine_mean == pytest.approx(1.0)
    broken = agreement([scores, scores], [scores, [np.array([[np.nan, 0.0]], np.float32)]])
    assert broken.top1 == 0.5 and broken.cosine_min == 0.0
    reshaped = agreement([scores], [[np.array([0.1, 0.9], np.float32)]])
    assert reshaped.top1 == 0.0 and reshaped.cosine_mean == 0.0
    labels = agreement([[np.array([3])]], [[np.array([4])]])
    assert labels.top1 is None and labels.cosine_mean == 0.0


def test_parse_gate_keeps_defaults_for_keys_left_out() -> None:
    assert parse_gate("speed=0") == Gate(speed=0.0)
    assert parse_gate(None) == Gate()


def test_the_interleaved_measurement_is_the_ratio_of_median_latencies(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [0.0]

    class Session:
        def __init__(self, cost: float) -> None:
            self.cost = cost

        def run(self, outputs: object, feed: object) -> None:
            clock[0] += self.cost

    monkeypatch.setattr(measure.time, "perf_counter", lambda: clock[0])
    assert measure.interleaved(Session(3.0), Session(1.5), {}) == pytest.approx(2.0)
