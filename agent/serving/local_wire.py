"""The local front end's messages: what a session's client may send, checked before the work
it drives, and the replies.

Every message is one SOCK_SEQPACKET record holding a JSON object of at most MAX_MESSAGE bytes
(the tensors are never in it: they lie in the session's shared region, named by offset).
JSON because the messages are a few hundred bytes: parsing an infer message and encoding
one costs about 12 us together (measured on a 2-core x86_64 VM), well under a run, and a
client needs nothing but the standard library to speak it.  The client's side of this
protocol lives in ``clients/python/edge_agent_client/_wire.py`` (a separate distribution
that cannot import the agent); tests/test_serve_local.py checks that both agree on every
constant.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from agent.serving.core import DATATYPES, ModelMetadata, Tensor
from agent.serving.errors import ServeError, invalid

PROTOCOL = 1
MAX_MESSAGE = 64 << 10  # bytes of one message, either way
MAX_TENSORS = 64  # inputs, and outputs asked for, of one request
MAX_DIMS = 16
MAX_NAME = 256  # characters of a model, version or tensor name
MAX_FDS = 4  # descriptors read off one message: more than one is refused, all closed
ALIGNMENT = 64  # where the server places each output in the client's output area
MAX_TIMEOUT_US = 1 << 40  # as policy.MAX_TIMEOUT_US


def aligned(offset: int) -> int:
    return -(-offset // ALIGNMENT) * ALIGNMENT


@dataclass(frozen=True)
class Placed:
    """A tensor in the region: its protocol datatype, shape and byte offset."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * DATATYPES[self.datatype].itemsize

    def to_list(self) -> list[Any]:
        return [self.name, self.datatype, list(self.shape), self.offset]


@dataclass(frozen=True)
class InferCall:
    model: str
    version: str
    inputs: tuple[Placed, ...]
    outputs: tuple[str, ...]  # empty: every output
    area: tuple[int, int]  # where outputs go: offset, capacity in bytes
    priority: int
    timeout_us: int


def decode(data: bytes) -> dict[str, Any]:
    """A message as a JSON object with a string ``op``; INVALID_ARGUMENT otherwise."""
    try:
        message = json.loads(data)
    except (ValueError, UnicodeDecodeError) as error:
        raise invalid(f"the message is not JSON: {error}") from None
    if not isinstance(message, dict) or not isinstance(message.get("op"), str):
        raise invalid('a message is a JSON object with "op" (hello, infer, metadata)')
    return message


def _name(value: Any, what: str, empty: bool = False) -> str:
    if not isinstance(value, str) or len(value) > MAX_NAME or (not value and not empty):
        raise invalid(f"{what}: a string of at most {MAX_NAME} characters")
    return value


def _count(value: Any, what: str, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= high:
        raise invalid(f"{what}: an integer 0..{high}")
    return value


def _placed(item: Any, index: int) -> Placed:
    what = f"inputs[{index}]"
    if not isinstance(item, list) or len(item) != 4:
        raise invalid(f"{what}: [name, datatype, shape, offset]")
    name, datatype, shape, offset = item
    if datatype not in DATATYPES:
        raise invalid(f"{what}: datatype {datatype!r} is not one of {', '.join(DATATYPES)}")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS:
        raise invalid(f"{what}: shape is a list of at most {MAX_DIMS} dimensions")
    dims = tuple(_count(d, f"{what}: shape", 1 << 31) for d in shape)
    return Placed(_name(name, f"{what}: name"), datatype, dims,
                  _count(offset, f"{what}: offset", 1 << 62))


def infer_call(message: Mapping[str, Any]) -> InferCall:
    """An ``infer`` message checked for shape and bounds (not yet against the region)."""
    inputs, outputs, area = (message.get("inputs"), message.get("outputs", []),
                             message.get("area"))
    if not isinstance(inputs, list) or not 0 < len(inputs) <= MAX_TENSORS:
        raise invalid(f"inputs: a list of 1..{MAX_TENSORS} [name, datatype, shape, offset]")
    if not isinstance(outputs, list) or len(outputs) > MAX_TENSORS:
        raise invalid(f"outputs: a list of at most {MAX_TENSORS} output names")
    if not isinstance(area, list) or len(area) != 2:
        raise invalid("area: [offset, capacity] of the region where outputs go")
    return InferCall(
        model=_name(message.get("model"), "model"),
        version=_name(message.get("version", ""), "version", empty=True),
        inputs=tuple(_placed(item, index) for index, item in enumerate(inputs)),
        outputs=tuple(_name(name, "outputs[]") for name in outputs),
        area=(_count(area[0], "area offset", 1 << 62), _count(area[1], "area capacity",
                                                               1 << 62)),
        priority=_count(message.get("priority", 0), "priority", 1000),
        timeout_us=_count(message.get("timeout_us", 0), "timeout_us", MAX_TIMEOUT_US))


def check_placement(offset: int, nbytes: int, itemsize: int, size: int, what: str) -> None:
    """INVALID_ARGUMENT unless ``nbytes`` from ``offset`` lie within a region of ``size``
    bytes at an offset numpy can read an element of ``itemsize`` at."""
    if offset + nbytes > size:
        raise invalid(f"{what}: {nbytes} bytes at offset {offset} end beyond the region "
                      f"({size} bytes)")
    if offset % itemsize:
        raise invalid(f"{what}: offset {offset} is not a multiple of its element size "
                      f"{itemsize}")


def view(buffer: Any, size: int, placed: Placed, what: str) -> np.ndarray:
    """The tensor in place: a numpy array over the region's memory, no copy."""
    dtype = DATATYPES[placed.datatype]
    check_placement(placed.offset, placed.nbytes, dtype.itemsize, size, what)
    array: np.ndarray = np.ndarray(placed.shape, dtype, buffer=buffer, offset=placed.offset)
    return array


def place_outputs(outputs: tuple[Tensor, ...], area: tuple[int, int]
                  ) -> tuple[list[Placed], int]:
    """Where each output goes in the area, each ALIGNMENT-aligned, and the bytes needed."""
    placed, offset = [], area[0]
    for tensor in outputs:
        offset = aligned(offset)
        placed.append(Placed(tensor.name, tensor.datatype, tuple(tensor.array.shape), offset))
        offset += tensor.array.nbytes
    return placed, offset - area[0]


def encode(reply: Mapping[str, Any]) -> bytes:
    return json.dumps(reply, separators=(",", ":")).encode()


class OutputsTooLarge(ServeError):
    """RESOURCE_EXHAUSTED naming the bytes the outputs need, so that a client grows its
    region to fit and asks again."""

    def __init__(self, needed: int, capacity: int) -> None:
        super().__init__("RESOURCE_EXHAUSTED", f"the outputs need {needed} bytes; the "
                         f"output area holds {capacity}")
        self.needed = needed


def error_reply(error: ServeError) -> bytes:
    """``{"error": {"code", "message"[, "needed"]}}``, the message cut to fit."""
    extra = {"needed": error.needed} if isinstance(error, OutputsTooLarge) else {}
    return encode({"error": {"code": error.code, "message": error.message[:4096], **extra}})


def metadata_reply(meta: ModelMetadata) -> bytes:
    return encode({"name": meta.name, "versions": list(meta.versions),
                   "platform": meta.platform,
                   "inputs": [spec.to_dict() for spec in meta.inputs],
                   "outputs": [spec.to_dict() for spec in meta.outputs]})
