"""Which onnxruntime distribution carries the execution providers this board can use.

``install.sh`` asks this before pip runs (``python -m agent.discovery.onnxruntime_choice
--root /``, with the system python and the checkout on the path: it needs the standard
library only).  It prints three lines, distribution, index URL (``-`` for PyPI) and why:

- **Jetson** (JetPack 6, L4T R36.4, CUDA 12.6): ``onnxruntime-gpu`` from NVIDIA's Jetson AI
  Lab index ``https://pypi.jetson-ai-lab.io/jp6/cu126`` (CUDA and TensorRT providers).
  PyPI's aarch64 ``onnxruntime`` wheel is CPU-only and PyPI has no aarch64
  ``onnxruntime-gpu``.  The index is per JetPack and CUDA (``jp6/cu126`` for JetPack
  6.1/6.2 on Ubuntu 22.04, ``jp6/cu129`` for CUDA 12.9); for releases without a known
  index (JetPack 5, JetPack 6.0's CUDA 12.2 and cuDNN 8) the choice is the CPU wheel, and
  says how to name an index.
- **x86 with an NVIDIA GPU** (driver ``nvidia`` bound): ``onnxruntime-gpu`` from PyPI
  (CUDA 12 and cuDNN 9 must be installed for its CUDA provider to load).
- **x86 with an Intel NPU or GPU** (``intel_vpu``; ``i915``/``xe``): ``onnxruntime-openvino``
  from PyPI (OpenVINO provider, ``device_type`` NPU/GPU/CPU).
- **Everything else** (Rockchip: the NPU runs through rknn-toolkit-lite2, not ORT; CPU
  boxes): ``onnxruntime`` from PyPI.

``EDGE_AGENT_ONNXRUNTIME`` (a distribution, or ``auto``) and ``EDGE_AGENT_ONNXRUNTIME_INDEX``
(an index URL) override the choice; install.sh's ``--onnxruntime`` and
``--onnxruntime-index`` set them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from agent.discovery.model import Topology
from agent.discovery.nvml import NvmlGpu

PYPI = "-"
JETSON_AI_LAB = "https://pypi.jetson-ai-lab.io"
# (L4T major, CUDA major.minor) -> index path; only pairs seen served by the index.
JETSON_INDEXES = {("36", "12.6"): "jp6/cu126", ("36", "12.9"): "jp6/cu129"}
# The CUDA a JetPack ships when the root does not say (no /usr/local/cuda in a container).
CUDA_BY_L4T = {"36.4": "12.6"}
DISTRIBUTIONS = ("onnxruntime", "onnxruntime-gpu", "onnxruntime-openvino")
OVERRIDE = "EDGE_AGENT_ONNXRUNTIME"
OVERRIDE_INDEX = "EDGE_AGENT_ONNXRUNTIME_INDEX"
INTEL_GPU_DRIVERS = ("i915", "xe")


class Choice(NamedTuple):
    distribution: str
    index_url: str  # an index URL, or PYPI
    reason: str

    def lines(self) -> str:
        return f"{self.distribution}\n{self.index_url}\n{self.reason}\n"


def _jetson(topology: Topology) -> Choice:
    board, cuda = topology.board, topology.runtimes.cuda
    l4t = board.l4t or ""
    cuda_version = ".".join((cuda.version or "").split(".")[:2]) if cuda else ""
    cuda_version = cuda_version or CUDA_BY_L4T.get(".".join(l4t.split(".")[:2]), "")
    path = JETSON_INDEXES.get((l4t.split(".")[0], cuda_version))
    release = f"JetPack {board.jetpack or '?'} (L4T {l4t or '?'}, CUDA {cuda_version or '?'})"
    if path is None:
        return Choice("onnxruntime", PYPI, f"{release}: no known Jetson AI Lab index for this "
                      f"release, so the CPU wheel; name one with {OVERRIDE_INDEX} (and "
                      f"{OVERRIDE}=onnxruntime-gpu) for the CUDA and TensorRT providers")
    return Choice("onnxruntime-gpu", f"{JETSON_AI_LAB}/{path}",
                  f"{release}: NVIDIA's Jetson build has the CUDA and TensorRT providers "
                  "(PyPI's aarch64 onnxruntime is CPU-only)")


def choose(topology: Topology, environ: Mapping[str, str] | None = None) -> Choice:
    """The distribution for this topology; ``environ`` supplies the overrides."""
    env = os.environ if environ is None else environ
    wanted, index = env.get(OVERRIDE, "auto") or "auto", env.get(OVERRIDE_INDEX, "")
    if wanted != "auto":
        return Choice(wanted, index or PYPI, f"{OVERRIDE}={wanted} (set by the installer's "
                      "--onnxruntime or the environment)")
    choice = _detected(topology)
    if index:
        return choice._replace(index_url=index, reason=f"{choice.reason}; index {index} from "
                               f"{OVERRIDE_INDEX}")
    return choice


def _detected(topology: Topology) -> Choice:
    board = topology.board
    if board.family == "jetson":
        return _jetson(topology)
    if board.arch not in (None, "x86_64"):
        return Choice("onnxruntime", PYPI, f"{board.family} {board.soc or board.arch}: no ORT "
                      "build with an accelerator provider for it on PyPI" + _npu_note(topology))
    nvidia = [g for g in topology.gpus if g.vendor == "nvidia" and g.driver == "nvidia"]
    if nvidia:
        return Choice("onnxruntime-gpu", PYPI, f"{nvidia[0].name} at {nvidia[0].pci_bdf} "
                      "(driver nvidia): "
                      "CUDA and TensorRT providers (they need CUDA 12 and cuDNN 9 installed)")
    intel = [f"Intel NPU ({n.driver})" for n in topology.npus if n.driver == "intel_vpu"] + [
        f"Intel GPU ({g.driver})" for g in topology.gpus
        if g.vendor == "intel" and g.driver in INTEL_GPU_DRIVERS]
    if intel:
        return Choice("onnxruntime-openvino", PYPI, f"{' and '.join(intel)}: OpenVINO provider")
    return Choice("onnxruntime", PYPI, "no accelerator an onnxruntime build on PyPI can use: "
                  "the CPU provider")


def _npu_note(topology: Topology) -> str:
    drivers = {n.driver for n in topology.npus}
    if "rknpu" in drivers:
        return " (its NPU runs models through rknn-toolkit-lite2, the RKNN backend)"
    if "rocket" in drivers:
        return " (its mainline Rocket NPU is driven from Mesa's Teflon delegate, not ORT)"
    return ""


def main(argv: Sequence[str] | None = None) -> int:
    from agent.discovery import discover
    from agent.kernel.fsroot import Root

    parser = argparse.ArgumentParser(prog="python -m agent.discovery.onnxruntime_choice",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default="/", help="the root to read (default: /)")
    parser.add_argument("--json", action="store_true", help="one JSON object")
    args = parser.parse_args(argv)
    choice = choose(discover(Root(args.root), nvml=_NoNvml()))
    sys.stdout.write(json.dumps(choice._asdict()) + "\n" if args.json else choice.lines())
    return 0


class _NoNvml:
    """The choice needs the PCI driver only: NVML is not asked (nor imported)."""

    def gpus(self) -> list[NvmlGpu]:
        return []


if __name__ == "__main__":
    sys.exit(main())
