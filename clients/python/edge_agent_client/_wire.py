"""The client's half of the local socket's protocol (the server's is the agent's
``agent/serving/local_wire.py``; the agent's tests check that both agree)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

PROTOCOL = 1
MAX_MESSAGE = 64 << 10
ALIGNMENT = 64
DATATYPES: dict[str, str] = {
    "BOOL": "|b1",
    "UINT8": "|u1", "UINT16": "<u2", "UINT32": "<u4", "UINT64": "<u8",
    "INT8": "|i1", "INT16": "<i2", "INT32": "<i4", "INT64": "<i8",
    "FP16": "<f2", "FP32": "<f4", "FP64": "<f8",
}
_NAMES = {np.dtype(spelled): name for name, spelled in DATATYPES.items()}


def datatype_of(dtype: np.dtype) -> str:
    """The protocol's name of a (little-endian or byte-order-free) dtype; KeyError if none."""
    return _NAMES[dtype]


def aligned(offset: int) -> int:
    return -(-offset // ALIGNMENT) * ALIGNMENT


def encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode()


def decode(data: bytes) -> dict[str, Any]:
    reply = json.loads(data)
    if not isinstance(reply, dict):
        raise ValueError("a reply is a JSON object")
    return reply
