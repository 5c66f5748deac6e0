"""Frigate's zmq detector protocol without a server: the header checks, both answer forms,
the input conversion, the post-processing against plain references, the config keys."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from agent.config.loader import ConfigError, load_config
from agent.serving import frigate_protocol as protocol
from agent.serving.core import ModelMetadata, TensorSpec
from agent.serving.detections import nms, ssd, yolo_generic, yolonas, zero_result
from agent.serving.frigate_input import InputError, plan_input
from tests.frigate_reference import astronaut, nudenet_model, reference_ssd, reference_yolo
from tests.onnx_models import ssd_detector


def header(**fields: object) -> bytes:
    return json.dumps({"shape": [1, 4, 4, 3], "dtype": "uint8", "model_type": "ssd",
                       **fields}).encode()


def test_a_frigate_header_and_tensor_parse_into_a_view_of_the_bytes() -> None:
    tensor = np.arange(48, dtype=np.uint8).reshape(1, 4, 4, 3)
    message = protocol.parse([protocol.detect_header(tensor, "yologeneric"), tensor.tobytes()],
                             1 << 20)
    assert isinstance(message, protocol.Detect)
    assert message.model_type == "yologeneric"
    np.testing.assert_array_equal(message.tensor, tensor)
    assert json.loads(protocol.detect_header(tensor, "ssd")) == {
        "shape": [1, 4, 4, 3], "dtype": "uint8", "model_type": "ssd"}


@pytest.mark.parametrize(("frames", "why"), [
    ([b"{not json", b""], "not JSON"),
    ([b"[1, 2]", b""], "not a JSON object"),
    ([b" " * 5000, b""], "header of 5000 bytes"),
    ([header(shape=[1, 4, 4]), bytes(48)], "4 integers"),
    ([header(shape=[1, 4, True, 3]), bytes(48)], "4 integers"),
    ([header(shape=[1, 4, 0, 3]), bytes(0)], "4 integers"),
    ([header(dtype="float64"), bytes(48)], "dtype must be one of uint8, float32"),
    ([header(), bytes(47)], "tensor of 47 bytes where shape [1, 4, 4, 3] uint8 is 48"),
    ([header(shape=[1, 4096, 4096, 3]), b""], "at most 1048576"),
    ([header()], "a header and a tensor frame"),
    ([header(), b"", b""], "3 frames"),
])
def test_a_bad_request_is_refused_before_its_tensor_is_used(frames: list[bytes],
                                                            why: str) -> None:
    with pytest.raises(protocol.ProtocolError) as raised:
        protocol.parse(frames, 1 << 20)
    assert why in str(raised.value)


def test_model_questions_and_uploads_are_told_apart() -> None:
    query = protocol.parse([b'{"model_request": true, "model_name": "yolo.onnx"}'], 1024)
    assert query == protocol.ModelQuery("yolo.onnx")
    upload = protocol.parse([b'{"model_data": true, "model_name": "y.onnx"}', b"x" * 10], 1024)
    assert upload == protocol.ModelUpload("y.onnx")
    assert json.loads(protocol.upload_refused()[0]) == {"model_saved": False,
                                                       "model_loaded": False}


def test_both_answer_forms_frigate_reads_and_its_zero_result_for_the_rest() -> None:
    result = np.arange(120, dtype=np.float32).reshape(20, 6)
    np.testing.assert_array_equal(protocol.decode_result(protocol.result_frames(result)), result)
    pair = [json.dumps({"shape": [20, 6], "dtype": "float32"}).encode(), result.tobytes()]
    np.testing.assert_array_equal(protocol.decode_result(pair), result)
    for bad in ([b"short"], [], [b"{", result.tobytes()]):
        np.testing.assert_array_equal(protocol.decode_result(bad), zero_result())


def spec_model(shape: tuple[int, ...], datatype: str) -> ModelMetadata:
    return ModelMetadata("m", ("1",), (TensorSpec("images", datatype, shape),),
                         (TensorSpec("out", "FP32", (1, 5, 5)),))


def test_a_uint8_frame_in_either_layout_becomes_the_models_float_nchw_input() -> None:
    frame = astronaut(32)
    expected = frame.transpose(0, 3, 1, 2).astype(np.float32) / 255
    plan = plan_input(spec_model((1, 3, 32, 32), "FP32"), "float")
    np.testing.assert_array_equal(plan.convert(frame), expected)
    np.testing.assert_array_equal(plan.convert(frame.transpose(0, 3, 1, 2)), expected)
    denorm = plan_input(spec_model((1, 3, -1, -1), "FP32"), "float_denorm")
    np.testing.assert_array_equal(denorm.convert(frame), expected * 255)
    nhwc = plan_input(spec_model((1, 32, 32, 3), "UINT8"), "float")
    converted = nhwc.convert(frame.transpose(0, 3, 1, 2))
    assert converted.dtype == np.uint8 and converted.flags.c_contiguous
    np.testing.assert_array_equal(converted, frame)


@pytest.mark.parametrize(("model", "frame", "why"), [
    (((1, 3, 32, 32), "FP32"), np.zeros((1, 3, 16, 16), np.uint8), "Frigate sends 16x16"),
    (((1, 32, 32, 3), "UINT8"), np.zeros((1, 32, 32, 3), np.float32), "input_dtype: int"),
    (((1, 3, 32, 32), "FP32"), np.zeros((1, 32, 32, 4), np.uint8), "neither"),
])
def test_a_frame_the_model_cannot_take_says_what_to_change_in_frigate(
        model: tuple[tuple[int, ...], str], frame: np.ndarray, why: str) -> None:
    with pytest.raises(InputError) as raised:
        plan_input(spec_model(*model), "float").convert(frame)
    assert why in str(raised.value)


def test_nms_keeps_the_best_of_overlapping_boxes_and_separate_ones() -> None:
    boxes = np.array([[0, 0, 10, 10], [1, 1, 11, 11], [20, 20, 30, 30], [0, 0, 10, 5]],
                     np.float32)
    scores = np.array([0.5, 0.9, 0.8, 0.7], np.float32)
    # box 1 beats 0 (IoU 0.68); box 3 overlaps 1 by 0.35 only, so it stays
    assert nms(boxes, scores).tolist() == [1, 2, 3]


def test_yologeneric_matches_the_plain_reference_on_crowded_candidates() -> None:
    rng = np.random.default_rng(3)
    count, classes = 400, 6
    centres = rng.uniform(20, 300, (count, 2))
    sizes = rng.uniform(10, 80, (count, 2))
    scores = rng.uniform(0, 1, (count, classes)) ** 3
    output = np.concatenate([centres, sizes, scores], axis=1).T[None].astype(np.float32)
    got = yolo_generic([output], 320, 256)
    np.testing.assert_allclose(got, reference_yolo(output, 320, 256), rtol=1e-6, atol=1e-6)
    assert (got[:, 1] > 0.4).sum() == 20  # crowded: the best 20 survive
    # [1, N, 4+C] (the other export) is read the same
    np.testing.assert_allclose(yolo_generic([output.transpose(0, 2, 1)], 320, 256), got)


def test_yologeneric_of_nudenet_finds_the_astronauts_face_as_the_reference_does(
        tmp_path: Path) -> None:
    session = ort.InferenceSession(str(nudenet_model(tmp_path)),
                                   providers=["CPUExecutionProvider"])
    x = astronaut().transpose(0, 3, 1, 2).astype(np.float32) / 255
    output = session.run(None, {"images": x})[0]
    got = yolo_generic([output], 320, 320)
    np.testing.assert_allclose(got, reference_yolo(output, 320, 320), rtol=1e-6, atol=1e-6)
    assert (got[:, 1] > 0.4).sum() >= 1


def test_ssd_rows_stop_at_the_first_score_below_the_threshold(tmp_path: Path) -> None:
    session = ort.InferenceSession(str(ssd_detector(tmp_path / "ssd.onnx")),
                                   providers=["CPUExecutionProvider"])
    for peak in (255, 127):
        image = np.full((1, 64, 64, 3), peak, np.uint8)
        outputs = session.run(None, {"image": image})
        got = ssd(outputs, 64, 64)
        np.testing.assert_array_equal(got, reference_ssd(outputs))
        assert (got[:, 1] > 0).sum() == (7 if peak == 255 else 2)


def test_yolonas_rows_are_normalised_and_end_at_a_negative_class() -> None:
    rows = np.array([[0, 10, 20, 30, 40, 0.9, 2], [0, 0, 0, 64, 32, 0.8, 5],
                     [0, 1, 1, 2, 2, 0.7, -1]], np.float32)
    got = yolonas([rows], 64, 128)
    np.testing.assert_allclose(got[:2], [[2, 0.9, 20 / 64, 10 / 128, 40 / 64, 30 / 128],
                                         [5, 0.8, 0, 0, 32 / 64, 64 / 128]])
    assert not got[2:].any()


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "agent.yaml"
    path.write_text(text)
    return str(path)


def test_serve_frigate_is_off_by_default_and_takes_frigates_names(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, "{}\n")).serve.frigate is None
    frigate = load_config(write(tmp_path, "serve: {frigate: {model: yolo, model_type: "
                                          "yolo-generic}}\n")).serve.frigate
    assert frigate is not None
    assert (frigate.endpoint, frigate.model, frigate.model_type, frigate.input_dtype) == (
        "ipc:///tmp/cache/zmq_detector", "yolo", "yolo-generic", "float")


@pytest.mark.parametrize(("text", "message"), [
    ("{}", "serve.frigate: missing model"),
    ("{model: yolo, model_type: yolox}", "serve.frigate.model_type: 'yolox' is not allowed: "
                                         "expected one of ssd, yologeneric, yolonas, rfdetr, "
                                         "yolo-generic or null (yolox is not post-processed"),
    ("{model: yolo, endpoint: 'tcp://0.0.0.0:5555'}", "loopback only"),
    ("{model: yolo, endpoint: 'ipc://relative'}", "serve.frigate.endpoint"),
    ("{model: '../etc'}", "serve.frigate.model"),
    ("{model: yolo, input_dtype: int}", "expected one of float, float_denorm"),
])
def test_a_bad_serve_frigate_key_is_one_line_naming_it(tmp_path: Path, text: str,
                                                       message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        load_config(write(tmp_path, f"serve: {{frigate: {text}}}\n"))
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_the_data_plane_without_serve_frigate_does_not_load_zmq() -> None:
    from tests.agent_process import modules_loaded_by

    assert modules_loaded_by("import agent.serving.server, agent.service.serve, "
                             "agent.config.loader", "zmq") == []
    assert "zmq" in modules_loaded_by("import agent.serving.frigate_api", "zmq")
