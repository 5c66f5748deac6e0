"""Frigate's tensor made into what the model takes.

Frigate sends its frame at its configured size in the layout and element type its own model
config names (``input_tensor``: NHWC or NCHW; ``input_dtype``: uint8, or float32 it already
scaled).  The model's one input says what it takes (``ModelMetadata``): layout from where its
3 channels are, element type from its datatype.  A uint8 frame for a float model is scaled by
``serve.frigate.input_dtype`` (Frigate's names: ``float`` 0..1, as YOLOv8 exports take, or
``float_denorm`` 0..255).  A float frame for an integer model, or a frame of another size
than a model of fixed size takes, is refused with what to change in Frigate's config: a
resize would hide a misconfiguration that costs accuracy and time on every frame.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from agent.serving.core import DATATYPES, ModelMetadata

INPUT_DTYPES = ("float", "float_denorm")
_INTEGER = {"UINT8", "INT8"}
_FLOAT = {"FP32", "FP16"}


class InputError(Exception):
    """The frame or the model is not one this conversion serves: the message says why."""


def layout_of(shape: tuple[int, ...]) -> str | None:
    """``nchw`` or ``nhwc`` by where the 3 channels are (None: neither)."""
    if len(shape) != 4:
        return None
    if shape[1] == 3:
        return "nchw"
    if shape[3] == 3:
        return "nhwc"
    return None


@dataclass(frozen=True)
class InputPlan:
    """How one model's input is made from a frame."""

    model: str
    name: str
    layout: str
    datatype: str
    size: tuple[int, int]  # height, width; -1 where the model takes any
    divisor: float  # a uint8 frame's, for a float model (Frigate divides by 255)

    def convert(self, frame: np.ndarray) -> np.ndarray:
        """The model's input from Frigate's ``frame`` (InputError: one it cannot take)."""
        given = layout_of(frame.shape)
        if given is None or frame.shape[0] != 1:
            raise InputError(f"Frigate's tensor {list(frame.shape)} is neither [1, 3, H, W] "
                             "nor [1, H, W, 3] (Frigate's model.input_tensor: nchw or nhwc)")
        height, width = self.height_width(frame)
        if any(want not in (-1, got) for want, got in zip(self.size, (height, width), strict=True)):
            raise InputError(f"Frigate sends {width}x{height} where model {self.model} "
                             f"takes {self.size[1]}x{self.size[0]}: set Frigate's "
                             f"model.width and model.height to the model's")
        if given != self.layout:
            frame = frame.transpose((0, 3, 1, 2) if self.layout == "nchw" else (0, 2, 3, 1))
        dtype = DATATYPES[self.datatype]
        if frame.dtype == np.uint8:
            if self.datatype in _INTEGER:
                return np.ascontiguousarray(frame).astype(dtype, copy=False)
            converted = frame.astype(np.float32)
            if self.divisor != 1.0:
                converted /= np.float32(self.divisor)
            return converted.astype(dtype, copy=False)
        if self.datatype in _INTEGER:
            raise InputError(f"Frigate sends {frame.dtype} where model {self.model} takes "
                             f"{self.datatype}: set Frigate's model.input_dtype: int")
        return np.ascontiguousarray(frame, dtype)

    def height_width(self, frame: np.ndarray) -> tuple[int, int]:
        """The frame's height and width (which the boxes are normalised by)."""
        shape: Any = frame.shape
        return (shape[2], shape[3]) if layout_of(shape) == "nchw" else (shape[1], shape[2])


def plan_input(meta: ModelMetadata, input_dtype: str) -> InputPlan:
    """The plan for ``meta``'s model; InputError for a model Frigate's frames cannot feed."""
    if len(meta.inputs) != 1:
        raise InputError(f"model {meta.name} takes {len(meta.inputs)} inputs; a Frigate "
                         "detector feeds one image")
    spec = meta.inputs[0]
    layout = layout_of(spec.shape)
    if layout is None:
        raise InputError(f"model {meta.name} input {spec.name} {list(spec.shape)} is neither "
                         "[N, 3, H, W] nor [N, H, W, 3]")
    if spec.datatype not in _INTEGER | _FLOAT:
        raise InputError(f"model {meta.name} input {spec.name} is {spec.datatype}; an image "
                         f"input is one of {', '.join(sorted(_INTEGER | _FLOAT))}")
    size = (spec.shape[2], spec.shape[3]) if layout == "nchw" else (spec.shape[1], spec.shape[2])
    return InputPlan(meta.name, spec.name, layout, spec.datatype, size,
                     255.0 if input_dtype == "float" else 1.0)
