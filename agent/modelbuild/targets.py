"""Where a build's candidates run while it judges them: the target's own execution provider
when this machine has it (then the speed ratio is measured), else ONNX Runtime's CPU
provider for the accuracy gate alone, and the report says why no speed was measured."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import onnxruntime as ort

from agent.modelbuild.request import PROVIDERS, BuildRequest

CPU = "CPUExecutionProvider"


@dataclass(frozen=True)
class Plan:
    providers: tuple[Any, ...]  # ONNX Runtime's providers argument
    measured_with: str
    speed_note: str | None  # None: the speed ratio is measured here


def plan(request: BuildRequest) -> Plan:
    if request.rknn_platform:
        return Plan((CPU,), f"rknn-toolkit2's {request.rknn_platform} simulator",
                    "the toolkit's simulator gives accuracy, not NPU speed; the set-model "
                    "canary on the device judges its latency")
    wanted = PROVIDERS.get(request.target)
    if wanted is None:
        return Plan((CPU,), CPU, None)
    available = ort.get_available_providers()
    if wanted not in available:
        return Plan((CPU,), CPU, f"{wanted} is not in this onnxruntime build "
                    f"({', '.join(available)}); the accuracy gate ran the same QDQ graph on "
                    "the CPU provider")
    if request.target == "tensorrt":
        options = {"trt_int8_enable": request.precision == "int8",
                   "trt_fp16_enable": True}
        return Plan(((wanted, options), "CUDAExecutionProvider", CPU), wanted, None)
    return Plan(((wanted, {"device_type": "CPU"}), CPU), wanted, None)
