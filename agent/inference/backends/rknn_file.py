"""What a ``.rknn`` file and ``librknnrt`` say about their versions, read without the NPU.

A ``.rknn`` (rknn-toolkit2's export) is ``RKNN``, 4 bytes of padding, the file format (u64,
little-endian; 6 for toolkit 1.5 and later), the model's length (u64), padding to a 24- or
64-byte header (format 1 and toolkit 2.5's format 6 have 64), the model, then a JSON
document's length (u64) and the document, which ends the file and names the toolkit that
wrote it (``version``: ``2.3.0+81f21f4d``) and the target platform.
``librknnrt.so`` carries ``librknnrt version: 2.3.0 (c949ad889d@2024-11-07T11:35:33)``, the
line it logs at init_runtime.  A model whose toolkit is newer than the runtime fails there
with "Invalid RKNN model version": refused before, with both versions named.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from typing import Any

MAGIC = b"RKNN"
HEADER_SIZES = (24, 64)
_VERSION = re.compile(r"(\d+)\.(\d+)\.(\d+)")


class RknnFileError(ValueError):
    """Bytes that are no .rknn export this parser understands."""


@dataclass(frozen=True)
class RknnInfo:
    format_version: int
    toolkit_version: str | None  # as written, e.g. "2.3.0+81f21f4d"
    target_platform: tuple[str, ...]
    metadata: dict[str, Any]


def parse_rknn(data: bytes) -> RknnInfo:
    """The header and JSON document of a .rknn file's bytes."""
    if data[:4] != MAGIC:
        raise RknnFileError(f"does not start with {MAGIC!r} (starts {data[:8]!r})")
    if len(data) < 24:
        raise RknnFileError("is shorter than an RKNN header")
    fmt, length = struct.unpack_from("<QQ", data, 8)
    tail = _document_offset(data, fmt, length)
    if tail + 8 > len(data):
        raise RknnFileError(f"claims a {length}-byte model but holds {len(data)} bytes")
    (size,) = struct.unpack_from("<Q", data, tail)
    try:
        document = json.loads(data[tail + 8:tail + 8 + size].decode("utf-8")) if size else {}
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise RknnFileError(f"has an unreadable metadata document ({error})") from None
    if not isinstance(document, dict):
        document = {}
    version = document.get("version") or document.get("toolkit_version")
    platform = document.get("target_platform") or []
    platforms = tuple(platform) if isinstance(platform, list) else (str(platform),)
    return RknnInfo(fmt, str(version) if version else None, platforms, document)


def _document_offset(data: bytes, fmt: int, length: int) -> int:
    """Where the document's length is: after whichever header size makes the document end
    exactly at the end of the file (the size differs between toolkit releases of one
    format), else after the size the format used to have."""
    for start in HEADER_SIZES:
        tail = start + length
        if tail + 8 <= len(data) and \
                tail + 8 + struct.unpack_from("<Q", data, tail)[0] == len(data):
            return tail
    return (64 if fmt <= 1 else 24) + length


def version_tuple(text: str) -> tuple[int, int, int] | None:
    found = _VERSION.search(text)
    return (int(found[1]), int(found[2]), int(found[3])) if found else None


def skew(toolkit: str | None, runtime: str | None) -> str | None:
    """Why a model written by ``toolkit`` cannot load on ``runtime`` (None: it can, or a
    version is unknown and init_runtime will tell)."""
    made, runs = version_tuple(toolkit or ""), version_tuple(runtime or "")
    if made is None or runs is None or made <= runs:
        return None
    return (f"it was converted by rknn-toolkit2 {toolkit}, newer than this board's "
            f"librknnrt {runtime}, which would refuse it (\"Invalid RKNN model version\"); "
            f"install librknnrt {'.'.join(map(str, made))} or newer, or convert the model "
            f"with rknn-toolkit2 {'.'.join(map(str, runs))}")
