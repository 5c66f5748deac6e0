"""The accelerators discovery found that inference does not run on, and why: what an operator
reads in ``infer`` and the status report to see what would put them to work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from agent.discovery.model import Topology
from agent.inference.providers import CUDA, OPENVINO, TENSORRT


@dataclass(frozen=True)
class UnusedAccelerator:
    """A discovered accelerator inference does not run on, and why, for an operator."""

    kind: Literal["gpu", "npu"]
    name: str  # as discovery names it
    reason: str

    @property
    def device(self) -> str:
        return f"{self.kind} {self.name}"

    def to_dict(self) -> dict[str, str]:
        return {"device": self.device, "kind": self.kind, "name": self.name,
                "reason": self.reason}


def unused_accelerators(available: Sequence[str], topology: Topology,
                        providers: Sequence[str]) -> list[UnusedAccelerator]:
    """The GPUs and NPUs discovery found that ``providers`` (the EPs inference uses) do not
    reach, each with the reason and what would change it.

    GPUs no ONNX Runtime EP runs inference on (an Arm Mali, a VM's display adapter) are
    display devices to edge-agent and are not listed.  OpenVINO is taken to reach the Intel
    GPU and NPU it was chosen for.
    """
    unused = []
    for gpu in topology.gpus:
        reason = None
        if gpu.vendor == "nvidia" and (topology.board.family == "jetson"
                                       or gpu.kind == "discrete"):
            reason = _missing(available, providers, [TENSORRT, CUDA], _nvidia_wheel(topology))
        elif gpu.vendor == "intel" and topology.board.family == "x86":
            reason = _missing(available, providers, [OPENVINO], "install onnxruntime-openvino")
        if reason:
            unused.append(UnusedAccelerator("gpu", gpu.name, reason))
    for npu in topology.npus:
        reason = _npu_reason(available, providers, topology, npu.driver, npu.vendor)
        if reason:
            unused.append(UnusedAccelerator("npu", npu.name, reason))
    return unused


def _npu_reason(available: Sequence[str], providers: Sequence[str], topology: Topology,
                driver: str | None, vendor: str | None) -> str | None:
    if driver == "nvdla":
        if TENSORRT not in providers:
            return "only the TensorRT provider reaches the DLA, and " + _left_out(
                available, providers, [TENSORRT], _nvidia_wheel(topology))
        return ("TensorRT runs the default model on the GPU: a model reaches the DLA "
                "through instances on dla:N (precision fp16 or int8) in its config.yaml")
    if driver == "intel_vpu":
        return _missing(available, providers, [OPENVINO], "install onnxruntime-openvino")
    if vendor == "rockchip" or driver in ("rknpu", "rocket"):
        return ("no ONNX Runtime provider drives the Rockchip NPU: edge-agent's RKNN "
                "backend runs a model there whose version holds a model.rknn (beside its "
                "model.onnx) and whose instances name npu:N")
    if vendor == "hailo" or driver == "hailo_pci":
        return ("no ONNX Runtime provider drives Hailo devices (they run HEF models through "
                "HailoRT), and edge-agent has no Hailo backend")
    if vendor == "google":
        return ("no ONNX Runtime provider drives the Edge TPU (it runs TFLite models through "
                "libedgetpu), and edge-agent has no Edge TPU backend")
    return f"no ONNX Runtime provider here drives it (driver {driver or 'unknown'})"


_SHORT = {TENSORRT: "TensorRT", CUDA: "CUDA", OPENVINO: "OpenVINO"}


def _missing(available: Sequence[str], providers: Sequence[str], wanted: Sequence[str],
             remedy: str) -> str | None:
    """None when one of ``wanted`` is in use, else why none is."""
    if any(name in providers for name in wanted):
        return None
    return _left_out(available, providers, wanted, remedy)


def _left_out(available: Sequence[str], providers: Sequence[str], wanted: Sequence[str],
              remedy: str) -> str:
    """Whether this ORT lacks ``wanted`` (and what to install) or the configured provider
    list leaves them out."""
    names = "/".join(_SHORT[name] for name in wanted)
    present = [name for name in wanted if name in available]
    if present:
        return (f"the configured providers ({', '.join(providers) or 'none'}) leave out "
                f"{', '.join(present)}")
    return (f"onnxruntime here has no {names} provider (available: "
            f"{', '.join(available) or 'none'}); {remedy}")


def _nvidia_wheel(topology: Topology) -> str:
    if topology.board.family == "jetson":
        jetpack = f" {topology.board.jetpack}" if topology.board.jetpack else ""
        return f"install the onnxruntime-gpu wheel built for JetPack{jetpack}"
    return "install onnxruntime-gpu"
