"""Which INT8 variants a build tries for a target, in order: the usual best first, then the
usual remedies when it fails the gate or is not faster (per-tensor scales, outlier-robust
ranges, sensitive nodes left in float).  Data only, so a report can name what it tried."""

from __future__ import annotations

import platform
from dataclasses import dataclass

# nodes whose INT8 error a classifier's answer is most sensitive to: hard-swish and
# squeeze-excite gates (HardSigmoid / Sigmoid and the Mul they feed) and the pooling that
# feeds the gates
SENSITIVE_TYPES = ("HardSwish", "HardSigmoid", "Sigmoid", "Mul", "GlobalAveragePool",
                   "ReduceMean", "Softmax")


@dataclass(frozen=True)
class Variant:
    name: str
    activation: str  # "uint8" | "int8"
    weight: str  # "int8" | "uint8"
    per_channel: bool = True
    method: str = "minmax"  # "minmax" | "percentile" | "entropy"
    symmetric: bool = False  # symmetric activations (TensorRT's explicit quantization)
    keep_sensitive_float: bool = False

    def settings(self) -> dict[str, object]:
        """What the report records of it."""
        return {"activation": self.activation, "weight": self.weight,
                "per_channel": self.per_channel, "calibration": self.method,
                "symmetric_activations": self.symmetric,
                "float_nodes": list(SENSITIVE_TYPES) if self.keep_sensitive_float else []}


def isa_types() -> tuple[str, str]:
    """(activation, weight) types ONNX Runtime's CPU kernels run fastest: U8S8 on x86-64
    (VPMADDUBSW, and VNNI where present, multiply unsigned by signed bytes; S8S8 ran 3.6x
    slower on a ResNet here), S8S8 on ARM64 (its SDOT kernels take signed bytes)."""
    return ("int8", "int8") if machine() in ("aarch64", "arm64") else ("uint8", "int8")


def for_target(target: str) -> tuple[Variant, ...]:
    """The ordered variants for ``cpu``, ``openvino`` or ``tensorrt``."""
    if target == "tensorrt":  # TensorRT's explicit quantization takes symmetric S8S8 only
        name = "s8s8-symmetric-per-channel"
        return (Variant(name, "int8", "int8", symmetric=True),
                Variant(f"{name}-percentile", "int8", "int8", symmetric=True,
                        method="percentile"),
                Variant(f"{name}-float-sensitive", "int8", "int8", symmetric=True,
                        keep_sensitive_float=True))
    activation, weight = isa_types()
    tag = f"{activation[0]}8{weight[0]}8".replace("i", "s")
    return (Variant(f"{tag}-per-channel", activation, weight),
            Variant(f"{tag}-per-tensor", activation, weight, per_channel=False),
            Variant(f"{tag}-per-channel-percentile", activation, weight, method="percentile"),
            Variant(f"{tag}-per-channel-float-sensitive", activation, weight,
                    keep_sensitive_float=True))


def machine() -> str:
    """The ISA the report names (the variants' types depend on it)."""
    return platform.machine() or "unknown"
