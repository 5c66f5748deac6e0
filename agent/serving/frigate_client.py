"""A client that does what Frigate's ``zmq`` detector (``ZmqIpcDetector``) does, for the tests
and bench/serve.py: what works with it works with Frigate.

A REQ socket with Frigate's send/receive timeout (200 ms) and linger 0; the model question
first (30 s to answer), and no detection sent until it was answered "available and loaded";
a timeout or socket error closes the socket, opens a new one and asks again, answering that
detection with the zero result, as every failure is answered.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import zmq

from agent.serving import frigate_protocol as protocol
from agent.serving.detections import zero_result


class FrigateClient:
    def __init__(self, endpoint: str, model_type: str, model_name: str = "model.onnx",
                 timeout_ms: int = protocol.REQUEST_TIMEOUT_MS) -> None:
        self.endpoint = endpoint
        self.model_type = model_type
        self.model_name = model_name
        self.timeout_ms = timeout_ms
        self.resets = 0  # sockets closed after a timeout or error
        self._context = zmq.Context()
        self._socket: zmq.Socket[bytes] = self._open()
        self.model_ready = self.ask_model()

    def _open(self) -> zmq.Socket[bytes]:
        sock = self._context.socket(zmq.REQ)
        sock.setsockopt(zmq.RCVTIMEO, self.timeout_ms)
        sock.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        return sock

    def _reset(self) -> None:
        self.resets += 1
        self._socket.close(linger=0)
        self._socket = self._open()
        self.model_ready = self.ask_model()

    def ask_model(self) -> bool:
        """The question Frigate asks first: whether the detector holds its model, loaded."""
        self._socket.setsockopt(zmq.RCVTIMEO, protocol.MODEL_TIMEOUT_MS)
        try:
            self._socket.send_multipart([json.dumps(
                {"model_request": True, "model_name": self.model_name}).encode()])
            frames = self._socket.recv_multipart()
            answer: Any = json.loads(frames[0]) if len(frames) == 1 else {}
        except (zmq.ZMQError, ValueError):
            return False
        finally:
            self._socket.setsockopt(zmq.RCVTIMEO, self.timeout_ms)
        return bool(answer.get("model_available") and answer.get("model_loaded"))

    def request(self, frames: list[bytes]) -> np.ndarray:
        """Any frames sent as a detection request is, answered as Frigate reads answers."""
        if not self.model_ready:
            return zero_result()
        try:
            self._socket.send_multipart(frames)
            return protocol.decode_result(self._socket.recv_multipart())
        except zmq.ZMQError:  # zmq.Again: the timeout
            self._reset()
            return zero_result()

    def detect(self, tensor: np.ndarray) -> np.ndarray:
        """Frigate's ``detect_raw``: ``[20, 6]`` detections of ``tensor``."""
        return self.request([protocol.detect_header(tensor, self.model_type),
                             np.ascontiguousarray(tensor).tobytes()])

    def close(self) -> None:
        self._context.destroy(linger=0)
