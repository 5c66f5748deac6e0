"""An accelerator discovery found but inference does not reach is said out loud: by
``unused_accelerators``, the selftest (a warning, not a failure), status.json and birth.

The boards are the fixture trees of real ones; the provider list is this machine's real
onnxruntime's (CPU only), plus the lists other builds offer, as in choose_providers' tests."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import onnxruntime as ort  # type: ignore[import-untyped]
import pytest
from agent_process import FIXTURES, start_agent, status, write_config
from mqtt_helpers import Broker, Subscriber, wait_until

from agent.discovery import discover
from agent.inference.accelerators import unused_accelerators
from agent.inference.providers import CPU, CUDA, OPENVINO, TENSORRT, choose_providers
from agent.kernel.fsroot import Root

HERE = ort.get_available_providers()
HERE_TEXT = ", ".join(HERE)
ORIN = "jetson-agx-orin-jp6"
JETPACK_WHEEL = "install the onnxruntime-gpu wheel built for JetPack 6.2"
RKNN = ("no ONNX Runtime provider drives the Rockchip NPU: edge-agent's RKNN backend runs a "
        "model there whose version holds a model.rknn (beside its model.onnx) and whose "
        "instances name npu:N")
EDGE_TPU = "no ONNX Runtime provider drives the Edge TPU"

needs_cpu_only_ort = pytest.mark.skipif(
    any(name in HERE for name in (TENSORRT, CUDA, OPENVINO)),
    reason="this onnxruntime has an accelerator provider")


def unused(board: str, available: list[str], override: list[str] | None = None
           ) -> dict[str, str]:
    topology = discover(Root(FIXTURES / board))
    chosen = choose_providers(available, topology, override)
    return {a.device: a.reason for a in unused_accelerators(available, topology, chosen)}


@needs_cpu_only_ort
@pytest.mark.parametrize(("board", "expected"), [
    (ORIN, {
        "gpu ga10b": f"onnxruntime here has no TensorRT/CUDA provider (available: {HERE_TEXT}); "
                     f"{JETPACK_WHEEL}",
        "npu dla0": "only the TensorRT provider reaches the DLA, and onnxruntime here has no "
                    f"TensorRT provider (available: {HERE_TEXT}); {JETPACK_WHEEL}",
        "npu dla1": "only the TensorRT provider reaches the DLA, and onnxruntime here has no "
                    f"TensorRT provider (available: {HERE_TEXT}); {JETPACK_WHEEL}"}),
    ("jetson-orin-nano-jp6", {
        "gpu ga10b": f"onnxruntime here has no TensorRT/CUDA provider (available: {HERE_TEXT}); "
                     f"{JETPACK_WHEEL}"}),
    ("rk3588-vendor", {"npu rknpu": RKNN}),  # the Mali is no inference device
    ("rk3588-mainline", {"npu rocket": RKNN}),
    ("x86-server-nvidia", {
        "gpu NVIDIA GPU 0x27b8": "onnxruntime here has no TensorRT/CUDA provider (available: "
                                 f"{HERE_TEXT}); install onnxruntime-gpu",
        "npu coral-edgetpu-pcie": EDGE_TPU}),
    ("bare-vm", {}),
])
def test_what_this_onnxruntime_leaves_unused(board: str, expected: dict[str, str]) -> None:
    found = unused(board, HERE)
    assert list(found) == list(expected)
    for device, reason in expected.items():
        assert found[device].startswith(reason), found[device]


@needs_cpu_only_ort
def test_every_accelerator_of_the_intel_box_is_named() -> None:
    found = unused("x86-edge-npu", HERE)
    assert list(found) == ["gpu Intel GPU 0x7d55", "npu intel-npu", "npu hailo8",
                           "npu coral-edgetpu-usb"]
    assert found["npu intel-npu"] == (f"onnxruntime here has no OpenVINO provider (available: "
                                      f"{HERE_TEXT}); install onnxruntime-openvino")
    assert "HailoRT" in found["npu hailo8"] and EDGE_TPU in found["npu coral-edgetpu-usb"]


def test_with_tensorrt_only_the_dla_is_left() -> None:
    found = unused(ORIN, [TENSORRT, CUDA, CPU])
    assert found == dict.fromkeys(["npu dla0", "npu dla1"], (
        "TensorRT runs the default model on the GPU: a model reaches the DLA through "
        "instances on dla:N (precision fp16 or int8) in its config.yaml"))


def test_a_cuda_only_build_uses_the_gpu_but_not_the_dla() -> None:
    found = unused(ORIN, [CUDA, CPU])
    assert list(found) == ["npu dla0", "npu dla1"]
    assert "no TensorRT provider (available: CUDAExecutionProvider, CPUExecutionProvider)" \
        in found["npu dla0"]


def test_providers_configured_away_are_named_as_such() -> None:
    found = unused(ORIN, [TENSORRT, CUDA, CPU], override=[CPU])
    assert found["gpu ga10b"] == ("the configured providers (CPUExecutionProvider) leave out "
                                  "TensorrtExecutionProvider, CUDAExecutionProvider")


def test_openvino_reaches_the_intel_devices_but_not_hailo_or_coral() -> None:
    assert list(unused("x86-edge-npu", [OPENVINO, CPU])) == ["npu hailo8",
                                                             "npu coral-edgetpu-usb"]


# -- as an operator sees it ----------------------------------------------------------------

def selftest(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agent", "selftest", "--config", str(config),
                           *args], capture_output=True, text=True, timeout=120, check=False)


@needs_cpu_only_ort
def test_selftest_warns_and_still_passes(tmp_path: Path, broker: Broker) -> None:
    config = write_config(tmp_path, broker.port, FIXTURES / ORIN)
    result = selftest(config, "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    warned = [c for c in report["checks"] if c["status"] == "warn"]
    assert [c["name"] for c in warned] == ["accelerator"] * 3
    assert warned[0]["detail"].startswith("gpu ga10b is not used: onnxruntime here has no "
                                          "TensorRT/CUDA provider")
    assert report["ok"] is True
    assert {c["name"]: c["status"] for c in report["checks"]}["inference"] == "pass"
    text = selftest(config)
    assert text.returncode == 0
    assert "warn  accelerator gpu ga10b is not used: " in text.stdout
    assert text.stdout.splitlines()[-1] == "selftest passed with 3 warning(s)"


@needs_cpu_only_ort
def test_birth_and_status_name_the_unused_accelerators(tmp_path: Path,
                                                       broker: Broker) -> None:
    watcher = Subscriber(broker, ["edge/v1/lab/orin-1/birth"])
    config = write_config(tmp_path, broker.port, FIXTURES / "rk3588-vendor")
    agent = start_agent(config)
    try:
        assert wait_until(lambda: watcher.on("birth"), 60), agent.stdout
        capabilities = watcher.on("birth")[0]["capabilities"]
        assert capabilities["npus"] == ["rknpu"]  # unchanged beside the new key
        assert capabilities["unused_accelerators"] == [
            {"device": "npu rknpu", "kind": "npu", "name": "rknpu", "reason": RKNN}]
        assert wait_until(lambda: status(config)[0] == 0, 30)
        state = status(config)[1]
        assert state["warnings"] == [f"npu rknpu is not used: {RKNN}"]
        assert state["problems"] == []  # it runs, on the CPU: not degraded
        text = subprocess.run([sys.executable, "-m", "agent", "status", "--state-dir",
                               str(config.parent / "state")], capture_output=True, text=True,
                              timeout=60, check=False).stdout
        assert f"warning: npu rknpu is not used: {RKNN}" in text
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.communicate(timeout=30)
        watcher.close()
    assert agent.returncode == 0


@needs_cpu_only_ort
def test_infer_says_which_accelerator_it_leaves_unused(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "agent", "infer", "--root",
                             str(FIXTURES / "rk3588-vendor"), "--seconds", "0.3", "--json",
                             "--state-dir", str(tmp_path / "state")],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["unused_accelerators"] == [
        {"device": "npu rknpu", "kind": "npu", "name": "rknpu", "reason": RKNN}]
