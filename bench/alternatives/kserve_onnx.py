"""A KServe model server holding one ONNX file under several names, with ONNX Runtime.

Runs inside KServe's own venv, not the project's: ``python kserve_onnx.py --onnx FILE
--threads N --names single --threaded-names real --http_port P --grpc_port Q`` (the last two,
and any other flag, are KServe's ModelServer's own). The Python server has no adaptive
batching (KServe batches in its Kubernetes sidecar), so every name serves one request per run.
``--names`` get a plain ``def predict``, as KServe's examples write it: the run happens on the
event loop, one request at a time, no thread hop (its best at concurrency 1).
``--threaded-names`` hand the run to a thread, so that the loop decodes the next requests
meanwhile and runs overlap (more requests per second at concurrency 16 here, a hop more each).
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import onnxruntime as ort
from kserve import InferOutput, InferRequest, InferResponse, Model, ModelServer


class OnnxModel(Model):
    def __init__(self, name: str, onnx: str, threads: int) -> None:
        super().__init__(name)
        self.onnx, self.threads = onnx, threads
        self.load()

    def load(self) -> bool:
        options = ort.SessionOptions()
        options.intra_op_num_threads = self.threads
        options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(self.onnx, options,
                                            providers=["CPUExecutionProvider"])
        self.ready = True
        return self.ready

    def predict(self, payload: InferRequest,
                headers: dict[str, str] | None = None) -> InferResponse:
        feeds = {given.name: given.as_numpy() for given in payload.inputs}
        return self.respond(payload, self.session.run(None, feeds))

    def respond(self, payload: InferRequest, results: list[Any]) -> InferResponse:
        outputs = []
        for meta, value in zip(self.session.get_outputs(), results, strict=True):
            output = InferOutput(meta.name, list(value.shape), "FP32")
            output.set_data_from_numpy(value)
            outputs.append(output)
        return InferResponse(payload.id or "", self.name, outputs)


class ThreadedOnnxModel(OnnxModel):
    async def predict(self, payload: InferRequest,  # type: ignore[override]
                      headers: dict[str, str] | None = None) -> InferResponse:
        feeds = {given.name: given.as_numpy() for given in payload.inputs}
        return self.respond(payload, await asyncio.to_thread(self.session.run, None, feeds))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--onnx", required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--names", default="", help="comma-separated, predict on the loop")
    parser.add_argument("--threaded-names", default="", help="comma-separated, in a thread")
    ours, _ = parser.parse_known_args()  # ModelServer parses the rest from sys.argv itself
    ModelServer().start(
        [OnnxModel(name, ours.onnx, ours.threads) for name in ours.names.split(",") if name]
        + [ThreadedOnnxModel(name, ours.onnx, ours.threads)
           for name in ours.threaded_names.split(",") if name])
