"""The RKNN backend: a ``.rknn`` model on a Rockchip NPU through rknn-toolkit-lite2.

``RKNNLite`` reports failure by return value, not exception: ``load_rknn`` and
``init_runtime`` return 0 or -1, ``inference`` returns None; each is checked and turned into
a SessionError (at load) or a RuntimeError (per run) naming the model and the call.
rknn-toolkit-lite2 has aarch64 wheels only, so ``rknnlite`` is imported when a model is
loaded, never at import time.

The served contract (input names, types, NCHW shapes) is the ONNX model the .rknn was
converted from, beside it in the version directory; 4-D inputs are handed over with
``data_format="nchw"`` (RKNNLite's default is NHWC) and batches larger than the .rknn's
are run row by row.

RKNNLite has no way to cancel an inference: a run past its deadline stops before its next
row (``Terminate``), but a row already on the NPU finishes in its own time.  The requests
are answered DEADLINE_EXCEEDED at the deadline all the same; the run is left to finish.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from agent.inference.backends import TensorInfo, Terminate
from agent.inference.backends.rknn_file import (
    RknnFileError,
    parse_rknn,
    skew,
)
from agent.inference.devices import Device, core_mask
from agent.inference.errors import SessionError, model_error

ONNX_SIBLING = "model.onnx"


def _import_rknnlite() -> Any:
    try:
        from rknnlite.api import RKNNLite
    except ImportError as error:
        raise SessionError("the RKNN backend needs rknn-toolkit-lite2 (Rockchip's aarch64 "
                           f"wheel, with librknnrt) and it is not installed: {error}") from None
    return RKNNLite


def onnx_contract(path: Path) -> tuple[list[TensorInfo], list[TensorInfo]]:
    """Inputs and outputs of the ONNX model beside ``path`` (what it was converted from)."""
    source = path.with_name(ONNX_SIBLING)
    if not source.is_file():
        raise model_error(path, f"needs {source.name} beside it (the model it was converted "
                          "from): its inputs and outputs are the served contract")
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        session = ort.InferenceSession(str(source), options,
                                       providers=["CPUExecutionProvider"])
    except Exception as error:
        raise model_error(source, f"cannot be read for its inputs and outputs: {error}") \
            from None
    described = ([TensorInfo(a.name, a.type, list(a.shape)) for a in args]
                 for args in (session.get_inputs(), session.get_outputs()))
    return next(described), next(described)


class RknnBackend:
    kind = "rknn"
    intra_op = 0

    def __init__(self, path: Path, device: Device, precision: str, runtime: Any,
                 inputs: Sequence[TensorInfo], outputs: Sequence[TensorInfo],
                 versions: tuple[str | None, str | None]) -> None:
        self.path, self.runtime = path, runtime
        self.device, self.precision = str(device), precision
        self.mask = core_mask(device)
        self.providers = [self.kind]
        self.inputs, self.outputs = list(inputs), list(outputs)
        self.toolkit_version, self.runtime_version = versions
        self._formats = ["nchw" if len(spec.shape) == 4 else "nhwc" for spec in self.inputs]
        self._lock = threading.Lock()  # the probe and the worker share one context
        self._closed = False

    def get_inputs(self) -> Sequence[TensorInfo]:
        return self.inputs

    def get_outputs(self) -> Sequence[TensorInfo]:
        return self.outputs

    def run_options(self) -> Terminate:
        return Terminate()

    def run(self, names: Sequence[str], feeds: Mapping[str, Any],
            run_options: Terminate | None = None) -> list[Any]:
        arrays = [np.ascontiguousarray(feeds[spec.name]) for spec in self.inputs]
        rows = int(arrays[0].shape[0]) if arrays and arrays[0].ndim else 1
        if rows > 1 and all(a.ndim and a.shape[0] == rows for a in arrays):
            parts = []
            for i in range(rows):
                if run_options is not None and run_options.terminate:
                    raise RuntimeError(f"{self.path}: the run was cancelled after {i} of "
                                       f"{rows} rows")
                parts.append(self._infer([a[i:i + 1] for a in arrays]))
            results = [np.concatenate(column) for column in zip(*parts, strict=True)]
        else:
            results = self._infer(arrays)
        by_name = dict(zip((spec.name for spec in self.outputs), results, strict=False))
        missing = [name for name in names if name not in by_name]
        if missing:
            raise RuntimeError(f"{self.path}: RKNN returned {len(results)} outputs, "
                               f"missing {missing}")
        return [by_name[name] for name in names]

    def _infer(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.path}: the RKNN context was released")
            outputs = self.runtime.inference(inputs=arrays, data_format=self._formats)
        if outputs is None:
            raise RuntimeError(f"{self.path}: RKNNLite.inference failed on {self.device} "
                               "(it returned None; librknnrt's log says why)")
        return [np.asarray(output) for output in outputs]

    def describe(self) -> dict[str, Any]:
        return {"backend": self.kind, "device": self.device, "precision": self.precision,
                "providers": list(self.providers), "core_mask": self.mask,
                "toolkit": self.toolkit_version, "librknnrt": self.runtime_version}

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self.runtime.release()


def load(path: Path, device: Device, precision: str, *,
         runtime_version: str | None = None) -> RknnBackend:
    """Check the model against librknnrt, then load it on ``device``'s cores.  Every step
    that fails raises SessionError naming the file; nothing is left initialised."""
    try:
        info = parse_rknn(path.read_bytes())
    except OSError as error:
        raise model_error(path, f"cannot read it: {error.strerror or error}") from None
    except RknnFileError as error:
        raise model_error(path, f"not an RKNN model: it {error}") from None
    runtime = runtime_version  # discovery read it (topology.runtimes.librknnrt)
    refused = skew(info.toolkit_version, runtime)
    if refused:
        raise model_error(path, f"refused: {refused}")
    inputs, outputs = onnx_contract(path)
    lite = _import_rknnlite()()
    if lite.load_rknn(str(path)) != 0:
        lite.release()
        raise model_error(path, "RKNNLite.load_rknn failed (returned -1)")
    mask = core_mask(device)
    if lite.init_runtime(core_mask=mask) != 0:
        lite.release()
        raise model_error(path, f"RKNNLite.init_runtime(core_mask={mask}) failed for "
                          f"{device} (returned -1; toolkit {info.toolkit_version or '?'}, "
                          f"librknnrt {runtime or '?'})")
    return RknnBackend(path, device, precision, lite, inputs, outputs,
                       (info.toolkit_version, runtime))
