"""The rknn converter's side of ``edge-agent model build --target rknn:<soc>``.

Run by file path with the isolated converter venv's python (scripts/setup_rknn_converter.sh;
CPython 3.9 to 3.12), never imported by the agent: rknn-toolkit2 pins numpy, onnx, protobuf
and torch to versions the agent's venv cannot hold, so this file imports only the standard
library, numpy and rknn.api.

Protocol (agent/modelbuild/rknn.py is the other side): one JSON request on stdin; JSON lines
on stdout, ``{"progress": "..."}`` any number of times, then ``{"result": {...}}`` (exit 0) or
``{"error": "...", "step": "..."}`` (exit 1). Everything else, the toolkit's own log
included, goes to stderr.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
import traceback
from pathlib import Path
from typing import IO, Any

import numpy as np

PROTOCOL = 1
SETUP = "scripts/setup_rknn_converter.sh"


class Failed(Exception):
    """A step the toolkit refused; the message says which call and what it returned."""

    def __init__(self, step: str, message: str) -> None:
        super().__init__(message)
        self.step = step


def protocol_stream() -> IO[str]:
    """A private copy of stdout, with fd 1 pointed at stderr: the toolkit prints its log to
    stdout (from Python and from C), which would break the JSON lines the agent reads."""
    sys.stdout.flush()
    private = os.dup(1)
    os.dup2(2, 1)
    return os.fdopen(private, "w", buffering=1)


def toolkit_version(rknn_package: Any) -> str:
    try:
        return importlib.metadata.version("rknn-toolkit2")
    except importlib.metadata.PackageNotFoundError:
        version_file = Path(rknn_package.__file__).parent / "VERSION"
        return version_file.read_text().strip() if version_file.is_file() else "unknown"


def checked(step: str, returned: Any) -> None:
    """The toolkit reports failure by returning -1 (after logging why to stdout), not by
    raising."""
    if returned != 0:
        raise Failed(step, f"rknn.{step}() returned {returned} (its log is on stderr)")


def summary(exc: Exception) -> str:
    """One line for the user. The toolkit raises (instead of returning -1) on some errors with
    a whole traceback as the message, whose last line is the cause; the traceback itself is
    on stderr."""
    text = str(exc).strip()
    if "Traceback (most recent call last):" in text:
        text = text.splitlines()[-1].strip()
    else:
        text = f"{type(exc).__name__}: {' '.join(text.split())}"
    return text[:500]


class Conversion:
    """One request: ONNX -> .rknn, then the held-out inputs through the simulator."""

    def __init__(self, request: dict[str, Any], out: IO[str]) -> None:
        self.request = request
        self.out = out
        self.step = "request"

    def stage(self, step: str, message: str) -> None:
        self.step = step
        self.out.write(json.dumps({"progress": message}) + "\n")

    def run(self) -> dict[str, Any]:
        self.step = "import"
        try:
            import rknn
            from rknn.api import RKNN
        except ImportError as exc:
            raise Failed("import", f"rknn-toolkit2 is not importable by {sys.executable} "
                                   f"({exc}); set the converter up with {SETUP}") from exc
        version = toolkit_version(rknn)
        toolkit = RKNN(verbose=False)
        try:
            self.build(toolkit, version)
            outputs = self.simulate(toolkit)
        finally:
            toolkit.release()
        return {"toolkit_version": version, "outputs": outputs}

    def build(self, toolkit: Any, version: str) -> None:
        request = self.request
        int8 = request["precision"] == "int8"
        self.stage("config", f"rknn-toolkit2 {version}: configuring for {request['platform']}")
        # No mean/std: the agent feeds already preprocessed float32, as ONNX Runtime gets them.
        # w8a8 per-channel with the plain min/max calibration: the toolkit's default for int8.
        checked("config", toolkit.config(target_platform=request["platform"],
                                         quantized_dtype="w8a8", quantized_algorithm="normal",
                                         quantized_method="channel", optimization_level=3))
        self.stage("load_onnx", f"loading {Path(request['source']).name}")
        # Names and shapes always given (the toolkit refuses a symbolic dimension otherwise,
        # and warns about "cropping" when they are given): a dynamic batch is fixed to 1, and
        # the inference inputs below follow this order.
        names = [spec["name"] for spec in request["inputs"]]
        shapes = [spec["shape"] for spec in request["inputs"]]
        checked("load_onnx", toolkit.load_onnx(model=request["source"], inputs=names,
                                               input_size_list=shapes))
        if int8:
            self.stage("build", f"quantizing int8 on {request['calibration_samples']} "
                                "calibration samples")
        else:
            self.stage("build", "building fp16")
        checked("build", toolkit.build(do_quantization=int8,
                                       dataset=request["dataset"] if int8 else None))
        self.stage("export_rknn", f"writing {Path(request['model']).name}")
        checked("export_rknn", toolkit.export_rknn(request["model"]))

    def simulate(self, toolkit: Any) -> list[list[str]]:
        """Outputs for each held-out feed, written as .npy. The simulator runs the model
        built in this process (init_runtime without a target), not a loaded .rknn."""
        heldout: list[list[str]] = self.request["heldout"]
        self.stage("init_runtime", "starting the rknn simulator")
        checked("init_runtime", toolkit.init_runtime())
        self.stage("inference", f"running {len(heldout)} held-out inputs on the simulator")
        out_dir = Path(self.request["outputs_dir"])
        written = []
        for index, files in enumerate(heldout):
            arrays = [np.load(name, allow_pickle=False) for name in files]
            samples = self.per_sample(toolkit, arrays)
            outputs = [np.concatenate([sample[position] for sample in samples], axis=0)
                       for position in range(len(samples[0]))]
            paths = []
            for position, output in enumerate(outputs):
                path = out_dir / f"{index:04d}-{position:02d}.npy"
                np.save(path, np.asarray(output), allow_pickle=False)
                paths.append(str(path))
            written.append(paths)
        return written

    def per_sample(self, toolkit: Any, arrays: list[np.ndarray]) -> list[list[np.ndarray]]:
        """The model is built for batch 1, so a batch runs one sample at a time."""
        # 'nchw' says the arrays are laid out as the ONNX model takes them; the toolkit's
        # default, 'nhwc', would transpose a 4-D input (it is ignored for other ranks).
        formats = ["nchw"] * len(arrays)
        results = []
        for sample in range(arrays[0].shape[0]):
            inputs = [array[sample:sample + 1] for array in arrays]
            outputs = toolkit.inference(inputs=inputs, data_format=formats)
            if outputs is None:
                raise Failed("inference", "rknn.inference() returned None (its log is on stderr)")
            results.append([np.asarray(output) for output in outputs])
        return results


def main() -> int:
    out = protocol_stream()
    conversion = Conversion({}, out)
    try:
        request = json.load(sys.stdin)
        if request.get("protocol") != PROTOCOL:
            raise Failed("request", f"protocol {request.get('protocol')!r} is not {PROTOCOL}")
        conversion.request = request
        result = conversion.run()
    except Failed as exc:
        out.write(json.dumps({"error": str(exc), "step": exc.step}) + "\n")
        return 1
    except SystemExit as exc:  # the toolkit exits on some errors instead of returning -1
        out.write(json.dumps({"error": f"the toolkit exited with {exc.code}",
                              "step": conversion.step}) + "\n")
        return 1
    except Exception as exc:
        traceback.print_exc()
        out.write(json.dumps({"error": summary(exc), "step": conversion.step}) + "\n")
        return 1
    out.write(json.dumps({"result": result}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
