"""An MLServer runtime serving one ONNX file with ONNX Runtime (MLServer has none built in).

Runs inside MLServer's own venv, not the project's. model-settings.json names it as
``mlserver_onnx.OnnxModel`` with ``parameters.uri`` the .onnx file and
``parameters.extra.threads`` the intra-op threads; with ``max_batch_size`` above 1 MLServer's
adaptive batcher hands ``predict`` the requests already joined along the first dimension.
The run goes to a thread, so that the event loop decodes the next requests meanwhile.
"""

from __future__ import annotations

import asyncio

import numpy as np
import onnxruntime as ort
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse


class OnnxModel(MLModel):
    async def load(self) -> bool:
        parameters = self.settings.parameters
        if parameters is None or not parameters.uri:
            raise ValueError(f"{self.name}: model-settings.json needs parameters.uri (the .onnx)")
        options = ort.SessionOptions()
        options.intra_op_num_threads = int((parameters.extra or {})["threads"])
        options.inter_op_num_threads = 1
        self._session = ort.InferenceSession(parameters.uri, options,
                                             providers=["CPUExecutionProvider"])
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        feeds = {given.name: NumpyCodec.decode_input(given).astype(np.float32, copy=False)
                 for given in payload.inputs}
        results = await asyncio.to_thread(self._session.run, None, feeds)
        outputs = [NumpyCodec.encode_output(meta.name, value)
                   for meta, value in zip(self._session.get_outputs(), results, strict=True)]
        return InferenceResponse(model_name=self.name, outputs=outputs)
