"""A fake ``rknnlite.api.RKNNLite`` that keeps the real one's contract: every call returns
0 or -1 (``inference``: a list of arrays or None) instead of raising, core masks are the
NPU_CORE_* bit values, and inputs are taken as NHWC unless ``data_format`` says otherwise.

It "runs" a model by running the ONNX model beside the .rknn (``model.onnx``) with ONNX
Runtime, after turning NHWC inputs into that model's NCHW: a backend that forgets to pass
``data_format="nchw"`` gets different numbers.  Tests steer failures through class
attributes and read what was called from ``RKNNLite.made``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import numpy as np


class RKNNLite:
    NPU_CORE_AUTO = 0
    NPU_CORE_0 = 1
    NPU_CORE_1 = 2
    NPU_CORE_2 = 4
    NPU_CORE_0_1 = 3
    NPU_CORE_0_1_2 = 7
    NPU_CORE_ALL = 0xFFFF
    MASKS: ClassVar[set[int]] = {0, 1, 2, 4, 3, 7, 0xFFFF}

    made: ClassVar[list[RKNNLite]] = []
    fail_init: ClassVar[bool] = False
    fail_inference: ClassVar[bool] = False

    def __init__(self, verbose: bool = False, verbose_file: str | None = None) -> None:
        self.path: Path | None = None
        self.core_mask: int | None = None
        self.released = False
        self.calls: list[tuple[list[tuple[int, ...]], Any]] = []
        self._session: Any = None
        RKNNLite.made.append(self)

    def load_rknn(self, path: str) -> int:
        try:
            data = Path(path).read_bytes()
        except OSError:
            return -1
        if data[:4] != b"RKNN":
            return -1
        self.path = Path(path)
        return 0

    def init_runtime(self, core_mask: int = NPU_CORE_AUTO, **_: Any) -> int:
        if self.path is None or core_mask not in self.MASKS or RKNNLite.fail_init:
            return -1
        import onnxruntime as ort

        self._session = ort.InferenceSession(str(self.path.with_name("model.onnx")),
                                             providers=["CPUExecutionProvider"])
        self.core_mask = core_mask
        return 0

    def inference(self, inputs: list[np.ndarray], data_type: Any = None,
                  data_format: Any = None, **_: Any) -> list[np.ndarray] | None:
        if self._session is None or self.released or RKNNLite.fail_inference:
            return None
        formats = data_format if isinstance(data_format, list) else [data_format] * len(inputs)
        self.calls.append(([tuple(a.shape) for a in inputs], data_format))
        feeds = {}
        for spec, array, layout in zip(self._session.get_inputs(), inputs, formats,
                                       strict=False):
            if array.ndim == 4 and (layout or "nhwc") == "nhwc":
                array = array.transpose(0, 3, 1, 2)  # what the NPU would be handed
            if tuple(array.shape[1:]) != tuple(spec.shape[1:]):
                return None  # the real runtime logs and returns None on a shape it lacks
            feeds[spec.name] = np.ascontiguousarray(array)
        return list(self._session.run(None, feeds))

    def release(self) -> None:
        self.released = True
        self._session = None
