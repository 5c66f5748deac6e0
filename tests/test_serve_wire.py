"""The ModelInfer deserializer that keeps raw tensors where they arrived: for any message
it gives what protobuf's own parse gives, and for any bytes it accepts or refuses as
protobuf does (it hands protobuf whatever it does not walk itself)."""

from __future__ import annotations

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.serving import proto
from agent.serving.wire import split_infer_request

names = st.text(max_size=12)


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


def as_protobuf_does(data: bytes) -> None:
    """Refused where protobuf refuses ``data``, else the same parse."""
    try:
        proto.ModelInferRequest.FromString(data)
    except DecodeError:
        with pytest.raises(DecodeError):
            split_infer_request(data)
        return
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
