"""What one build is asked to do, checked before any work starts: every refusal names the
flag (or command argument) and the values it allows."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

Feed = dict[str, "np.ndarray"]  # input name -> array with the batch dimension
Progress = Callable[[str], None]  # one short step, e.g. "calibrating int8 (per-channel)"

TARGETS = ("cpu", "tensorrt", "openvino")
PROVIDERS = {"tensorrt": "TensorrtExecutionProvider", "openvino": "OpenVINOExecutionProvider"}
RKNN_PLATFORMS = ("rk3588", "rk3576", "rk3566")
PRECISIONS = ("int8", "fp16")
ORDERS = ("rgb", "bgr")


class BuildError(Exception):
    """A build that cannot start or go on for a reason the user caused (a file, a flag)."""


@dataclass(frozen=True)
class Gate:
    """What a build must reach against the original on held-out inputs to be installed."""

    top1: float = 0.99  # share of held-out inputs whose top-1 class is unchanged
    cosine: float = 0.999  # mean cosine similarity of the first output
    speed: float = 1.05  # original latency / built latency, where the target runs here


@dataclass(frozen=True)
class Preprocess:
    """How an image becomes an input (``.npy`` inputs are taken as they are): resized to the
    model's height and width, channels in ``order``, then ``(pixel - mean) / std`` in
    0..255 units, per channel of the model's order."""

    mean: tuple[float, float, float] = (0.0, 0.0, 0.0)
    std: tuple[float, float, float] = (1.0, 1.0, 1.0)
    order: str = "rgb"


@dataclass(frozen=True)
class BuildRequest:
    source: Path
    name: str
    target: str = "cpu"  # one of TARGETS, or rknn:<platform>
    precision: str = "int8"
    calibration: Path | None = None
    gate: Gate = field(default_factory=Gate)
    preprocess: Preprocess = field(default_factory=Preprocess)
    rknn_python: str | None = None  # the isolated converter's interpreter (rknn targets)

    @property
    def rknn_platform(self) -> str | None:
        """``rk3588`` for ``rknn:rk3588``; None for the ONNX targets."""
        return self.target.split(":", 1)[1] if self.target.startswith("rknn:") else None


def check_target(target: str, precision: str) -> None:
    allowed = (*TARGETS, *(f"rknn:{p}" for p in RKNN_PLATFORMS))
    if target not in allowed:
        raise BuildError(f"--target {target!r}: allowed {', '.join(allowed)}")
    if precision not in PRECISIONS:
        raise BuildError(f"--precision {precision!r}: allowed {', '.join(PRECISIONS)}")


def _number(flag: str, key: str, text: str, low: float, high: float) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and low <= value <= high):
        raise BuildError(f"{flag} {key}={text}: expected a number from {low:g} to {high:g}")
    return value


def _pairs(flag: str, text: str, keys: tuple[str, ...]) -> dict[str, str]:
    pairs: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in keys:
            raise BuildError(f"{flag} {item!r}: expected KEY=VALUE with KEY one of "
                             f"{', '.join(keys)}")
        pairs[key] = value
    return pairs


def parse_gate(text: str | None) -> Gate:
    """``top1=0.99,cosine=0.999,speed=1.05``; keys left out keep their defaults.  The
    ratios are 0..1; the speed ratio 0 (not judged) up to 100."""
    if not text:
        return Gate()
    keys = tuple(f.name for f in fields(Gate))
    values = {key: _number("--gate", key, value, 0.0, 100.0 if key == "speed" else 1.0)
              for key, value in _pairs("--gate", text, keys).items()}
    return Gate(**values)


def _triple(flag: str, key: str, text: str, positive: bool) -> tuple[float, float, float]:
    parts = text.split(":") if ":" in text else [text] * 3
    if len(parts) != 3:
        raise BuildError(f"{flag} {key}={text}: expected one number or three as A:B:C")
    values = tuple(_number(flag, key, part, 1e-6 if positive else -255.0, 255.0)
                   for part in parts)
    return values[0], values[1], values[2]


def parse_preprocess(text: str | None) -> Preprocess:
    """``mean=123.7:116.3:103.5,std=58.4:57.1:57.4,order=rgb`` (pixel units, 0..255)."""
    if not text:
        return Preprocess()
    pairs = _pairs("--preprocess", text, ("mean", "std", "order"))
    order = pairs.get("order", "rgb")
    if order not in ORDERS:
        raise BuildError(f"--preprocess order={order}: allowed {', '.join(ORDERS)}")
    default = Preprocess()
    return Preprocess(
        mean=_triple("--preprocess", "mean", pairs["mean"], False) if "mean" in pairs
        else default.mean,
        std=_triple("--preprocess", "std", pairs["std"], True) if "std" in pairs
        else default.std,
        order=order)
