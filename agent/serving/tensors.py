"""Tensors as the Open Inference Protocol carries them, and the checks a request passes
before any byte of it reaches the runtime.

Both front ends decode with these functions (HTTP's JSON ``data`` and binary extension,
gRPC's ``raw_input_contents`` and typed contents), so a request is refused with the same
words whichever way it came.  Every size is checked before an array is built: a shape
claiming more elements than the body holds is refused, never allocated.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from agent.serving.core import DATATYPES, Tensor, TensorSpec
from agent.serving.errors import invalid

# ONNX Runtime's type strings for the same.
ORT_DATATYPES = {
    "tensor(bool)": "BOOL", "tensor(uint8)": "UINT8", "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32", "tensor(uint64)": "UINT64", "tensor(int8)": "INT8",
    "tensor(int16)": "INT16", "tensor(int32)": "INT32", "tensor(int64)": "INT64",
    "tensor(float16)": "FP16", "tensor(float)": "FP32", "tensor(double)": "FP64",
    "tensor(string)": "BYTES",
}
MAX_RANK = 16
_ORT_PREFIX = re.compile(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ")
MAX_ELEMENTS = 1 << 31  # far beyond any body serve.max_request_mb lets in


def ort_message(error: Exception) -> str:
    """onnxruntime's error as one line, without its status prefix."""
    lines = str(error).strip().splitlines()
    first = lines[0].strip() if lines else type(error).__name__
    return _ORT_PREFIX.sub("", first)


def element_count(name: str, shape: Sequence[Any]) -> int:
    """The elements a shape holds; each dimension an integer 0 or above, rank bounded.
    The product of the dimensions other than 0 is bounded too: ``[2**62, 0]`` holds no
    element, but numpy cannot make an array of that shape (nor ``[2**64, 0]``'s), and a
    bound checked here is a 400 naming the input where numpy's refusal was a 500."""
    if not isinstance(shape, Sequence) or isinstance(shape, str | bytes):
        raise invalid(f"input {name}: shape must be a list of integers")
    if len(shape) > MAX_RANK:
        raise invalid(f"input {name}: shape has {len(shape)} dimensions, at most {MAX_RANK}")
    spanned = 1
    for dim in shape:
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0:
            raise invalid(f"input {name}: shape {_shown(shape)} must hold integers 0 or above")
        spanned *= max(dim, 1)
        if spanned > MAX_ELEMENTS:  # checked as it grows: never a product of huge numbers
            raise invalid(f"input {name}: shape {_shown(shape)} spans more than "
                          f"{MAX_ELEMENTS} elements")
    return int(math.prod(shape))


def _shown(shape: Sequence[Any]) -> str:
    """A shape for a message: a dimension of 5,000 digits is not echoed whole."""
    text = str(list(shape))
    return text if len(text) <= 200 else text[:200] + "...]"


def protocol_dtype(name: str, datatype: Any) -> np.dtype[Any]:
    """The numpy type of a protocol datatype; INVALID_ARGUMENT naming the input if none."""
    dtype = DATATYPES.get(datatype) if isinstance(datatype, str) else None
    if dtype is None:
        raise invalid(f"input {name}: datatype {datatype!r} is not supported (one of "
                      f"{', '.join(DATATYPES)})")
    return dtype


def raw_size(name: str, datatype: Any, shape: Sequence[Any]) -> int:
    """The bytes a tensor of this datatype and shape takes raw (checked as ``from_raw``
    checks them), known before any byte is read."""
    return element_count(name, shape) * protocol_dtype(name, datatype).itemsize


def from_raw(name: str, datatype: Any, shape: Sequence[Any], raw: bytes | memoryview) -> Tensor:
    """A tensor from its raw little-endian bytes (binary extension, ``raw_input_contents``),
    refused unless the byte count is exactly what the shape and datatype need."""
    dtype = protocol_dtype(name, datatype)
    count = element_count(name, shape)
    expected = count * dtype.itemsize
    if len(raw) != expected:
        raise invalid(f"input {name}: {len(raw)} bytes, but shape {list(shape)} of {datatype} "
                      f"needs {expected}")
    array = np.frombuffer(raw, dtype=dtype, count=count).reshape(tuple(shape))
    return Tensor(name, array)


def from_values(name: str, datatype: Any, shape: Sequence[Any], data: Any) -> Tensor:
    """A tensor from JSON ``data`` or gRPC typed contents: flat or nested row-major lists,
    refused unless they hold exactly the shape's elements of the right kind."""
    dtype = protocol_dtype(name, datatype)
    count = element_count(name, shape)
    flat = list(_flatten(name, data, count))
    if len(flat) != count:
        raise invalid(f"input {name}: {len(flat)} values, but shape {list(shape)} needs "
                      f"{count}")
    kind = dtype.kind
    for value in flat:
        if kind == "b":
            ok = isinstance(value, bool)
        elif kind in "iu":
            ok = isinstance(value, int) and not isinstance(value, bool)
        else:
            ok = isinstance(value, int | float) and not isinstance(value, bool)
        if not ok:
            raise invalid(f"input {name}: {value!r} is not a {datatype} value")
    try:
        with np.errstate(over="raise"):  # 1e10 as FP16 would be inf, not the value sent
            array = np.array(flat, dtype=dtype).reshape(tuple(shape))
    except (OverflowError, ValueError, FloatingPointError) as error:
        raise invalid(f"input {name}: a value does not fit {datatype} ({error})") from None
    if kind in "iu":  # numpy wraps out-of-range integers in some versions: check both ways
        info = np.iinfo(dtype)
        if flat and (min(flat) < info.min or max(flat) > info.max):
            raise invalid(f"input {name}: a value does not fit {datatype}")
    return Tensor(name, array)


def from_typed(name: str, datatype: Any, shape: Sequence[Any], values: Sequence[Any],
               field_dtype: np.dtype[Any]) -> Tensor:
    """A tensor from gRPC typed contents: ``values`` is protobuf's repeated field, whose
    elements are already ``field_dtype`` (int32 for INT8 to INT32, ...).  They go into an
    array of that type one at a time, with no list of Python objects between (36 bytes an
    element where the array takes 4), then are checked to fit ``datatype``.  The caller
    has admitted ``typed_bytes`` of memory for it."""
    dtype = protocol_dtype(name, datatype)
    count = element_count(name, shape)
    if len(values) != count:
        raise invalid(f"input {name}: {len(values)} values, but shape {list(shape)} needs "
                      f"{count}")
    array = np.fromiter(values, dtype=field_dtype, count=count)
    if field_dtype != dtype:
        if dtype.kind in "iu" and count:
            info = np.iinfo(dtype)
            if array.min() < info.min or array.max() > info.max:
                raise invalid(f"input {name}: a value does not fit {datatype}")
        array = array.astype(dtype)
    return Tensor(name, array.reshape(tuple(shape)))


def typed_bytes(datatype: Any, count: int, field_dtype: np.dtype[Any]) -> int:
    """The memory ``from_typed`` takes for ``count`` values: the array of the field's type
    and, when ``datatype`` differs, the one converted to it."""
    dtype = DATATYPES.get(datatype) if isinstance(datatype, str) else None
    converted = dtype.itemsize if dtype is not None and dtype != field_dtype else 0
    return count * (field_dtype.itemsize + converted)


def _flatten(name: str, data: Any, limit: int) -> Iterable[Any]:
    """Values of a nested list, depth-first, stopping once more than ``limit`` are seen."""
    if not isinstance(data, list):
        raise invalid(f"input {name}: data must be a list")
    stack: list[Any] = [iter(data)]
    seen = 0
    while stack:
        item = next(stack[-1], _END)
        if item is _END:
            stack.pop()
        elif isinstance(item, list):
            if len(stack) > MAX_RANK:
                raise invalid(f"input {name}: data nested deeper than {MAX_RANK}")
            stack.append(iter(item))
        else:
            seen += 1
            if seen > limit:
                raise invalid(f"input {name}: more values than its shape holds")
            yield item


_END = object()


def to_raw(array: np.ndarray) -> bytes:
    """An output's bytes, little-endian and row-major, as the binary extension carries it."""
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()


def to_values(array: np.ndarray) -> list[Any]:
    """An output as a flat JSON list (FP16 as floats, BOOL as true/false)."""
    return np.ascontiguousarray(array).reshape(-1).tolist()  # type: ignore[no-any-return]


def check_inputs(model: str, specs: Sequence[TensorSpec], inputs: Sequence[Tensor]) -> None:
    """Every input the model takes, each once, with its datatype and a shape its dimensions
    accept (-1: any size); what does not match is refused naming the input."""
    wanted = {spec.name: spec for spec in specs}
    seen: set[str] = set()
    for tensor in inputs:
        spec = wanted.get(tensor.name)
        if spec is None:
            raise invalid(f"model {model} has no input {tensor.name!r} (its inputs: "
                          f"{', '.join(wanted)})")
        if tensor.name in seen:
            raise invalid(f"input {tensor.name} is given twice")
        seen.add(tensor.name)
        if tensor.datatype != spec.datatype:
            raise invalid(f"input {tensor.name}: datatype {tensor.datatype}, model {model} "
                          f"wants {spec.datatype}")
        shape = tuple(tensor.array.shape)
        if len(shape) != len(spec.shape) or any(
                want not in (-1, got) for want, got in zip(spec.shape, shape, strict=True)):
            raise invalid(f"input {tensor.name}: shape {list(shape)}, model {model} wants "
                          f"{list(spec.shape)} (-1: any size)")
    missing = [name for name in wanted if name not in seen]
    if missing:
        raise invalid(f"model {model}: input {', '.join(missing)} missing")
