"""The RKNN backend against a fake ``rknnlite`` (tests/fake_rknnlite) that keeps the real
contract: 0/-1/None returns, core masks as ints, NHWC unless told.  rknn-toolkit-lite2 has no
x86 wheel, so the real one is never here."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from onnx_models import conv_net
from rknn_helpers import rknn_bytes, use_fake_rknnlite

from agent.inference.backends import rknn
from agent.inference.backends.rknn_file import (
    RknnFileError,
    parse_rknn,
    skew,
)
from agent.inference.devices import parse_device
from agent.inference.errors import SessionError


@pytest.fixture()
def lite(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    made = use_fake_rknnlite(monkeypatch)
    yield made
    made.made.clear()


@pytest.fixture()
def version(tmp_path: Path) -> Path:
    """A version directory: the ONNX model and the .rknn converted from it."""
    conv_net(tmp_path / "model.onnx")
    (tmp_path / "model.rknn").write_bytes(rknn_bytes())
    return tmp_path / "model.rknn"


def load(path: Path, device: str = "npu:0", runtime: str | None = "2.3.0") -> rknn.RknnBackend:
    return rknn.load(path, parse_device(device), "int8", runtime_version=runtime)


def test_the_header_names_the_toolkit_in_both_layouts() -> None:
    assert parse_rknn(rknn_bytes("2.3.0+abc")).toolkit_version == "2.3.0+abc"
    old = parse_rknn(rknn_bytes("1.2.0", fmt=1))
    assert (old.format_version, old.toolkit_version, old.target_platform) == (
        1, "1.2.0", ("rk3588",))
    with pytest.raises(RknnFileError, match="does not start with"):
        parse_rknn(b"\x08\x01onnx")


def test_a_real_toolkit_2_5_export_is_read() -> None:
    """rknn-toolkit2 2.5.0 writes format 6 with a 64-byte header (scripts/
    setup_rknn_converter.sh's toolkit made this file from a small CNN for rk3588, int8)."""
    real = Path(__file__).parent / "rknn_exports" / "toolkit-2.5.0-int8-rk3588.rknn"
    info = parse_rknn(real.read_bytes())
    assert (info.format_version, info.toolkit_version, info.target_platform) == (
        6, "2.5.0", ("rk3588",))


def test_a_model_newer_than_librknnrt_is_refused_naming_both(lite: Any, version: Path) -> None:
    version.write_bytes(rknn_bytes("2.3.0+81f21f4d"))
    with pytest.raises(SessionError) as caught:
        load(version, runtime="1.4.0")
    message = str(caught.value)
    assert "rknn-toolkit2 2.3.0+81f21f4d, newer than this board's librknnrt 1.4.0" in message
    assert "Invalid RKNN model version" in message and message.startswith(str(version))
    assert lite.made == []  # refused before the runtime was touched
    assert skew("1.6.0", "1.6.0") is None and skew("1.5.2", "1.6.0") is None


def test_an_unknown_runtime_version_lets_init_runtime_decide(lite: Any, version: Path) -> None:
    backend = load(version, runtime=None)
    assert backend.runtime_version is None and lite.made[0].core_mask == 1


@pytest.mark.parametrize(("device", "mask"), [("npu:0", 1), ("npu:1", 2), ("npu:2", 4),
                                              ("npu:0-2", 7)])
def test_the_instance_device_becomes_the_core_mask(lite: Any, version: Path, device: str,
                                                   mask: int) -> None:
    backend = load(version, device)
    assert lite.made[-1].core_mask == mask
    assert backend.describe() == {"backend": "rknn", "device": device, "precision": "int8",
                                  "providers": ["rknn"], "core_mask": mask,
                                  "toolkit": "1.6.0+81f21f4d", "librknnrt": "2.3.0"}


def test_outputs_match_the_onnx_model_in_nchw(lite: Any, version: Path) -> None:
    backend = load(version)
    image = np.random.default_rng(1).random((1, 3, 64, 64), dtype=np.float32)
    expected = ort.InferenceSession(str(version.with_name("model.onnx"))).run(
        None, {"image": image})
    [name] = [spec.name for spec in backend.get_outputs()]
    got = backend.run([name], {"image": image})
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-5)
    assert lite.made[0].calls == [([(1, 3, 64, 64)], ["nchw"])]


def test_a_batch_runs_row_by_row(lite: Any, version: Path) -> None:
    backend = load(version)
    images = np.random.default_rng(2).random((3, 3, 64, 64), dtype=np.float32)
    expected = ort.InferenceSession(str(version.with_name("model.onnx"))).run(
        None, {"image": images})[0]
    name = backend.get_outputs()[0].name
    np.testing.assert_allclose(backend.run([name], {"image": images})[0], expected, rtol=1e-5)
    assert len(lite.made[0].calls) == 3


def test_a_cancelled_batch_stops_before_its_next_row(lite: Any, version: Path) -> None:
    """RKNNLite cannot cut an inference: the watchdog's terminate, set while a row runs on
    the NPU, stops the run before the next row."""
    backend = load(version)
    control = backend.run_options()
    assert control.terminate is False
    runtime = lite.made[0]
    infer = runtime.inference

    def cancelled_during(*args: Any, **kw: Any) -> Any:
        control.terminate = True  # the watchdog, while this row is on the NPU
        return infer(*args, **kw)

    runtime.inference = cancelled_during
    images = np.zeros((3, 3, 64, 64), np.float32)
    with pytest.raises(RuntimeError, match="the run was cancelled after 1 of 3 rows"):
        backend.run([backend.get_outputs()[0].name], {"image": images}, control)
    assert len(runtime.calls) == 1


def test_inference_returning_none_is_an_error(lite: Any, version: Path) -> None:
    backend = load(version)
    lite.fail_inference = True
    with pytest.raises(RuntimeError, match=r"RKNNLite\.inference failed on npu:0 .it returned "
                                           "None"):
        backend.run([backend.get_outputs()[0].name],
                    {"image": np.zeros((1, 3, 64, 64), np.float32)})


def test_a_failed_init_runtime_is_an_error_and_releases(lite: Any, version: Path) -> None:
    lite.fail_init = True
    with pytest.raises(SessionError, match=r"init_runtime\(core_mask=7\) failed for npu:0-2 "
                                           r"\(returned -1; toolkit 1.6.0\+81f21f4d, "
                                           r"librknnrt 2.3.0\)"):
        load(version, "npu:0-2")
    assert lite.made[0].released


def test_a_file_that_is_no_rknn_is_refused_before_the_runtime(lite: Any,
                                                              version: Path) -> None:
    version.write_bytes(b"not an rknn at all")
    with pytest.raises(SessionError, match="not an RKNN model"):
        load(version)
    assert lite.made == []


def test_an_rknn_without_its_onnx_says_what_is_needed(lite: Any, tmp_path: Path) -> None:
    (tmp_path / "model.rknn").write_bytes(rknn_bytes())
    with pytest.raises(SessionError, match=r"needs model\.onnx beside it"):
        load(tmp_path / "model.rknn")


def test_without_rknnlite_the_error_names_the_package(version: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("rknnlite", "rknnlite.api"):
        monkeypatch.setitem(sys.modules, name, None)  # as if the wheel were absent
    with pytest.raises(SessionError, match="needs rknn-toolkit-lite2"):
        load(version)


def test_close_releases_once_and_later_runs_fail(lite: Any, version: Path) -> None:
    backend = load(version)
    backend.close()
    backend.close()
    assert lite.made[0].released
    with pytest.raises(RuntimeError, match="released"):
        backend.run(["x"], {"image": np.zeros((1, 3, 64, 64), np.float32)})
