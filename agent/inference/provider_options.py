"""ONNX Runtime execution providers with their options, per model instance: a pure function of
the instance's device, the model's precision, the board (discovery) and the runtime versions.

TensorRT's engines and timing cache, and OpenVINO's compiled blobs, live under the state
directory in a directory named by a fingerprint of everything a compiled engine depends on
(model sha256, ORT, TensorRT, CUDA/OpenVINO versions, the GPU/SoC, device and precision): a
change of any of them gives a new directory, so a stale engine is never loaded.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from agent.discovery.model import Topology
from agent.inference.devices import Device, intel_gpu, intel_npu, rockchip_npu_cores
from agent.inference.errors import SessionError
from agent.inference.providers import CPU, CUDA, OPENVINO, TENSORRT, choose_providers

ProviderOptions = tuple[str, dict[str, str]]  # what ORT's ``providers=`` takes


@dataclass(frozen=True)
class RuntimeVersions:
    """The inference runtimes present (None: absent or unknown)."""

    onnxruntime: str
    tensorrt: str | None = None
    cuda: str | None = None
    openvino: str | None = None
    librknnrt: str | None = None


@dataclass(frozen=True)
class ProviderPlan:
    """How one instance runs: ``backend`` ``onnxruntime`` with ``providers``, or ``rknn``."""

    backend: str  # onnxruntime | rknn
    providers: tuple[ProviderOptions, ...] = ()
    precision: str = "fp32"  # what the instance really computes in
    cache_dir: Path | None = None  # TensorRT's engines / OpenVINO's blobs

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.providers]

    @property
    def compiles(self) -> bool:
        """Whether building the session compiles an engine (minutes, for TensorRT)."""
        return TENSORRT in self.names


def fingerprint(*parts: str | None) -> str:
    """A directory name for what a compiled engine depends on."""
    return hashlib.sha256("|".join(p or "-" for p in parts).encode()).hexdigest()[:24]


def _silicon(topology: Topology, device: Device) -> str:
    """The GPU or SoC an engine was built for: a Jetson by its module (an Orin Nano's GPU
    has half the AGX Orin's SMs on the same SoC), a discrete card by its UUID."""
    gpus = [g for g in topology.gpus if g.vendor == "nvidia"]
    gpu = gpus[device.index] if device.kind == "gpu" and device.index < len(gpus) else (
        gpus[0] if gpus else None)
    name = f"{gpu.name}/{gpu.uuid or gpu.pci_bdf or ''}" if gpu else ""
    board = topology.board
    return f"{board.soc or ''}/{board.module or board.model or ''}/{name}"


def plan_instance(device: Device, precision: str, topology: Topology,
                  available: Sequence[str], versions: RuntimeVersions, *,
                  model_sha256: str, state_dir: Path,
                  override: Sequence[str] | None = None) -> ProviderPlan:
    """The backend and providers (with options) of one instance; SessionError naming the
    device and what it needs when this board or this ORT cannot run it."""
    if device.kind == "npu" and rockchip_npu_cores(topology):
        return ProviderPlan("rknn", precision=precision)
    names = _names(device, topology, available, override)
    cache = None
    if TENSORRT in names or OPENVINO in names:
        runtime = versions.tensorrt if TENSORRT in names else versions.openvino
        key = fingerprint(model_sha256, versions.onnxruntime, runtime, versions.cuda,
                          _silicon(topology, device), str(device), precision)
        kind = "tensorrt" if TENSORRT in names else "openvino"
        cache = state_dir / "engine-cache" / kind / key
    if device.kind == "cpu":
        # the model's precision is its accelerators': beside NPU or DLA instances a CPU one
        # runs the fp32 ONNX model, and says so
        return ProviderPlan("onnxruntime", ((CPU, {}),), "fp32")
    _check_precision(device, precision, names)
    built = tuple(_options(name, device, precision, topology, cache) for name in names)
    return ProviderPlan("onnxruntime", built, precision, cache)


def _names(device: Device, topology: Topology, available: Sequence[str],
           override: Sequence[str] | None) -> list[str]:
    """The providers for ``device``, best first, all of them in ``available``."""
    if device.kind == "auto":
        return choose_providers(available, topology, override)
    if device.kind == "cpu":
        return [CPU]
    if device.kind == "dla":
        wanted, why = [TENSORRT, CUDA, CPU], "only TensorRT reaches a DLA"
    elif device.kind == "gpu" and intel_gpu(topology) and not any(
            g.vendor == "nvidia" for g in topology.gpus):
        wanted, why = [OPENVINO, CPU], "OpenVINO drives the Intel GPU"
    elif device.kind == "gpu":
        wanted, why = [TENSORRT, CUDA, CPU], "CUDA or TensorRT drives an NVIDIA GPU"
    elif device.kind == "npu" and intel_npu(topology):
        wanted, why = [OPENVINO, CPU], "OpenVINO drives the Intel NPU"
    else:
        raise SessionError(f"device {device}: no backend here drives it")
    chosen = [name for name in wanted if name in available]
    if chosen == [CPU]:
        raise SessionError(f"device {device}: {why}, and onnxruntime here has neither "
                           f"(available: {', '.join(available)})")
    return chosen


def _check_precision(device: Device, precision: str, names: Sequence[str]) -> None:
    if device.kind == "dla" and precision == "fp32":
        raise SessionError(f"device {device}: the DLA runs fp16 or int8 only; set "
                           "precision: fp16 (or int8) in the model's config.yaml")
    if precision == "fp32":
        return
    if TENSORRT in names or (OPENVINO in names and precision == "fp16"):
        return
    raise SessionError(f"device {device}: precision {precision} needs "
                       f"{'TensorRT' if precision == 'int8' else 'TensorRT or OpenVINO'}, "
                       f"and this instance runs on {', '.join(names)}")


def _options(name: str, device: Device, precision: str, topology: Topology,
             cache: Path | None) -> ProviderOptions:
    gpu = str(device.index) if device.kind == "gpu" else "0"
    if name == TENSORRT:
        return name, _tensorrt(device, precision, gpu, cache)
    if name == CUDA:
        return name, {"device_id": gpu}
    if name == OPENVINO:
        return name, _openvino(device, precision, topology, cache)
    return name, {}


def _tensorrt(device: Device, precision: str, gpu: str, cache: Path | None) -> dict[str, str]:
    options = {"device_id": gpu,
               "trt_fp16_enable": "1" if precision in ("fp16", "int8") else "0",
               "trt_int8_enable": "1" if precision == "int8" else "0"}
    if device.kind == "dla":
        options |= {"trt_dla_enable": "1", "trt_dla_core": str(device.index)}
    if cache is not None:
        options |= {"trt_engine_cache_enable": "1", "trt_engine_cache_path": str(cache),
                    "trt_timing_cache_enable": "1", "trt_timing_cache_path": str(cache)}
    return options


def _openvino(device: Device, precision: str, topology: Topology,
              cache: Path | None) -> dict[str, str]:
    if device.kind == "npu":
        target = "NPU"
    elif device.kind == "gpu" or (device.kind == "auto" and intel_gpu(topology)):
        target = "GPU"
    elif device.kind == "auto" and intel_npu(topology):
        target = "NPU"
    else:
        target = "CPU"
    options = {"device_type": target}
    if precision == "fp16" or target != "NPU":  # an NPU computes in FP16 whatever is asked
        options["precision"] = precision.upper()
    if cache is not None:
        options["cache_dir"] = str(cache)
    return options
