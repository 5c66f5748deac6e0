"""Which ONNX Runtime execution providers (EPs) inference asks for on this board.

The board's accelerators, from discovery, decide the order; only EPs this ORT build has are
ever asked for, since asking for a missing one is an error.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from agent.discovery.model import Topology
from agent.inference.errors import SessionError

logger = logging.getLogger(__name__)

TENSORRT = "TensorrtExecutionProvider"
CUDA = "CUDAExecutionProvider"
OPENVINO = "OpenVINOExecutionProvider"
CPU = "CPUExecutionProvider"


def choose_providers(available: Sequence[str], topology: Topology,
                     override: Sequence[str] | None = None) -> list[str]:
    """Accelerator EPs this board can use, best first, CPU last; ``override`` wins if given.

    Only EPs in ``available`` (``onnxruntime.get_available_providers()``) are returned: asking
    ORT for a missing one is an error.  Azure is never picked here: it is a remote endpoint.
    """
    if override:
        return _filter_override(available, override)
    wanted: list[str] = []
    if _has_nvidia(topology):
        wanted += [TENSORRT, CUDA]
    if _has_intel_accelerator(topology):
        wanted.append(OPENVINO)
    wanted.append(CPU)
    return [name for name in wanted if name in available]


def _has_nvidia(topology: Topology) -> bool:
    """Jetsons have an integrated CUDA GPU; elsewhere only a discrete NVIDIA card counts."""
    return topology.board.family == "jetson" or any(
        gpu.vendor == "nvidia" and gpu.kind == "discrete" for gpu in topology.gpus)


def _has_intel_accelerator(topology: Topology) -> bool:
    """OpenVINO pays off on x86 only with an Intel GPU or NPU to offload to."""
    return topology.board.family == "x86" and (
        any(gpu.vendor == "intel" for gpu in topology.gpus)
        or any(npu.driver == "intel_vpu" for npu in topology.npus))


def _filter_override(available: Sequence[str], override: Sequence[str]) -> list[str]:
    """The operator's order, minus EPs this ORT build lacks; an error if none is left."""
    requested = list(dict.fromkeys(override))
    chosen = [name for name in requested if name in available]
    missing = [name for name in requested if name not in available]
    if not chosen:
        raise SessionError(f"none of the requested providers {missing} is available; "
                           f"available: {list(available)}")
    if missing:
        logger.warning("providers %s are not available here; using %s", missing, chosen)
    return chosen
