"""Frigate's ``zmq`` detector protocol, in one place for the front end and the client that does
what Frigate's ``ZmqIpcDetector`` does (tests, bench).

REQ/REP.  A detection request is two frames: a JSON header ``{"shape": [...], "dtype":
"uint8" | "float32", "model_type": NAME}`` (numpy's dtype name, Frigate's ``ModelTypeEnum``
member name) and the tensor's raw C-order bytes.  The answer is one frame of ``20 x 6``
float32 (Frigate also reads a header + tensor pair; one frame is the form with nothing to
parse).  On start, and after every reset, Frigate first asks whether its model is there: one
frame ``{"model_request": true, "model_name": BASENAME}`` answered by one frame
``{"model_available": bool, "model_loaded": bool}``; only "available" leads it to send the
model file (``{"model_data": true, ...}`` + bytes), which this server never takes: its models
come from its repository.  Frigate waits 200 ms for a detection (30 s for a model question),
then closes its socket and asks again.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from agent.serving.detections import ROWS, zero_result

DEFAULT_ENDPOINT = "ipc:///tmp/cache/zmq_detector"  # Frigate's default
REQUEST_TIMEOUT_MS = 200  # Frigate's default request_timeout_ms
MODEL_TIMEOUT_MS = 30_000  # how long it waits for a model question's answer
MAX_HEADER_BYTES = 4096  # its header is ~80 bytes
MAX_DIM = 16384
DTYPES: dict[str, np.dtype[Any]] = {"uint8": np.dtype(np.uint8),
                                    "float32": np.dtype(np.float32)}
RESULT_BYTES = ROWS * 6 * 4
DEADLINE_SHARE = 0.75  # of Frigate's timeout, for the detection itself

Frame = bytes | memoryview


@dataclass(frozen=True)
class FrigateSettings:
    """``serve.frigate``: where Frigate connects and what answers it."""

    endpoint: str
    model: str
    model_type: str | None = None  # None: as each request's header says
    input_dtype: str = "float"  # a float model's scale for a uint8 frame (frigate_input)
    request_timeout_ms: int = 200  # Frigate's, which every answer must beat

    @property
    def deadline_s(self) -> float:
        """How long a detection may take: Frigate's timeout less its transfer and decoding."""
        return self.request_timeout_ms * DEADLINE_SHARE / 1000


class ProtocolError(Exception):
    """A message that is not Frigate's: the message says what was wrong."""


@dataclass(frozen=True)
class Detect:
    tensor: np.ndarray  # a read-only view of the request's bytes
    model_type: str | None


@dataclass(frozen=True)
class ModelQuery:
    name: str


@dataclass(frozen=True)
class ModelUpload:
    name: str


Message = Detect | ModelQuery | ModelUpload


def _header(frame: Frame) -> dict[str, Any]:
    if len(frame) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(frame)} bytes (at most {MAX_HEADER_BYTES})")
    try:
        header = json.loads(bytes(frame))
    except (UnicodeDecodeError, ValueError) as error:
        raise ProtocolError(f"header is not JSON: {error}") from None
    if not isinstance(header, dict):
        raise ProtocolError("header is not a JSON object")
    return header


def _name(header: dict[str, Any], key: str) -> str:
    value = header.get(key, "")
    return value[:256] if isinstance(value, str) else ""


def parse(frames: Sequence[Frame], max_bytes: int) -> Message:
    """The request these frames make; ProtocolError before any tensor byte is looked at
    when the header is not a valid one or the tensor is not the size it declares."""
    if not 1 <= len(frames) <= 2:
        raise ProtocolError(f"{len(frames)} frames (a header and a tensor)")
    header = _header(frames[0])
    if header.get("model_request") is True:
        return ModelQuery(_name(header, "model_name"))
    if header.get("model_data") is True:
        return ModelUpload(_name(header, "model_name"))
    if len(frames) != 2:
        raise ProtocolError("a detection request is a header and a tensor frame")
    shape, dtype_name = header.get("shape"), header.get("dtype")
    if not isinstance(shape, list) or len(shape) != 4 or not all(
            isinstance(d, int) and not isinstance(d, bool) and 1 <= d <= MAX_DIM
            for d in shape):
        raise ProtocolError(f"shape must be 4 integers 1..{MAX_DIM}, not {str(shape)[:80]}")
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
        raise ProtocolError(f"dtype must be one of {', '.join(DTYPES)}, not "
                            f"{str(dtype_name)[:40]}")
    dtype = DTYPES[dtype_name]
    size = math.prod(shape) * dtype.itemsize
    if size > max_bytes:
        raise ProtocolError(f"a tensor of {size} bytes (at most {max_bytes})")
    if len(frames[1]) != size:
        raise ProtocolError(f"tensor of {len(frames[1])} bytes where shape {shape} "
                            f"{dtype_name} is {size}")
    model_type = header.get("model_type")
    return Detect(np.frombuffer(frames[1], dtype).reshape(shape),
                  model_type[:64] if isinstance(model_type, str) else None)


def detect_header(tensor: np.ndarray, model_type: str) -> bytes:
    """A detection request's header, as Frigate builds it."""
    return json.dumps({"shape": list(tensor.shape), "dtype": str(tensor.dtype.name),
                       "model_type": model_type}).encode()


def result_frames(result: np.ndarray) -> list[bytes]:
    """The answer: one frame of ``[20, 6]`` float32."""
    return [np.ascontiguousarray(result, np.float32).tobytes()]


def model_status(available: bool, loaded: bool) -> list[bytes]:
    return [json.dumps({"model_available": available, "model_loaded": loaded}).encode()]


def upload_refused() -> list[bytes]:
    return [json.dumps({"model_saved": False, "model_loaded": False}).encode()]


def decode_result(frames: Sequence[Frame]) -> np.ndarray:
    """What Frigate makes of an answer: one frame of 480 bytes, or a header naming shape and
    dtype with the tensor; anything else is its zero result."""
    try:
        if len(frames) == 1:
            if len(frames[0]) != RESULT_BYTES:
                return zero_result()
            return np.frombuffer(frames[0], np.float32).reshape(ROWS, 6)
        if len(frames) >= 2:
            header = json.loads(bytes(frames[0]))
            dtype = np.dtype(header.get("dtype", "float32"))
            return np.frombuffer(frames[1], dtype).reshape(tuple(header.get("shape", [])))
    except (ValueError, TypeError, AttributeError):
        pass
    return zero_result()
