"""Provider options per instance, precision and board: TensorRT (FP16/INT8, DLA, engine and
timing caches keyed by a device fingerprint), CUDA device ids, OpenVINO device types and its
cache, against the fixture boards' discovered topologies."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest

from agent.discovery import discover
from agent.discovery.model import Topology
from agent.inference.devices import allowed_devices, core_mask, device_problem, parse_device
from agent.inference.errors import SessionError
from agent.inference.provider_options import RuntimeVersions, plan_instance
from agent.inference.providers import CPU, CUDA, OPENVINO, TENSORRT
from agent.kernel.fsroot import Root

FIXTURES = Path(__file__).parent / "fixtures"
JETSON_ORT = [TENSORRT, CUDA, CPU]
OPENVINO_ORT = [OPENVINO, CPU]
VERSIONS = RuntimeVersions(onnxruntime="1.20.0", tensorrt="10.3.0", cuda="12.6")
STATE = Path("/var/lib/edge-agent")
SHA = "ab" * 32


@cache
def board(name: str) -> Topology:
    return discover(Root(FIXTURES / name))


def plan(board_name: str, device: str, precision: str = "fp32",
         available: list[str] | None = None, versions: RuntimeVersions = VERSIONS,
         sha: str = SHA) -> object:
    return plan_instance(parse_device(device), precision, board(board_name),
                         available or JETSON_ORT, versions, model_sha256=sha,
                         state_dir=STATE)


def test_the_orin_offers_its_gpu_and_both_dlas() -> None:
    assert allowed_devices(board("jetson-agx-orin-jp6")) == ["auto", "cpu", "gpu:0", "dla:0",
                                                             "dla:1"]


def test_a_dla_instance_runs_tensorrt_on_that_core_with_gpu_fallback() -> None:
    built = plan("jetson-agx-orin-jp6", "dla:1", "fp16")
    assert built.backend == "onnxruntime" and built.names == [TENSORRT, CUDA, CPU]
    trt = dict(built.providers)[TENSORRT]
    cache_dir = str(built.cache_dir)
    assert trt == {"device_id": "0", "trt_fp16_enable": "1", "trt_int8_enable": "0",
                   "trt_dla_enable": "1", "trt_dla_core": "1",
                   "trt_engine_cache_enable": "1", "trt_engine_cache_path": cache_dir,
                   "trt_timing_cache_enable": "1", "trt_timing_cache_path": cache_dir}
    assert cache_dir.startswith(str(STATE / "engine-cache" / "tensorrt") + "/")
    assert built.compiles


def test_int8_turns_on_both_tensorrt_precisions() -> None:
    trt = dict(plan("jetson-agx-orin-jp6", "gpu:0", "int8").providers)[TENSORRT]
    assert (trt["trt_fp16_enable"], trt["trt_int8_enable"]) == ("1", "1")
    assert "trt_dla_enable" not in trt


def test_a_dla_in_fp32_is_refused_with_what_to_set() -> None:
    with pytest.raises(SessionError, match="dla:0: the DLA runs fp16 or int8 only; set "
                                           "precision: fp16"):
        plan("jetson-agx-orin-jp6", "dla:0")


@pytest.mark.parametrize("changed", [
    {"sha": "cd" * 32},
    {"versions": RuntimeVersions("1.20.0", tensorrt="10.7.0", cuda="12.6")},
    {"versions": RuntimeVersions("1.21.0", tensorrt="10.3.0", cuda="12.6")},
    {"versions": RuntimeVersions("1.20.0", tensorrt="10.3.0", cuda="12.8")},
])
def test_any_change_of_the_fingerprint_gives_a_new_engine_directory(changed: dict) -> None:
    before = plan("jetson-agx-orin-jp6", "gpu:0", "fp16").cache_dir
    assert plan("jetson-agx-orin-jp6", "gpu:0", "fp16").cache_dir == before  # stable
    assert plan("jetson-agx-orin-jp6", "gpu:0", "fp16", **changed).cache_dir != before


def test_another_soc_gives_a_new_engine_directory() -> None:
    orin = plan("jetson-agx-orin-jp6", "gpu:0", "fp16").cache_dir
    nano = plan("jetson-orin-nano-jp6", "gpu:0", "fp16").cache_dir
    assert orin != nano


def test_cuda_gets_the_instance_gpu_and_a_cuda_only_ort_still_serves() -> None:
    built = plan("x86-server-nvidia", "gpu:0", available=[CUDA, CPU])
    assert built.providers == ((CUDA, {"device_id": "0"}), (CPU, {}))
    assert built.cache_dir is None and not built.compiles


def test_auto_keeps_the_discovered_order_with_options() -> None:
    built = plan("jetson-agx-orin-jp6", "auto")
    assert built.names == [TENSORRT, CUDA, CPU]
    assert dict(built.providers)[TENSORRT]["trt_fp16_enable"] == "0"


def test_a_cpu_instance_runs_on_the_cpu_only_even_on_a_jetson() -> None:
    assert plan("jetson-agx-orin-jp6", "cpu").providers == ((CPU, {}),)


def test_a_cpu_instance_computes_fp32_whatever_the_models_precision() -> None:
    built = plan("rk3588-vendor", "cpu", "int8", available=[CPU])
    assert (built.names, built.precision) == ([CPU], "fp32")


def test_fp16_where_only_the_cpu_runs_is_refused_naming_what_it_needs() -> None:
    with pytest.raises(SessionError, match="auto: precision fp16 needs TensorRT or OpenVINO, "
                                           "and this instance runs on CPUExecutionProvider"):
        plan("bare-vm", "auto", "fp16", available=[CPU])


def test_the_intel_npu_runs_openvino_npu_with_its_cache() -> None:
    topology = board("x86-edge-npu")
    assert allowed_devices(topology) == ["auto", "cpu", "gpu:0", "npu:0"]
    versions = RuntimeVersions("1.20.0", openvino="2024.4")
    built = plan("x86-edge-npu", "npu:0", "fp16", available=OPENVINO_ORT, versions=versions)
    options = dict(built.providers)[OPENVINO]
    assert options == {"device_type": "NPU", "precision": "FP16",
                       "cache_dir": str(built.cache_dir)}
    assert str(built.cache_dir).startswith(str(STATE / "engine-cache" / "openvino"))
    gpu = dict(plan("x86-edge-npu", "gpu:0", available=OPENVINO_ORT,
                    versions=versions).providers)[OPENVINO]
    assert (gpu["device_type"], gpu["precision"]) == ("GPU", "FP32")
    auto = dict(plan("x86-edge-npu", "auto", available=OPENVINO_ORT,
                     versions=versions).providers)[OPENVINO]
    assert auto["device_type"] == "GPU"  # the iGPU first: the NPU is asked for by name


def test_an_npu_without_openvino_says_what_is_missing() -> None:
    with pytest.raises(SessionError, match="OpenVINO drives the Intel NPU, and onnxruntime "
                                           "here has neither"):
        plan("x86-edge-npu", "npu:0", available=[CPU])


def test_the_rk3588_offers_three_npu_cores_and_their_ranges() -> None:
    topology = board("rk3588-vendor")
    assert allowed_devices(topology) == ["auto", "cpu", "npu:0", "npu:1", "npu:2", "npu:0-1",
                                         "npu:0-2"]
    assert plan("rk3588-vendor", "npu:2", available=[CPU]).backend == "rknn"
    assert plan("rk3588-mainline", "npu:0-2", available=[CPU]).backend == "rknn"
    assert device_problem("npu:1-2", topology) is None


@pytest.mark.parametrize(("device", "mask"), [("npu:0", 1), ("npu:1", 2), ("npu:2", 4),
                                              ("npu:0-1", 3), ("npu:0-2", 7)])
def test_core_masks_are_rknnlites(device: str, mask: int) -> None:
    assert core_mask(parse_device(device)) == mask


def test_a_device_the_board_lacks_names_what_it_has() -> None:
    assert device_problem("dla:2", board("jetson-agx-orin-jp6")) == (
        "'dla:2' is not on this board (discovered here: auto, cpu, gpu:0, dla:0, dla:1)")
    assert device_problem("npu:0", board("jetson-agx-orin-jp6")) is not None
    assert device_problem("gpu:0", board("rk3588-vendor")) == (
        "'gpu:0' is not on this board (discovered here: auto, cpu, npu:0, npu:1, npu:2, "
        "npu:0-1, npu:0-2)")


def test_runtime_versions_are_read_from_cuda_files_and_library_names(tmp_path: Path) -> None:
    from agent.inference.runtimes import _library, parse_cuda_version

    assert parse_cuda_version('{"cuda": {"name": "CUDA SDK", "version": "12.6.68"}}') == \
        "12.6.68"
    assert parse_cuda_version("CUDA Version 10.2.89\n") == "10.2.89"
    assert parse_cuda_version("nonsense") is None
    for name in ("libnvinfer.so.8.6.2", "libnvinfer.so.10.3.0", "libnvinfer.so.10"):
        (tmp_path / name).touch()
    assert _library("libnvinfer", (str(tmp_path),)) == "10.3.0"
    assert _library("libcudart", (str(tmp_path),)) is None
