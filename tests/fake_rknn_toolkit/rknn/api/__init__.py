"""A fake ``rknn.api.RKNN`` that keeps rknn-toolkit2's contract as the worker uses it: each
call returns 0 or -1 (``inference``: a list of arrays) after logging to stdout, calibration
files are .npy in the ONNX model's NCHW layout listed in a dataset .txt, and a 4-D inference
input is taken as NHWC unless ``data_format`` says 'nchw' (the real one then raises).

The simulator's outputs are arithmetic on the inputs, so a test can compute them: output 0
is the sum of all inputs' elements ``[1, 1]``, output 1 the first input flattened ``[1, k]``.
``FAKE_RKNN_MODE`` steers a failure (raises, build_fails, exit, crash, hang,
no_export: export_rknn returns 0 and writes nothing); what was called is
written as JSON to ``FAKE_RKNN_LOG`` on release.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

PLATFORMS = ("rk3562", "rk3566", "rk3568", "rk3576", "rk3588")


class RKNN:
    def __init__(self, verbose: bool = False) -> None:
        self.calls: list[dict[str, Any]] = []
        self.shapes: list[list[int]] = []
        self.built = self.running = False
        # the real toolkit logs to stdout from Python and from C
        print("I rknn-toolkit2 version: 0.0.0-fake")
        os.write(1, b"I fake C-level log line\n")

    def _record(self, call: str, **args: Any) -> None:
        self.calls.append({"call": call, **args})

    def config(self, target_platform: str | None = None, **args: Any) -> int:
        self._record("config", target_platform=target_platform, **args)
        return 0 if target_platform in PLATFORMS else -1

    def load_onnx(self, model: str, inputs: list[str] | None = None,
                  input_size_list: list[list[int]] | None = None) -> int:
        self._record("load_onnx", model=model, inputs=inputs, input_size_list=input_size_list)
        if os.environ.get("FAKE_RKNN_MODE") == "raises":  # as the real one does on a bad file
            raise ValueError("Traceback (most recent call last):\n  File \"rknn_base.py\", "
                             "line 1607\ngoogle.protobuf.message.DecodeError: Error parsing "
                             "message\n")
        if not Path(model).is_file():
            print(f"E load_onnx: {model} does not exist")
            return -1
        self.shapes = input_size_list or []
        return 0

    def build(self, do_quantization: bool = True, dataset: str | None = None) -> int:
        mode = os.environ.get("FAKE_RKNN_MODE", "")
        if mode == "build_fails":
            print("E build: fake refusal of this model")
            return -1
        if mode == "exit":
            sys.exit(-1)
        if mode == "crash":
            for line in range(2000):
                print(f"E fake crash log line {line}", file=sys.stderr)
            sys.stderr.flush()
            os._exit(3)
        if mode == "hang":
            child = subprocess.Popen(["sleep", "60"])
            Path(os.environ["FAKE_RKNN_CHILD"]).write_text(str(child.pid))
            time.sleep(60)
        samples = []
        if do_quantization:
            if dataset is None:
                return -1
            for line in Path(dataset).read_text().splitlines():
                arrays = [np.load(name) for name in line.split()]
                for array, shape in zip(arrays, self.shapes, strict=True):
                    if list(array.shape) not in (shape, shape[1:]):
                        print(f"E build: shape {array.shape} is wrong, expect {shape}")
                        return -1
                samples.append([float(array.sum()) for array in arrays])
        self._record("build", do_quantization=do_quantization, dataset=dataset, samples=samples)
        self.built = True
        return 0

    def export_rknn(self, export_path: str) -> int:
        self._record("export_rknn", export_path=export_path)
        if not self.built:
            return -1
        if os.environ.get("FAKE_RKNN_MODE") != "no_export":
            Path(export_path).write_bytes(b"RKNN fake model")
        return 0

    def init_runtime(self, target: str | None = None, **args: Any) -> int:
        self._record("init_runtime", target=target, **args)
        self.running = self.built
        return 0 if self.running else -1

    def inference(self, inputs: list[np.ndarray],
                  data_format: list[str] | str | None = None) -> list[np.ndarray]:
        self._record("inference", shapes=[list(x.shape) for x in inputs],
                     data_format=data_format)
        formats = data_format if isinstance(data_format, list) else [data_format] * len(inputs)
        for x, shape, layout in zip(inputs, self.shapes, formats, strict=True):
            taken = list(x.shape) if x.ndim != 4 or layout == "nchw" else \
                [x.shape[0], x.shape[3], x.shape[1], x.shape[2]]
            if taken != shape:
                raise RuntimeError(f"Set inputs failed: {list(x.shape)} taken as "
                                   f"{layout or 'nhwc'} is {taken}, not {shape}")
        total = sum(float(x.sum()) for x in inputs)
        return [np.array([[total]], np.float32), inputs[0].reshape(1, -1).astype(np.float32)]

    def release(self) -> None:
        log = os.environ.get("FAKE_RKNN_LOG")
        if log:
            Path(log).write_text(json.dumps(self.calls))
