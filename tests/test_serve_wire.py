"""The ModelInfer deserializer that keeps raw tensors where they arrived: for any message
within its bounds it gives what protobuf's own parse gives, it never accepts bytes that
protobuf refuses, and a flood of fields is refused before it costs a parse."""

from __future__ import annotations

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st
from wire_helpers import field, varint

from agent.serving import proto
from agent.serving.errors import ServeError
from agent.serving.wire import SplitRequest, walk_infer_request

names = st.text(max_size=12)


def split_infer_request(data: bytes) -> SplitRequest:
    return walk_infer_request(data).parse()


@st.composite
def requests(draw: st.DrawFn) -> bytes:
    message = proto.ModelInferRequest(model_name=draw(names), model_version=draw(names),
                                      id=draw(names))
    for key in draw(st.lists(names, max_size=3)):
        message.parameters[key].int64_param = draw(st.integers(-2**63, 2**63 - 1))
    for _ in range(draw(st.integers(0, 3))):
        tensor = message.inputs.add(name=draw(names), datatype="FP32",
                                    shape=draw(st.lists(st.integers(0, 2**40), max_size=4)))
        if draw(st.booleans()):
            tensor.contents.fp32_contents.extend(draw(st.lists(st.floats(width=32),
                                                               max_size=4)))
        message.raw_input_contents.append(draw(st.binary(max_size=300)))
    for _ in range(draw(st.integers(0, 2))):
        message.outputs.add(name=draw(names))
    return message.SerializeToString()


def same(data: bytes) -> None:
    """The split's message and raw tensors are protobuf's parse of ``data``."""
    split = split_infer_request(data)
    whole = proto.ModelInferRequest.FromString(data)
    assert [bytes(raw) for raw in split.raw] == list(whole.raw_input_contents)
    whole.ClearField("raw_input_contents")
    split.message.ClearField("raw_input_contents")
    assert split.message == whole


# Why the walk may refuse what protobuf would parse: encodings no client of the protocol
# sends, whose cost it would rather not bound (a group, a singular field given twice), or
# counts beyond its bounds.
DELIBERATE = ("a group", "given twice", "unknown", "more than")


def as_protobuf_does(data: bytes) -> None:
    """Refused where protobuf refuses ``data``; else the same parse, or refused for one
    of the deliberate reasons; a refusal is always INVALID_ARGUMENT."""
    try:
        proto.ModelInferRequest.FromString(data)
        parses = True
    except DecodeError:
        parses = False
    try:
        split_infer_request(data)
    except ServeError as error:
        assert error.code == "INVALID_ARGUMENT"
        assert not parses or any(why in error.message for why in DELIBERATE), error.message
        return
    assert parses
    same(data)


@settings(max_examples=300, deadline=None)
@given(requests())
def test_a_valid_message_splits_into_protobufs_own_parse(data: bytes) -> None:
    same(data)
    assert all(isinstance(raw, memoryview) for raw in split_infer_request(data).raw)


@settings(max_examples=300, deadline=None)
@given(requests(), st.data())
def test_a_cut_or_corrupted_message_is_accepted_or_refused_as_protobuf_does(
        data: bytes, choice: st.DataObject) -> None:
    cut = data[:choice.draw(st.integers(0, len(data)))]
    flipped = bytearray(data)
    if flipped:
        flipped[choice.draw(st.integers(0, len(data) - 1))] ^= choice.draw(st.integers(1, 255))
    for hostile in (cut, bytes(flipped), cut + b"\x3b\x3c", b"\x3a" + data):
        as_protobuf_does(hostile)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_arbitrary_bytes_are_accepted_or_refused_as_protobuf_does(data: bytes) -> None:
    as_protobuf_does(data)


# --- bounds: every count is refused before the work it drives ------------------------------




def refusal(data: bytes) -> str:
    with pytest.raises(ServeError) as excinfo:
        walk_infer_request(data)
    assert excinfo.value.code == "INVALID_ARGUMENT"
    return excinfo.value.message


EMPTY_INPUT, EMPTY_OUTPUT, EMPTY_RAW, EMPTY_PARAMETER = (field(n, b"") for n in (5, 6, 7, 4))


@pytest.mark.parametrize(("data", "named"), [
    (EMPTY_INPUT * 3_000_000, "inputs has more than 1024 entries"),  # 6 MB: was +1 GB
    (EMPTY_OUTPUT * 3_000_000, "outputs has more than 1024 entries"),
    (EMPTY_RAW * 3_000_000, "raw_input_contents has more than 1024 entries"),
    (EMPTY_PARAMETER * 3_000_000, "parameters has more than 64 entries"),
    # 8 MB of unknown varints (field 100): was seconds of walking, and protobuf's copy
    (varint(100 << 3) + b"\x01", "unknown"),
    (field(1, b"m") * 2, "model_name is given twice"),
    (field(5, field(1, b"x") * 2), "inputs[0]: field 1 is given twice"),
    (field(5, field(4, b"") * 65), "inputs[0].parameters has more than 64 entries"),
    (field(6, field(2, b"") * 65), "outputs[0].parameters has more than 64 entries"),
    (field(5, field(3, b"\x01" * 17)), "inputs[0].shape has more than 16 dimensions"),
    (field(5, b"\x18\x01" * 17), "inputs[0].shape has more than 16 dimensions"),  # unpacked
    (field(5, field(5, b"\x35\x00\x00\x80\x3f" * 17)), "send typed contents packed"),
    (field(5, field(5, field(8, b"x"))), "bytes_contents: BYTES tensors are not supported"),
    (b"\x2b\x2c", "a group"),
    (field(1, b"m" * 1025), "model_name is longer than 1024 bytes"),
    (field(2, b"1" * 1025), "model_version is longer than 1024 bytes"),
    (field(5, field(1, b"x" * 1025)), "inputs[0].name is longer than 1024 bytes"),
    (field(5, field(2, b"x" * 1025)), "inputs[0].datatype is longer than 1024 bytes"),
    (field(6, field(1, b"x" * 1025)), "outputs[0].name is longer than 1024 bytes"),
], ids=lambda value: value if isinstance(value, str) else "")
def test_a_flood_or_an_odd_encoding_is_refused_naming_the_field(data: bytes,
                                                                named: str) -> None:
    if named == "unknown":
        data = data * 2_700_000
    assert named in refusal(data)


def test_fields_beyond_the_walks_own_bound_are_refused() -> None:
    """Within every other bound, fields of every kind together are bounded too."""
    tensor = field(4, b"") * 64 + b"\x18\x01" * 16
    assert "more than 16384 protobuf fields" in refusal(field(5, tensor) * 1024)


def test_the_cost_covers_what_protobuf_makes_of_typed_contents() -> None:
    """A one-byte varint of int64_contents is 8 bytes once parsed: charged as 8."""
    message = proto.ModelInferRequest(model_name="m")
    message.inputs.add(name="x", datatype="INT64", shape=[4096]).contents.int64_contents.extend(
        [1] * 4096)
    data = message.SerializeToString()
    walked = walk_infer_request(data)
    assert walked.cost >= len(data) + 8 * 4096
    raw = proto.ModelInferRequest(model_name="m")
    raw.inputs.add(name="x", datatype="FP32", shape=[4096])
    raw.raw_input_contents.append(b"\0" * 4 * 4096)
    data = raw.SerializeToString()
    assert len(data) <= walk_infer_request(data).cost < len(data) + 1024  # no copy charged


FLOOD_PIECES = [EMPTY_INPUT, EMPTY_OUTPUT, EMPTY_RAW, EMPTY_PARAMETER,
                varint(100 << 3) + b"\x01", field(100, b"x"), field(1, b"m"),
                field(5, field(3, b"\x01" * 4)), field(5, b"\x18\x01" * 4),
                field(5, field(5, field(6, b"\0\0\x80\x3f" * 4)))]


@settings(max_examples=200, deadline=None)
@given(requests(), st.sampled_from(FLOOD_PIECES), st.integers(0, 3000))
def test_a_flood_of_any_field_is_refused_or_parsed_as_protobuf_does(
        data: bytes, piece: bytes, count: int) -> None:
    """Whatever field a client repeats, however often: a bound refuses it, or it is parsed
    as protobuf parses it and its cost covers at least the bytes received."""
    flooded = data + piece * count
    as_protobuf_does(flooded)
    try:
        walked = walk_infer_request(flooded)
    except ServeError:
        return
    assert walked.cost >= len(flooded)
