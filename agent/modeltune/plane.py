"""A scratch data plane for measuring: a real ``edge-agent serve`` process over a copy of one
model version, reconfigured per candidate (config.yaml rewritten, the model unloaded and
loaded again through the control API).

A separate process rather than the registry in this one: the load generator's threads
would share the interpreter lock with the scheduler and the front end, and what is tuned
is what ``serve`` will run, transport included.  Unload before load: the last candidate's
sessions are gone before the next one's are built (a 4 GB board holds one set, not two), and
no canary compares two candidates while one of them is being measured.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from agent.serving.errors import ServeError
from agent.serving.http_client import HttpClient
from agent.serving.repository import CONFIG_FILE

START_TIMEOUT_S = 180.0  # sessions of a large model on a slow board take a while
STOP_TIMEOUT_S = 10.0


class PlaneError(RuntimeError):
    """The scratch data plane did not start (its stderr's last line says why)."""


def stage_model(scratch: Path, name: str, files: Mapping[int, Path], home: Path | None,
                config: Mapping[str, Any], serve: int) -> Path:
    """``scratch/repository/<name>/<number>/`` for each of ``files`` (version -> model file):
    the version's files (an ONNX model's external data, a build's ``build.json`` and
    ``.rknn`` among them) when the file is in ``home``/<number>/, the model repository's
    directory of the model, else the model file alone (a built-in one); the config pinned to
    version ``serve``.  The repository copy leaves the operator's files untouched whatever a
    candidate does."""
    directory = scratch / "repository" / name
    for number, model_file in files.items():
        target = directory / str(number)
        target.mkdir(parents=True)
        in_repository = home is not None and model_file.parent == home / str(number)
        sources = [f for f in model_file.parent.iterdir() if f.is_file()] if in_repository \
            else [model_file]
        for source in sources:
            shutil.copyfile(source, target / (source.name if in_repository else "model.onnx"))
    pinned = {k: v for k, v in config.items() if k not in ("version_policy", "sha256")}
    pins = config.get("sha256") or {}
    if any(number in pins for number in files):
        pinned["sha256"] = {number: pins[number] for number in files if number in pins}
    pinned["version_policy"] = {"specific": [serve]}
    (directory / CONFIG_FILE).write_text(yaml.safe_dump(pinned, sort_keys=False))
    return directory / CONFIG_FILE


class ScratchPlane:
    """``edge-agent serve`` on loopback over ``scratch``'s repository, stopped on exit."""

    def __init__(self, scratch: Path, inference_model: str | None = None) -> None:
        self.scratch = scratch
        self.token = secrets.token_hex(16)
        self._inference_model = inference_model
        self._process: subprocess.Popen[bytes] | None = None
        self.address = ""

    def __enter__(self) -> ScratchPlane:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        token_file = self.scratch / "token"
        token_file.write_text(self.token + "\n")
        token_file.chmod(0o600)
        config: dict[str, Any] = {
            "state_dir": str(self.scratch / "state"), "root": "/",
            "serve": {"http": "127.0.0.1:0", "grpc": "127.0.0.1:0", "metrics": None,
                      "repository": str(self.scratch / "repository"),
                      "token_file": str(token_file), "local": False}}
        if self._inference_model:
            config["inference"] = {"model": self._inference_model}
        (self.scratch / "agent.yaml").write_text(yaml.safe_dump(config))
        ready, log = self.scratch / "ready.json", self.scratch / "serve.log"
        with open(log, "wb") as stderr:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "agent", "serve", "--config",
                 str(self.scratch / "agent.yaml"), "--ready-file", str(ready),
                 "--parent-pid", str(os.getpid())],
                stdout=subprocess.DEVNULL, stderr=stderr, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._ready(ready):
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                lines = log.read_text(errors="replace").strip().splitlines()
                raise PlaneError("the scratch data plane did not start: "
                                 + (lines[-1] if lines else "no output"))
            time.sleep(0.05)

    def _ready(self, ready: Path) -> bool:
        """Listening and every model of the scratch repository loaded."""
        try:
            self.address = str(json.loads(ready.read_text())["http"])
        except (OSError, ValueError, KeyError, TypeError):
            return False
        try:
            with self.client() as client:
                return client.ready()
        except ServeError:
            return False

    def client(self, timeout_s: float = 30.0) -> HttpClient:
        return HttpClient(f"http://{self.address}", token=self.token, timeout_s=timeout_s)

    def reload(self, name: str, config_file: Path, config: Mapping[str, Any],
               version: int = 0) -> str:
        """Serve ``name`` with ``config``; the data plane's refusal, or "" when it serves
        (``version``: the one it must serve alone, a variant; 0: whatever the config says)."""
        config_file.write_text(yaml.safe_dump(dict(config), sort_keys=False))
        try:
            with self.client() as client:
                client.unload(name)
                client.load(name)
                served = client.model_metadata(name).versions if version else ()
        except ServeError as error:
            return error.message
        if version and served != (str(version),):
            return f"the data plane serves versions {', '.join(served)}, not {version} alone"
        return ""

    def cpu_seconds(self) -> float:
        """The data plane's CPU time so far, user and system (its threads included)."""
        from agent.telemetry.cpu_time import process_cpu_s

        assert self._process is not None  # started
        return process_cpu_s(self._process.pid)

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
