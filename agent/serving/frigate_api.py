"""The Frigate front end (``serve.frigate``): Frigate's ``zmq`` detector answered from ``Models``.

A REP socket on its own thread.  Frigate's REQ socket waits ``request_timeout_ms`` (200) and
then resets, so every request is answered, and in time: a detection runs on a small pool
while this thread waits 3/4 of that for it; one that is late, or finds the pool still busy
with late ones, is answered Frigate's zero result and its run finishes unheard (so a slow
model costs detections, never a hung detector, and never more than ``WORKERS`` runs at
once).  Anything a message or the model gets wrong is the zero result too, with a warning at
most every ``WARN_EVERY_S`` per reason.  libzmq drops a message over ``MAXMSGSIZE`` (and the
peer) before it is buffered; the header is checked before the tensor is looked at.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import socket
import stat
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import zmq

from agent.serving import frigate_protocol as protocol
from agent.serving.core import InferRequest, Models, Tensor
from agent.serving.detections import POST_PROCESS, DetectionError, zero_result
from agent.serving.errors import ServeError
from agent.serving.frigate_input import InputError, plan_input
from agent.serving.frigate_protocol import Detect, FrigateSettings, ModelQuery, ProtocolError
from agent.serving.frigate_types import model_type_name

logger = logging.getLogger(__name__)

WORKERS = 2  # detections running at once, late ones included
MODEL_WAIT_S = 20.0  # a model question waits this long for a loading model (Frigate: 30 s)
POLL_S = 0.1  # how soon the thread sees a stop
WARN_EVERY_S = 10.0
STOP_WAIT_S = 10.0  # for the runs a stop finds going


class BindError(Exception):
    """The endpoint cannot be taken: the message names the key."""


class Warnings:
    """One log line per reason per WARN_EVERY_S, with how many were not logged: a camera
    sends several frames a second, and one misconfiguration must not be a line each."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[float, int]] = {}

    def warn(self, reason: str, message: str) -> None:
        now = time.monotonic()
        when, quiet = self._last.get(reason, (float("-inf"), 0))
        if now - when < WARN_EVERY_S:
            self._last[reason] = (when, quiet + 1)
            return
        self._last[reason] = (now, 0)
        logger.warning("serve.frigate: %s%s", message,
                       f" ({quiet} more since the last line)" if quiet else "")


def _ipc_path(endpoint: str) -> Path | None:
    return Path(endpoint.removeprefix("ipc://")) if endpoint.startswith("ipc://") else None


def _check_ipc_path(path: Path, endpoint: str) -> None:
    """libzmq unlinks whatever is at an ipc path before it binds: only a socket nobody
    listens on (one a stopped server left) may be there."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise BindError(f"serve.frigate.endpoint {endpoint}: {path} exists and is not a socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except OSError:
            return
    raise BindError(f"serve.frigate.endpoint {endpoint}: another process listens there")


class FrigateFrontEnd:
    """One REP socket and the thread that answers it."""

    def __init__(self, models: Models, settings: FrigateSettings, max_request_bytes: int,
                 initializer: Callable[[], None] | None = None) -> None:
        self.models = models
        self.settings = settings
        self.max_request_bytes = max_request_bytes
        self.warnings = Warnings()
        self._context = zmq.Context()
        self._socket: zmq.Socket[bytes] | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(
            WORKERS, "infer-frigate", initializer=initializer)
        self._slots = threading.BoundedSemaphore(WORKERS)
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._asked: set[str] = set()

    def start(self) -> str:
        """Bind and answer; the bound endpoint (tcp port 0: the port taken)."""
        endpoint = self.settings.endpoint
        path = _ipc_path(endpoint)
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as error:
                raise BindError(f"serve.frigate.endpoint {endpoint}: cannot create "
                                f"{path.parent}: {error.strerror or error}") from None
            _check_ipc_path(path, endpoint)
        sock = self._context.socket(zmq.REP)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_request_bytes)
        sock.setsockopt(zmq.RCVHWM, 4)  # a REQ has one request out; a pipeline waits in it
        sock.setsockopt(zmq.SNDTIMEO, 0)  # a reply to a peer that left is dropped at once
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as error:
            sock.close()
            raise BindError(f"serve.frigate.endpoint {endpoint}: cannot listen there: "
                            f"{error}") from None
        if path is not None:
            os.chmod(path, 0o660)  # Frigate's user, or its group: not every local process
        self._socket = sock
        bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._thread = threading.Thread(target=self._serve, name="frigate", daemon=True)
        self._thread.start()
        logger.info("serve.frigate: answering Frigate at %s with model %s", bound,
                    self.settings.model)
        return bound

    def stop(self) -> None:
        """After the registry stopped: the runs still going end before the process does."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(5.0)
        self._pool.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + STOP_WAIT_S
        for _ in range(WORKERS):
            self._slots.acquire(timeout=max(0.0, deadline - time.monotonic()))
        self._context.destroy(linger=0)

    def _serve(self) -> None:
        sock = self._socket
        assert sock is not None
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not self._stopping.is_set():
            try:
                if not poller.poll(int(POLL_S * 1000)):
                    continue
                frames = sock.recv_multipart(copy=False)
            except zmq.ZMQError as error:
                self.warnings.warn("receive", f"receive failed: {error}")
                continue
            reply = self.answer([frame.buffer for frame in frames])
            try:
                sock.send_multipart(reply)
            except zmq.ZMQError as error:  # the peer left: REP drops the reply, goes on
                self.warnings.warn("send", f"reply not sent: {error}")
        sock.close(linger=0)

    def answer(self, frames: Sequence[protocol.Frame]) -> list[bytes]:
        """The reply to one message; never raises (a bug costs one request)."""
        try:
            message = protocol.parse(frames, self.max_request_bytes)
            if isinstance(message, ModelQuery):
                return self._model_status(message.name)
            if isinstance(message, Detect):
                return protocol.result_frames(self._detect(message))
            self.warnings.warn("upload", f"Frigate sent model {message.name!r}: models come "
                               f"from the repository (serve.frigate.model "
                               f"{self.settings.model})")
            return protocol.upload_refused()
        except ProtocolError as error:
            self.warnings.warn("protocol", f"not Frigate's request: {error}")
        except Exception:  # one request's bug must not end the thread
            logger.exception("serve.frigate: request failed")
        return protocol.result_frames(zero_result())

    def _detect(self, message: Detect) -> np.ndarray:
        if not self._slots.acquire(blocking=False):
            self.warnings.warn("busy", f"{WORKERS} detections still running past their "
                               "deadline: answered zeros")
            return zero_result()
        try:
            future = self._pool.submit(self._run, message)
        except RuntimeError:  # stopping
            self._slots.release()
            return zero_result()
        try:
            return future.result(self.settings.deadline_s)
        except concurrent.futures.TimeoutError:
            self.warnings.warn("late", f"model {self.settings.model} did not answer within "
                               f"{self.settings.deadline_s * 1000:g} ms: answered zeros")
        except (ServeError, InputError, DetectionError) as error:
            self.warnings.warn(type(error).__name__, str(error))
        return zero_result()

    def _run(self, message: Detect) -> np.ndarray:
        """On the pool: convert, infer, post-process."""
        try:
            name = self.settings.model
            model_type = model_type_name(self.settings.model_type or message.model_type or "")
            post_process = POST_PROCESS.get(model_type)
            if post_process is None:
                raise DetectionError(f"model_type {model_type or '(none)'} is not served "
                                     f"(served: {', '.join(POST_PROCESS)})")
            meta = self.models.model_metadata(name, "")
            plan = plan_input(meta, self.settings.input_dtype)
            tensor = plan.convert(message.tensor)
            # a queue that allows it ends the run at the deadline (config.yaml
            # dynamic_batching.queue.allow_timeout_override) instead of finishing it unheard
            result = self.models.infer(InferRequest(
                name, "", (Tensor(plan.name, tensor),),
                parameters={"timeout": int(self.settings.deadline_s * 1e6)}))
            arrays = {output.name: output.array for output in result.outputs}
            outputs = [arrays[spec.name] for spec in meta.outputs if spec.name in arrays]
            return post_process(outputs, *plan.height_width(message.tensor))
        finally:
            self._slots.release()

    def _model_status(self, asked: str) -> list[bytes]:
        """Whether Frigate may send frames: the model is ready, or still loading after
        MODEL_WAIT_S (its frames get zeros until it is; a "not loaded" would stop that
        Frigate asking until it restarts).  Never "not available", which would make
        Frigate upload its model file."""
        name = self.settings.model
        if asked and asked != name and asked not in self._asked:
            self._asked.add(asked)
            logger.info("serve.frigate: Frigate's model is %s; model %s answers it", asked,
                        name)
        deadline = time.monotonic() + MODEL_WAIT_S
        while True:
            states = {row.state: row.reason for row in self.models.index(False)
                      if row.name == name}
            if "READY" in states:
                return protocol.model_status(True, True)
            if "LOADING" not in states or time.monotonic() > deadline or \
                    self._stopping.wait(POLL_S):
                break
        if "LOADING" in states:
            return protocol.model_status(True, True)
        reason = next(iter(states.values()), "") or "not in the repository"
        logger.error("serve.frigate: model %s cannot serve Frigate: %s", name, reason)
        return protocol.model_status(True, False)
