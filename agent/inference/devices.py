"""The devices a model instance can name (``instances[].device`` in a model's config.yaml),
what each means on this board, and which of them discovery found.

``auto``: the discovered provider order (what a model without a config runs on); ``cpu``: the
CPU only; ``gpu:N``: CUDA device N (TensorRT, else CUDA); ``dla:N``: DLA core N of a Jetson,
through TensorRT; ``npu:N`` or ``npu:A-B``: cores of a Rockchip NPU (RKNN), or an Intel NPU
(``npu:0``, through OpenVINO).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from agent.discovery.model import Topology

DEVICE = re.compile(r"^(auto|cpu|gpu:\d{1,2}|dla:\d{1,2}|npu:[0-2](-[0-2])?)$")
DEVICE_HELP = "auto, cpu, gpu:N, dla:N, npu:N or npu:A-B (cores 0..2)"


@dataclass(frozen=True)
class Device:
    """A parsed device name: its kind and the indices (cores) it takes, ascending."""

    kind: str  # auto | cpu | gpu | dla | npu
    indices: tuple[int, ...] = ()

    @property
    def index(self) -> int:
        return self.indices[0] if self.indices else 0

    def __str__(self) -> str:
        if not self.indices:
            return self.kind
        if len(self.indices) == 1:
            return f"{self.kind}:{self.indices[0]}"
        return f"{self.kind}:{self.indices[0]}-{self.indices[-1]}"


def parse_device(name: str) -> Device:
    """``npu:0-2`` -> Device("npu", (0, 1, 2)); ValueError for what DEVICE refuses."""
    if not DEVICE.match(name):
        raise ValueError(f"{name!r} is not a device ({DEVICE_HELP})")
    kind, _, rest = name.partition(":")
    if not rest:
        return Device(kind)
    first, _, last = rest.partition("-")
    low, high = int(first), int(last or first)
    if high < low:
        raise ValueError(f"{name!r}: the range runs backwards (write npu:{high}-{low})")
    return Device(kind, tuple(range(low, high + 1)))


def rockchip_npu_cores(topology: Topology) -> int:
    """The cores of the board's Rockchip NPU (0: none)."""
    for npu in topology.npus:
        if npu.vendor == "rockchip" or npu.driver in ("rknpu", "rocket"):
            return npu.cores or 1
    return 0


def _dla_cores(topology: Topology) -> int:
    return sum(1 for npu in topology.npus if npu.driver == "nvdla")


def cuda_gpus(topology: Topology) -> int:
    """NVIDIA GPUs CUDA runs on: a Jetson's integrated one, else discrete cards."""
    return sum(1 for gpu in topology.gpus if gpu.vendor == "nvidia"
               and (gpu.kind == "discrete" or topology.board.family == "jetson"))


def intel_gpu(topology: Topology) -> bool:
    return topology.board.family == "x86" and any(g.vendor == "intel" for g in topology.gpus)


def intel_npu(topology: Topology) -> bool:
    return topology.board.family == "x86" and any(n.driver == "intel_vpu" for n in topology.npus)


def allowed_devices(topology: Topology) -> list[str]:
    """Every device name an instance may use on this board, as discovery found it."""
    allowed = ["auto", "cpu"]
    gpus = cuda_gpus(topology) or int(intel_gpu(topology))  # an Intel GPU: OpenVINO's GPU
    allowed += [f"gpu:{index}" for index in range(gpus)]
    allowed += [f"dla:{index}" for index in range(_dla_cores(topology))]
    cores = rockchip_npu_cores(topology)
    if cores:
        allowed += [f"npu:{index}" for index in range(cores)]
        allowed += [f"npu:0-{last}" for last in range(1, cores)]
    elif intel_npu(topology):
        allowed.append("npu:0")
    return allowed


def device_problem(name: str, topology: Topology) -> str | None:
    """Why ``name`` cannot be used on this board (None: it can), naming what can."""
    try:
        device = parse_device(name)
    except ValueError as error:
        return str(error)
    allowed = allowed_devices(topology)
    if str(device) in allowed or device.kind in ("auto", "cpu"):
        return None
    if device.kind == "npu" and rockchip_npu_cores(topology) > max(device.indices):
        return None  # npu:1-2 is a range like npu:0-2, if not listed
    return (f"{name!r} is not on this board (discovered here: {', '.join(allowed)})")


# rknn-toolkit-lite2's RKNNLite.NPU_CORE_* values: one bit per core, 0 = the driver's choice
NPU_CORE_AUTO = 0


def core_mask(device: Device) -> int:
    """The RKNNLite ``core_mask`` for ``npu:…`` (npu:0 -> NPU_CORE_0 = 1, npu:0-2 ->
    NPU_CORE_0_1_2 = 7)."""
    if device.kind != "npu":
        raise ValueError(f"{device} is no NPU device: it has no core mask")
    mask = 0
    for index in device.indices:
        mask |= 1 << index
    return mask
