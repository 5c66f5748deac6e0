"""Protobuf's wire format by hand, for messages no client library would send (floods of
fields, unknown fields, odd encodings): shared by the wire, gRPC and hostile tests."""

from __future__ import annotations


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload
