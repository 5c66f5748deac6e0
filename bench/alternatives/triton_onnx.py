"""A Triton python-backend model (``model.py``) that serves one ONNX file with ONNX Runtime.

Triton's own server (``tritonserver`` from the nvidia-pytriton wheel) has no ONNX Runtime
backend in that wheel, only the python backend: this is the smallest model that gives it
the same session as edge-agent's (same file, same intra-op threads), so the bench compares
the servers, not the runtimes.  ``execute`` takes whatever batch Triton's dynamic batcher
formed, runs it once and splits the rows back per request.  Config parameters: ``onnx``
(the file), ``threads`` (intra-op threads).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import onnxruntime as ort
import triton_python_backend_utils as pb_utils  # provided by the python backend's stub


class TritonPythonModel:
    def initialize(self, args: dict[str, Any]) -> None:
        parameters = json.loads(args["model_config"])["parameters"]
        options = ort.SessionOptions()
        options.intra_op_num_threads = int(parameters["threads"]["string_value"])
        options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(parameters["onnx"]["string_value"], options,
                                            providers=["CPUExecutionProvider"])
        self.input = self.session.get_inputs()[0].name
        self.outputs = [output.name for output in self.session.get_outputs()]

    def execute(self, requests: list[Any]) -> list[Any]:
        arrays = [pb_utils.get_input_tensor_by_name(request, self.input).as_numpy()
                  for request in requests]
        batch = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
        results = self.session.run(self.outputs, {self.input: batch})
        responses, start = [], 0
        for array in arrays:
            rows = slice(start, start + array.shape[0])
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor(name, result[rows]) for name, result in
                 zip(self.outputs, results, strict=True)]))
            start += array.shape[0]
        return responses
