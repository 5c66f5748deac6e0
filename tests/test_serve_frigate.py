"""``serve.frigate`` on a real ``edge-agent serve``: Frigate's zmq detector exchange as Frigate
does it (``FrigateClient``: its header, its 200 ms timeout and socket reset), answered with the
model's detections, equal to ONNX Runtime's own outputs post-processed plainly, or with
Frigate's zero result for everything that goes wrong, never a hung socket."""

from __future__ import annotations

import json
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from agent.serving.detections import zero_result
from agent.serving.frigate_client import FrigateClient
from agent.serving.frigate_protocol import detect_header
from tests.frigate_reference import astronaut, nudenet_model, reference_ssd, reference_yolo
from tests.onnx_models import slow_image_model, ssd_detector
from tests.test_serve_process import serve_process

# Frigate's request_timeout_ms where a test wants the model's answer, on both sides: its 200
# ms is the contract, but a loaded 2-core machine can take longer for a YOLOv8n run
LOADED_MS = 3000


def install(tmp_path: Path, name: str, source: Path) -> None:
    """``source`` as version 1 of ``name`` in the repository serve_process gives its server."""
    version = tmp_path / "state" / "repository" / name / "1"
    version.mkdir(parents=True)
    shutil.copyfile(source, version / "model.onnx")


@pytest.fixture
def client_for() -> Iterator[Any]:
    clients: list[FrigateClient] = []

    def connect(endpoint: str, model_type: str, timeout_ms: int = LOADED_MS) -> FrigateClient:
        clients.append(FrigateClient(endpoint, model_type, timeout_ms=timeout_ms))
        return clients[-1]

    yield connect
    for client in clients:
        client.close()


def session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def test_yologeneric_detections_equal_the_models_own_in_either_layout_and_dtype(
        tmp_path: Path, client_for: Any) -> None:
    model = nudenet_model(tmp_path)
    install(tmp_path, "faces", model)
    endpoint = f"ipc://{tmp_path}/zmq_detector"
    frame = astronaut()  # uint8 NHWC, as Frigate's default model.input_tensor sends it
    x = frame.transpose(0, 3, 1, 2).astype(np.float32) / 255
    expected = reference_yolo(session(model).run(None, {"images": x})[0], 320, 320)
    assert (expected[:, 1] > 0.4).sum() >= 1  # the astronaut's face
    with serve_process(tmp_path, frigate={"endpoint": endpoint, "model": "faces",
                                          "request_timeout_ms": LOADED_MS},
                       max_request_mb=2) as plane:
        assert plane["frigate"] == endpoint
        assert stat.S_IMODE((tmp_path / "zmq_detector").stat().st_mode) == 0o660
        client = client_for(endpoint, "yologeneric")
        assert client.model_ready
        for given in (frame, frame.transpose(0, 3, 1, 2), x):  # NHWC, NCHW, float NCHW
            np.testing.assert_allclose(client.detect(given), expected, rtol=1e-5, atol=1e-5)
        # what goes wrong is Frigate's zero result, and the next request is answered
        assert_zero(client.request([b"{not json", frame.tobytes()]))
        assert_zero(client.request([detect_header(frame, "yologeneric"), frame.tobytes()[1:]]))
        client.model_type = "yolox"  # not post-processed here
        assert_zero(client.detect(frame))
        client.model_type = "yologeneric"
        np.testing.assert_allclose(client.detect(frame), expected, rtol=1e-5, atol=1e-5)
        assert client.resets == 0  # every one of them answered within Frigate's 200 ms
        # over serve.max_request_mb: libzmq drops it and the peer unread; Frigate's timeout
        # answers zeros and resets its socket, and the new one is served
        big = np.zeros((1, 3, 1024, 1024), np.float32)
        assert_zero(client.detect(big))
        assert client.resets == 1 and client.model_ready
        np.testing.assert_allclose(client.detect(frame), expected, rtol=1e-5, atol=1e-5)


def assert_zero(result: np.ndarray) -> None:
    np.testing.assert_array_equal(result, zero_result())


def test_ssd_detections_equal_the_models_own_and_a_wrong_frame_is_zeros(
        tmp_path: Path, client_for: Any) -> None:
    model = ssd_detector(tmp_path / "ssd.onnx")
    install(tmp_path, "ssd", model)
    endpoint = f"ipc://{tmp_path}/detector/zmq"  # a directory it creates
    rng = np.random.default_rng(5)
    with serve_process(tmp_path, frigate={"endpoint": endpoint, "model": "ssd",
                                          "model_type": "ssd",
                                          "request_timeout_ms": LOADED_MS}) as plane:
        assert plane["frigate"] == endpoint
        # the config's model_type answers, whatever Frigate's header says
        client = client_for(endpoint, "yologeneric")
        for peak, kept in ((255, 7), (127, 2)):
            frame = rng.integers(0, peak, (1, 64, 64, 3), dtype=np.uint8, endpoint=True)
            frame[0, 0, 0, 0] = peak
            expected = reference_ssd(session(model).run(None, {"image": frame}))
            assert (expected[:, 1] > 0).sum() == kept
            np.testing.assert_array_equal(client.detect(frame), expected)
            np.testing.assert_array_equal(client.detect(frame.transpose(0, 3, 1, 2)), expected)
        assert_zero(client.detect(np.zeros((1, 32, 32, 3), np.uint8)))  # not the model's size
        assert_zero(client.detect(np.zeros((1, 64, 64, 3), np.float32)))  # uint8 model
        assert client.resets == 0


def test_a_model_too_slow_for_frigates_timeout_is_answered_zeros_in_time(
        tmp_path: Path, client_for: Any) -> None:
    install(tmp_path, "slow", slow_image_model(tmp_path / "slow.onnx"))
    # the request's timeout ends a late run (and max_run_ms any other): a stop finds none
    (tmp_path / "state" / "repository" / "slow" / "config.yaml").write_text(
        "dynamic_batching: {queue: {allow_timeout_override: true}}\nmax_run_ms: 2000\n")
    endpoint = f"ipc://{tmp_path}/zmq_detector"
    # a second on both sides, where the 1024 x 1024 run takes seconds: a loaded machine's
    # stalls cannot make the answer late, nor a fast machine's run make it in time
    with serve_process(tmp_path, frigate={"endpoint": endpoint, "model": "slow",
                                          "model_type": "yologeneric",
                                          "request_timeout_ms": 1000}):
        client = client_for(endpoint, "yologeneric", 1000)
        assert client.model_ready
        frame = np.zeros((1, 3, 1024, 1024), np.float32)
        for _ in range(3):  # late, late, then both workers still busy with the late ones
            assert_zero(client.detect(frame))
        assert client.resets == 0  # each within Frigate's timeout: its socket never reset


def test_a_model_the_repository_lacks_is_not_loaded_and_its_frames_are_zeros(
        tmp_path: Path, client_for: Any) -> None:
    import zmq

    endpoint = f"ipc://{tmp_path}/zmq_detector"
    with serve_process(tmp_path, frigate={"endpoint": endpoint, "model": "absent"}):
        client = client_for(endpoint, "ssd")
        assert not client.model_ready  # Frigate then sends no frames
        # a detector that sends one anyway, and a model upload, are answered all the same
        with zmq.Context() as context, context.socket(zmq.REQ) as raw:
            raw.setsockopt(zmq.RCVTIMEO, 5000)
            raw.connect(endpoint)
            frame = np.zeros((1, 64, 64, 3), np.uint8)
            raw.send_multipart([detect_header(frame, "ssd"), frame.tobytes()])
            assert raw.recv_multipart() == [zero_result().tobytes()]
            raw.send_multipart([b'{"model_data": true, "model_name": "x.onnx"}', b"onnx"])
            assert json.loads(raw.recv_multipart()[0]) == {"model_saved": False,
                                                          "model_loaded": False}
