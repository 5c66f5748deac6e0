"""A ``ModelInferRequest`` walked on the wire before protobuf parses it: bounded, and with
its ``raw_input_contents`` left where they arrived.

Two reasons to walk it ourselves.  Bounds: protobuf parses whatever it is given, so 6 MB
of empty ``inputs`` became three million messages (+1 GB) and 8 MB of unknown varints
seconds of CPU, on gRPC's one thread that reads every connection's messages.  The walk
counts every field before protobuf or numpy does any work for it and refuses a request
beyond the bounds below with INVALID_ARGUMENT naming the field; what it lets through is
a parse of bounded size (``WalkedRequest.cost``), which the front end admits against the
memory budget before parsing.  Copies: parsing copies every tensor into protobuf's own
memory and reading the field copies it again (two 600 KB copies of an image); the raw
tensors here stay views of the received buffer and only the rest goes to protobuf.

The walk reads protobuf's encoding (a varint key, then a varint, a fixed 4/8 bytes or a
length and that many bytes) and trusts no length it has not checked against the bytes of
the message that holds it.  It refuses what no client of this protocol sends and protobuf
would take (a group, a singular field given twice, unpacked typed contents beyond a few
fields): refusing is cheaper than bounding their cost.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

from google.protobuf.message import DecodeError  # type: ignore[import-untyped,unused-ignore]

from agent.serving import proto
from agent.serving.errors import ServeError, invalid
from agent.serving.tensors import MAX_RANK

MAX_TENSORS = 1024  # inputs, requested outputs, raw_input_contents entries (each)
MAX_PARAMETERS = 64  # parameters of the request, and of each tensor
MAX_UNKNOWN = 16  # fields this server does not know, in the whole request
MAX_CONTENTS_FIELDS = 16  # fields of one input's typed contents (packed: one a datatype)
MAX_FIELDS = 1 << 14  # fields of every kind together: what the walk itself may cost
MAX_NAME = 1024  # bytes of a model name, version, tensor name or datatype (as HTTP's)
# What protobuf holds for one parsed submessage beyond its bytes (an input, an output,
# a parameter): charged with the request so that counts within the bounds stay honest.
SUBMESSAGE_BYTES = 256

_VARINT, _FIXED64, _LENGTH_DELIMITED, _FIXED32 = 0, 1, 2, 5
_FIXED_SIZE = {_FIXED64: 8, _FIXED32: 4}
_CONTINUED = bytes(range(0x80, 0x100))  # a varint's bytes but its last: deleted, one a varint

# ModelInferRequest's field numbers (Triton's grpc_service.proto)
_MODEL_NAME, _MODEL_VERSION, _ID, _PARAMETERS, _INPUTS, _OUTPUTS, RAW_INPUT_CONTENTS = range(1, 8)
_REQUEST_FIELDS = {_MODEL_NAME: "model_name", _MODEL_VERSION: "model_version", _ID: "id"}
# InferInputTensor's
_NAME, _DATATYPE, _SHAPE, _TENSOR_PARAMETERS, _CONTENTS = range(1, 6)
_OUTPUT_PARAMETERS = 2  # InferRequestedOutputTensor: name = 1, parameters = 2
# InferTensorContents: the bytes protobuf holds per byte on the wire, at most, of each typed
# field (bool, int, int64, uint, uint64, fp32, fp64: a one-byte varint becomes an int64,
# 8); bytes_contents (8) is for BYTES, which this server does not carry.
_TYPED = {1: 1, 2: 4, 3: 8, 4: 4, 5: 8, 6: 1, 7: 1}
_BYTES_CONTENTS = 8


class SplitRequest(NamedTuple):
    """The message without its raw tensors, and those tensors in their order."""

    message: Any
    raw: list[memoryview]


def _not_a_message(why: str) -> ServeError:
    return invalid(f"the request is not a valid ModelInferRequest: {why}")


def _varint(data: bytes, pos: int, end: int) -> tuple[int, int]:
    """The varint at ``pos`` and the position after it; at most 10 bytes, as protobuf."""
    value = shift = 0
    for index in range(pos, min(pos + 10, end)):
        byte = data[index]
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, index + 1
        shift += 7
    raise _not_a_message("a truncated or overlong varint")


def _short(what: str, start: int, stop: int) -> None:
    """A name within MAX_NAME: one echoed in an error must fit gRPC's 16 KB of metadata
    (a 1 MB model name came back as a transport error, not as NOT_FOUND)."""
    if stop - start > MAX_NAME:
        raise invalid(f"{what} is longer than {MAX_NAME} bytes")


@dataclass
class _Counts:
    fields: int = 0
    unknown: int = 0
    submessages: int = 0
    contents_bytes: int = 0  # what protobuf may hold for typed contents, at most


class _Walker:
    """The fields of one message, with the request's running counts."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.counts = _Counts()

    def fields(self, pos: int, end: int) -> Iterator[tuple[int, int, int, int, int]]:
        """``(number, wire type, field start, value start, value end)`` of each field of
        ``data[pos:end]``; a key or length below 128 is one byte, read in place (the usual
        case: the walk of a request costs microseconds)."""
        data, counts = self.data, self.counts
        while pos < end:
            counts.fields += 1
            if counts.fields > MAX_FIELDS:
                raise invalid(f"the request has more than {MAX_FIELDS} protobuf fields")
            start = pos
            key = data[pos]
            if key < 0x80:
                pos += 1
            else:
                key, pos = _varint(data, pos, end)
            wire = key & 7
            if key >> 3 == 0:
                raise _not_a_message("field number 0")
            if wire == _VARINT:
                _, stop = _varint(data, pos, end)
            elif wire == _LENGTH_DELIMITED:
                if pos < end and data[pos] < 0x80:
                    length = data[pos]
                    pos += 1
                else:
                    length, pos = _varint(data, pos, end)
                stop = pos + length
            elif wire in _FIXED_SIZE:
                stop = pos + _FIXED_SIZE[wire]
            else:  # a group (3, 4), which no client of this protocol sends, or no type at all
                raise _not_a_message(f"wire type {wire} (a group or none)")
            if stop > end:
                raise _not_a_message("a field runs past the end of its message")
            yield key >> 3, wire, start, pos, stop
            pos = stop

    def unknown(self, where: str, number: int) -> None:
        self.counts.unknown += 1
        if self.counts.unknown > MAX_UNKNOWN:
            raise invalid(f"{where}: field {number} is unknown, and the request carries more "
                          f"than {MAX_UNKNOWN} unknown fields")

    def input(self, index: int, pos: int, end: int) -> None:
        """An ``InferInputTensor``: its parameters, rank and typed contents bounded."""
        where = f"inputs[{index}]"
        seen: set[int] = set()
        rank = parameters = 0
        for number, wire, _, start, stop in self.fields(pos, end):
            if number == _SHAPE and wire == _LENGTH_DELIMITED:  # packed, as clients send it
                if stop - start > MAX_RANK * 10:
                    raise invalid(f"{where}.shape has more than {MAX_RANK} dimensions")
                rank += len(self.data[start:stop].translate(None, _CONTINUED))
            elif number == _SHAPE and wire == _VARINT:
                rank += 1
            elif number == _TENSOR_PARAMETERS and wire == _LENGTH_DELIMITED:
                parameters += 1
                if parameters > MAX_PARAMETERS:
                    raise invalid(f"{where}.parameters has more than {MAX_PARAMETERS} entries")
                self.counts.submessages += 1
            elif number in (_NAME, _DATATYPE, _CONTENTS) and wire == _LENGTH_DELIMITED:
                if number in seen:
                    raise invalid(f"{where}: field {number} is given twice")
                seen.add(number)
                if number == _CONTENTS:
                    self.contents(where, start, stop)
                else:
                    _short(f"{where}.{'name' if number == _NAME else 'datatype'}", start, stop)
            else:
                self.unknown(where, number)
            if rank > MAX_RANK:
                raise invalid(f"{where}.shape has more than {MAX_RANK} dimensions")

    def contents(self, where: str, pos: int, end: int) -> None:
        """``InferTensorContents``: what protobuf will hold for it, at most."""
        for index, (number, _, field_start, _, stop) in enumerate(self.fields(pos, end)):
            if index == MAX_CONTENTS_FIELDS:
                raise invalid(f"{where}.contents has more than {MAX_CONTENTS_FIELDS} fields: "
                              "send typed contents packed (as protobuf does by default)")
            if number == _BYTES_CONTENTS:
                raise invalid(f"{where}.contents.bytes_contents: BYTES tensors are not "
                              "supported")
            typed = _TYPED.get(number)
            if typed is None:
                self.unknown(f"{where}.contents", number)
            else:
                self.counts.contents_bytes += (stop - field_start) * typed

    def output(self, index: int, pos: int, end: int) -> None:
        where = f"outputs[{index}]"
        seen: set[int] = set()
        parameters = 0
        for number, wire, _, start, stop in self.fields(pos, end):
            if number == _OUTPUT_PARAMETERS and wire == _LENGTH_DELIMITED:
                parameters += 1
                if parameters > MAX_PARAMETERS:
                    raise invalid(f"{where}.parameters has more than {MAX_PARAMETERS} entries")
                self.counts.submessages += 1
            elif number == _NAME and wire == _LENGTH_DELIMITED:
                if number in seen:
                    raise invalid(f"{where}: field name is given twice")
                seen.add(number)
                _short(f"{where}.name", start, stop)
            else:
                self.unknown(where, number)


class WalkedRequest:
    """A message walked and found within bounds, not yet parsed: ``cost`` is what it holds
    once parsed (the bytes received, the copy protobuf parses and what protobuf makes of
    it), known before any of it is allocated."""

    __slots__ = ("_kept", "_raw", "cost", "data")

    def __init__(self, data: bytes, kept: list[tuple[int, int]],
                 raw: list[tuple[int, int]], cost: int) -> None:
        self.data = data
        self._kept = kept  # spans of data that protobuf parses (everything but raw tensors)
        self._raw = raw  # spans of the raw tensors' values
        self.cost = cost

    def parse(self) -> SplitRequest:
        """The message, with its raw tensors as views of the received bytes."""
        view = memoryview(self.data)
        if len(self._kept) == 1:
            start, stop = self._kept[0]
            rest = self.data if (start, stop) == (0, len(self.data)) else view[start:stop]
        else:
            rest = b"".join(view[start:stop] for start, stop in self._kept)
        try:
            message = proto.ModelInferRequest.FromString(rest)
        except DecodeError as error:
            raise _not_a_message(str(error) or "protobuf refuses it") from None
        return SplitRequest(message, [view[start:stop] for start, stop in self._raw])


def walk_infer_request(data: bytes) -> WalkedRequest:
    """gRPC's ModelInfer deserializer (through the front end, which turns a refusal into
    the call's status): the request's fields counted and bounded, nothing parsed yet.
    Raises ``ServeError`` INVALID_ARGUMENT naming what is beyond a bound or malformed."""
    walker = _Walker(data)
    kept: list[tuple[int, int]] = []
    raw: list[tuple[int, int]] = []
    seen: set[int] = set()
    inputs = outputs = parameters = 0
    run = 0  # data[run:field start] is the run of fields since the last raw tensor
    for number, wire, field_start, start, stop in walker.fields(0, len(data)):
        if wire != _LENGTH_DELIMITED:
            walker.unknown("the request", number)
        elif number == RAW_INPUT_CONTENTS:
            if len(raw) == MAX_TENSORS:
                raise invalid(f"raw_input_contents has more than {MAX_TENSORS} entries")
            if field_start > run:
                kept.append((run, field_start))
            raw.append((start, stop))
            run = stop
        elif number == _INPUTS:
            if inputs == MAX_TENSORS:
                raise invalid(f"inputs has more than {MAX_TENSORS} entries")
            walker.input(inputs, start, stop)
            inputs += 1
        elif number == _OUTPUTS:
            if outputs == MAX_TENSORS:
                raise invalid(f"outputs has more than {MAX_TENSORS} entries")
            walker.output(outputs, start, stop)
            outputs += 1
        elif number == _PARAMETERS:
            parameters += 1
            if parameters > MAX_PARAMETERS:
                raise invalid(f"parameters has more than {MAX_PARAMETERS} entries")
        elif number in _REQUEST_FIELDS:
            if number in seen:
                raise invalid(f"{_REQUEST_FIELDS[number]} is given twice")
            seen.add(number)
            if number != _ID:  # the id is only echoed back: the client's own bytes
                _short(_REQUEST_FIELDS[number], start, stop)
        else:
            walker.unknown("the request", number)
    if run < len(data):
        kept.append((run, len(data)))
    counts = walker.counts
    parsed = sum(stop - start for start, stop in kept)
    submessages = inputs + outputs + parameters + counts.submessages
    cost = (len(data) + (0 if len(kept) == 1 else parsed) + parsed + counts.contents_bytes
            + SUBMESSAGE_BYTES * (submessages + len(raw)))
    return WalkedRequest(data, kept, raw, cost)
