"""The rknn converter's agent side (agent/modelbuild/rknn.py) against the real worker script
running with a fake rknn-toolkit2 (tests/fake_rknn_toolkit): the request it sends, the
outputs it reads back, and how each way of failing reaches the user."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from agent.modelbuild import rknn
from agent.modelbuild.request import BuildError, Feed

FAKE = Path(__file__).parent / "fake_rknn_converter.py"


@pytest.fixture
def fake_python(tmp_path: Path) -> Path:
    """An executable that the agent runs as the converter venv's python."""
    path = tmp_path / "venv" / "bin" / "python"
    path.parent.mkdir(parents=True)
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE}" "$@"\n')
    path.chmod(0o755)
    return path


@pytest.fixture
def source(tmp_path: Path) -> Path:
    path = tmp_path / "model.onnx"
    path.write_bytes(b"onnx")
    return path


def image(seed: int, batch: int = 1) -> Feed:
    return {"image": np.random.RandomState(seed).standard_normal((batch, 3, 4, 4))
            .astype(np.float32)}


def run(source: Path, python: Path, precision: str = "int8",
        calibration: list[Feed] | None = None, heldout: list[Feed] | None = None,
        platform: str = "rk3588", timeout_s: float = 60,
        progress: list[str] | None = None) -> rknn.RknnConversion:
    lines = progress if progress is not None else []
    return rknn.convert(source, source.parent / "out", platform, precision,
                        [image(1)] if calibration is None else calibration,
                        [image(2)] if heldout is None else heldout,
                        python, timeout_s, lines.append)


def calls(log: Path, name: str) -> list[dict[str, object]]:
    return [call for call in json.loads(log.read_text()) if call["call"] == name]


def test_int8_conversion_calibrates_per_sample_and_returns_outputs_per_heldout_feed(
        source: Path, fake_python: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_RKNN_LOG", str(tmp_path / "log.json"))
    calibration = [image(1), image(3, batch=3)]
    heldout = [image(2), image(4, batch=2)]
    progress: list[str] = []
    result = run(source, fake_python, "int8", calibration, heldout, progress=progress)

    assert result.model == source.parent / "out" / "model.rknn"
    assert result.model.read_bytes() == b"RKNN fake model"
    assert result.toolkit_version == "0.0.0-fake"
    # one output list per held-out feed, in output order, a batch concatenated from samples
    single, batch = result.outputs
    assert single[0].shape == (1, 1)
    assert single[0][0, 0] == pytest.approx(float(heldout[0]["image"].sum()), rel=1e-5)
    np.testing.assert_array_equal(single[1], heldout[0]["image"].reshape(1, -1))
    assert batch[0].shape == (2, 1)
    assert batch[0][:, 0] == pytest.approx(heldout[1]["image"].sum(axis=(1, 2, 3)), rel=1e-5)
    np.testing.assert_array_equal(batch[1], heldout[1]["image"].reshape(2, -1))

    log = tmp_path / "log.json"
    [config] = calls(log, "config")
    assert config["target_platform"] == "rk3588"
    assert config["quantized_dtype"] == "w8a8"
    assert "mean_values" not in config and "std_values" not in config
    [load] = calls(log, "load_onnx")
    assert load["inputs"] == ["image"]
    assert load["input_size_list"] == [[1, 3, 4, 4]]
    [build] = calls(log, "build")
    assert build["do_quantization"] is True
    # each calibration sample on its own line, in order: 1 + 3 samples
    expected = [float(calibration[0]["image"].sum())] + \
        [float(calibration[1]["image"][i].sum()) for i in range(3)]
    assert [line[0] for line in build["samples"]] == pytest.approx(expected, rel=1e-5)
    assert {str(call["data_format"]) for call in calls(log, "inference")} == {"['nchw']"}
    assert [call["target"] for call in calls(log, "init_runtime")] == [None]  # the simulator
    assert "quantizing int8 on 4 calibration samples" in progress
    assert progress[0] == "rknn-toolkit2 0.0.0-fake: configuring for rk3588"
    # the scratch directory (feeds, dataset, outputs) is gone
    assert sorted(p.name for p in (source.parent / "out").iterdir()) == ["model.rknn"]


def test_fp16_builds_without_quantization_or_calibration(
        source: Path, fake_python: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_RKNN_LOG", str(tmp_path / "log.json"))
    result = run(source, fake_python, "fp16", calibration=[], platform="rk3566")
    [build] = calls(tmp_path / "log.json", "build")
    assert build["do_quantization"] is False and build["dataset"] is None
    assert calls(tmp_path / "log.json", "config")[0]["target_platform"] == "rk3566"
    assert len(result.outputs) == 1


def test_inputs_keep_the_first_feeds_order_in_dataset_and_inference(
        source: Path, fake_python: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_RKNN_LOG", str(tmp_path / "log.json"))
    feed = {"tokens": np.arange(6, dtype=np.float32).reshape(1, 6),
            "image": np.ones((1, 3, 2, 2), np.float32)}
    result = run(source, fake_python, "int8", [feed], [dict(reversed(feed.items()))])
    [load] = calls(tmp_path / "log.json", "load_onnx")
    assert load["inputs"] == ["tokens", "image"]
    assert load["input_size_list"] == [[1, 6], [1, 3, 2, 2]]
    assert calls(tmp_path / "log.json", "build")[0]["samples"] == [[15.0, 12.0]]
    np.testing.assert_array_equal(result.outputs[0][1], feed["tokens"])  # first input first


def test_a_refusing_toolkit_names_the_step_and_its_log(source: Path, fake_python: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_RKNN_MODE", "build_fails")
    with pytest.raises(BuildError) as caught:
        run(source, fake_python)
    message = str(caught.value)
    assert message.startswith("rknn converter failed at build: rknn.build() returned -1")
    # the toolkit printed it to stdout; the worker sent that to stderr, whose tail is kept
    assert "E build: fake refusal of this model" in message


def test_a_toolkit_that_raises_its_traceback_is_reported_by_its_last_line(
        source: Path, fake_python: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_RKNN_MODE", "raises")
    with pytest.raises(BuildError) as caught:
        run(source, fake_python)
    first = str(caught.value).splitlines()[0]
    assert first == ("rknn converter failed at load_onnx: "
                     "google.protobuf.message.DecodeError: Error parsing message")


def test_a_toolkit_that_exits_is_reported_at_its_step(source: Path, fake_python: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_RKNN_MODE", "exit")
    with pytest.raises(BuildError, match=r"failed at build: the toolkit exited with -1"):
        run(source, fake_python)


def test_a_crash_reports_the_exit_status_and_a_bounded_stderr_tail(
        source: Path, fake_python: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_RKNN_MODE", "crash")
    with pytest.raises(BuildError) as caught:
        run(source, fake_python)
    message = str(caught.value)
    assert message.startswith(f"rknn converter ({fake_python}) ended with status 3")
    assert message.rstrip().endswith("E fake crash log line 1999")
    assert "line 100\n" not in message
    assert len(message) < rknn.STDERR_TAIL + 500


def test_a_hung_converter_is_killed_with_its_children_at_the_timeout(
        source: Path, fake_python: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_RKNN_MODE", "hang")
    monkeypatch.setenv("FAKE_RKNN_CHILD", str(tmp_path / "child.pid"))
    started = time.monotonic()
    with pytest.raises(BuildError, match=r"^rknn converter: no result after 3 s; killed"):
        run(source, fake_python, timeout_s=3)
    assert time.monotonic() - started < 15
    child = int((tmp_path / "child.pid").read_text())
    assert not _alive(child), "the toolkit's child outlived the timeout"


def _alive(pid: int) -> bool:
    """Running, not merely a zombie waiting for a reaper."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return False
        if state in ("Z", "X"):
            return False
        time.sleep(0.05)
    return True


def test_a_model_file_left_by_an_earlier_build_does_not_pass_for_this_one(
        source: Path, fake_python: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (source.parent / "out").mkdir()
    (source.parent / "out" / "model.rknn").write_bytes(b"RKNN stale")
    monkeypatch.setenv("FAKE_RKNN_MODE", "no_export")
    with pytest.raises(BuildError, match=r"reported success but wrote no .*/out/model.rknn$"):
        run(source, fake_python)


def test_output_outside_the_protocol_is_an_error(source: Path, fake_python: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_RKNN_MODE", "garbage")
    with pytest.raises(BuildError, match=r"not its protocol's JSON: 'this is not json"):
        run(source, fake_python)


def test_a_converter_that_ends_without_a_result_is_an_error(
        source: Path, fake_python: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_RKNN_MODE", "silent")
    progress: list[str] = []
    with pytest.raises(BuildError, match=r"ended without a result"):
        run(source, fake_python, progress=progress)
    assert progress == ["starting"]


@pytest.mark.skipif(importlib.util.find_spec("rknn") is not None,
                    reason="this python has an rknn package")
def test_a_python_without_the_toolkit_names_the_setup_script(source: Path) -> None:
    with pytest.raises(BuildError) as caught:
        run(source, Path(sys.executable))
    assert str(caught.value).startswith(
        f"rknn converter failed at import: rknn-toolkit2 is not importable by {sys.executable}")
    assert "scripts/setup_rknn_converter.sh" in str(caught.value)


@pytest.mark.parametrize(("platform", "precision", "calibration", "expected"), [
    ("rk3399", "int8", [image(1)], "--target rknn:rk3399: not a supported Rockchip platform "
                                   "(allowed: rknn:rk3588, rknn:rk3576, rknn:rk3566)"),
    ("rk3588", "int4", [image(1)], "--precision int4: not offered for rknn "
                                   "(allowed: int8, fp16)"),
    ("rk3588", "int8", [], "--precision int8 for rknn needs calibration inputs "
                           "(--calibration DIR)"),
])
def test_bad_choices_name_the_flag_and_the_allowed_values(
        source: Path, fake_python: Path, platform: str, precision: str,
        calibration: list[Feed], expected: str) -> None:
    with pytest.raises(BuildError) as caught:
        run(source, fake_python, precision, calibration, platform=platform)
    assert str(caught.value) == expected


def test_feeds_must_agree_on_inputs_and_sample_shape(source: Path, fake_python: Path) -> None:
    other = {"pixels": np.zeros((1, 3, 4, 4), np.float32)}
    with pytest.raises(BuildError, match=r"^held-out input 0: names \['pixels'\] differ from "
                                         r"calibration input 0's \['image'\]$"):
        run(source, fake_python, calibration=[image(1)], heldout=[other])
    wider = {"image": np.zeros((2, 3, 8, 8), np.float32)}
    with pytest.raises(BuildError, match=r"^held-out input 0: image has shape \[2, 3, 8, 8\]; "
                                         r"the rknn model takes \[N, 3, 4, 4\]$"):
        run(source, fake_python, calibration=[image(1)], heldout=[wider])


def test_a_missing_source_is_named(tmp_path: Path, fake_python: Path) -> None:
    with pytest.raises(BuildError, match=r"missing.onnx: no such model file"):
        run(tmp_path / "missing.onnx", fake_python)


def test_converter_python_prefers_the_config_value_then_the_environment(
        fake_python: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(rknn.ENV, str(tmp_path / "nowhere"))
    assert rknn.converter_python(str(fake_python)) == fake_python
    # a venv directory stands for its bin/python
    assert rknn.converter_python(str(fake_python.parent.parent)) == fake_python
    monkeypatch.setenv(rknn.ENV, str(fake_python))
    assert rknn.converter_python(None) == fake_python
    with pytest.raises(BuildError, match=r"^model_build.rknn_python: .*/nowhere is not an "
                                         r"executable python; set the rknn converter up with "
                                         r"setup_rknn_converter.sh \[VENV_DIR\] \(scripts/ in "
                                         r"a checkout"):
        rknn.converter_python(str(tmp_path / "nowhere"))


def test_converter_python_falls_back_to_the_default_venv(monkeypatch: pytest.MonkeyPatch,
                                                         tmp_path: Path) -> None:
    monkeypatch.delenv(rknn.ENV, raising=False)
    monkeypatch.setattr(rknn, "DEFAULT_PYTHON", tmp_path / "rknn-venv" / "bin" / "python")
    with pytest.raises(BuildError) as caught:
        rknn.converter_python(None)
    assert str(caught.value).startswith(
        "the default converter (neither model_build.rknn_python nor EDGE_AGENT_RKNN_PYTHON "
        f"is set): {tmp_path}/rknn-venv/bin/python is not an executable python")
    assert os.environ.get(rknn.ENV) is None


def test_the_setup_script_refuses_a_python_the_toolkit_has_no_build_for(tmp_path: Path) -> None:
    script = Path(__file__).parents[1] / "scripts" / "setup_rknn_converter.sh"
    done = subprocess.run(["bash", str(script), str(tmp_path / "venv")], capture_output=True,
                          text=True, env={**os.environ, "PYTHON": "/bin/false"}, timeout=60,
                          check=False)
    assert done.returncode == 2
    assert done.stderr == ("setup_rknn_converter.sh: /bin/false is no working python; "
                           "rknn-toolkit2 2.5.0 with its pins needs CPython 3.9-3.12 "
                           "(set PYTHON=python3.X)\n")
    assert not (tmp_path / "venv").exists()
