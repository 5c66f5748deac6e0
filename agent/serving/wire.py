"""A ``ModelInferRequest`` read with its ``raw_input_contents`` left where they arrived.

Parsing the message copies every tensor into protobuf's own memory, and reading the field
copies it again into a new ``bytes``: two copies of each tensor per request (two 600 KB
copies of an image), which in a server show up as the data plane's own overhead.  Here the
top-level fields are walked on the wire (protobuf's encoding: a varint key, then a varint,
a fixed 4/8 bytes or a length and that many bytes), the raw tensors are kept as views of
the received buffer and every other field is parsed by protobuf as usual.  Anything the
walk does not expect (a truncated field, a group, an overlong varint) hands the whole
buffer to protobuf instead, so a message is accepted or refused exactly as protobuf would;
nothing here trusts a length it has not checked against the buffer.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from agent.serving import proto

RAW_INPUT_CONTENTS = 7  # ModelInferRequest's field number (Triton's grpc_service.proto)
_LENGTH_DELIMITED = 2
_FIXED_SIZE = {1: 8, 5: 4}  # wire types 1 (64-bit) and 5 (32-bit)
_VARINT = 0


class WireError(ValueError):
    """Something the walk does not handle: protobuf parses the message instead."""


class SplitRequest(NamedTuple):
    """The message without its raw tensors, and those tensors in their order."""

    message: Any
    raw: list[bytes] | list[memoryview]


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    """The varint at ``pos`` and the position after it; at most 10 bytes, as protobuf."""
    value = shift = 0
    for index in range(pos, min(pos + 10, len(data))):
        byte = data[index]
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, index + 1
        shift += 7
    raise WireError("a truncated or overlong varint")


def split_infer_request(data: bytes) -> SplitRequest:
    """gRPC's request deserializer for ModelInfer; raises protobuf's DecodeError for what
    is no valid message (gRPC answers such a call with an error)."""
    try:
        rest, raw = _walk(data)
    except WireError:
        message = proto.ModelInferRequest.FromString(data)
        return SplitRequest(message, list(message.raw_input_contents))
    message = proto.ModelInferRequest.FromString(rest)
    return SplitRequest(message, raw)


def _walk(data: bytes) -> tuple[bytes, list[memoryview]]:
    """Every top-level field but the raw tensors, and views of those.  A key or length
    below 128 is one byte, read in place (the usual case: the call costs microseconds a
    request); a longer one goes through ``_varint``."""
    view = memoryview(data)
    rest = bytearray()
    raw: list[memoryview] = []
    kept = 0  # data[kept:start] is the run of fields since the last raw tensor, kept as is
    pos, end = 0, len(data)
    while pos < end:
        start = pos
        key = data[pos]
        if key < 0x80:
            pos += 1
        else:
            key, pos = _varint(data, pos)
        wire = key & 7
        if wire == _VARINT:
            _, pos = _varint(data, pos)
        elif wire == _LENGTH_DELIMITED:
            if pos < end and data[pos] < 0x80:
                length = data[pos]
                pos += 1
            else:
                length, pos = _varint(data, pos)
            if length > end - pos:
                raise WireError("a field runs past the end of the message")
            if key >> 3 == RAW_INPUT_CONTENTS:
                rest += view[kept:start]
                raw.append(view[pos:pos + length])
                pos += length
                kept = pos
                continue
            pos += length
        elif wire in _FIXED_SIZE:
            pos += _FIXED_SIZE[wire]
            if pos > end:
                raise WireError("a fixed-size field runs past the end of the message")
        else:  # a group (3, 4) or no wire type at all (6, 7)
            raise WireError(f"wire type {wire}")
    rest += view[kept:end]
    return bytes(rest), raw
