"""One build, start to end: check the request, read the inputs, run the original, make each
candidate in turn, judge it by the gate, stop at the first that passes, and write the chosen
file with ``build.json`` into a working directory.  Installing is a separate step
(``install``) so that the fleet command can go through the data plane's canary instead."""

from __future__ import annotations

import functools
import os
import platform
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from agent.inference.errors import SessionError
from agent.inference.session import build_session
from agent.modelbuild import inputs as input_files
from agent.modelbuild import quantize, targets, variants
from agent.modelbuild.compare import agreement
from agent.modelbuild.measure import Measure, PeakMemory, interleaved
from agent.modelbuild.report import MODEL_FILE, RKNN_FILE, BuildReport, Tried
from agent.modelbuild.request import BuildError, BuildRequest, Feed, Progress, check_target
from agent.serving.versions import file_sha256

MAX_SOURCE_BYTES = 2 << 30  # ONNX's protobuf limit; larger models keep external data


def _source(request: BuildRequest) -> int:
    path = request.source
    if path.suffix.lower() != ".onnx":
        raise BuildError(f"{path}: a build starts from an ONNX model (.onnx)")
    try:
        size = path.stat().st_size
    except OSError as error:
        raise BuildError(f"{path}: {error.strerror or error}") from None
    if not path.is_file() or size > MAX_SOURCE_BYTES:
        raise BuildError(f"{path}: not a regular file of at most {MAX_SOURCE_BYTES} bytes")
    return size


def session(path: Path, providers: Sequence[Any]) -> ort.InferenceSession:
    """One single-threaded session, built as the data plane builds its sessions (no graph
    cache): the original and every candidate are run alike."""
    try:
        return build_session(path, providers=providers, intra_op=1, inter_op=1,
                             cache_dir=None).session
    except SessionError as error:  # the file's fault, or a provider this build lacks
        raise BuildError(f"{path}: ONNX Runtime cannot load it ({error})") from None


def run_all(model: ort.InferenceSession, feeds: Sequence[Feed]) -> list[list[np.ndarray]]:
    return [[np.asarray(o) for o in model.run(None, feed)] for feed in feeds]


def build_candidate(request: BuildRequest, workdir: Path,
                    progress: Progress = lambda step: None,
                    measure: Measure | None = None) -> BuildReport:
    """Build ``request`` in ``workdir`` (which must exist and be empty); the report says
    whether the file it chose may be installed.  BuildError for what the user caused."""
    peak = PeakMemory()
    check_target(request.target, request.precision)
    size = _source(request)
    if request.calibration is None:
        raise BuildError("--calibration DIR is needed: its inputs calibrate INT8 and are "
                         "the held-out inputs the gate compares on")
    plan = targets.plan(request)
    converter = _converter(request)  # a converter that is not set up fails before any work
    progress("reading the original model")
    original = session(request.source, plan.providers)
    specs = [input_files.InputSpec.of(i) for i in original.get_inputs()]
    progress(f"reading the inputs in {request.calibration}")
    data = input_files.load(request.calibration, specs, request.preprocess)
    report = BuildReport(request, file_sha256(request.source), size, _tools(),
                         plan.measured_with, plan.speed_note,
                         {"calibration": len(data.calibration), "heldout": len(data.heldout)})
    progress(f"running the original on {len(data.heldout)} held-out inputs")
    expected = run_all(original, data.heldout)
    judge = _Judge(request, report, original, expected, data.heldout,
                   (measure or interleaved) if plan.speed_note is None else None, progress)
    if converter is not None:
        _rknn(request, workdir, data, judge, converter)
    elif request.precision == "fp16":
        judge.onnx(Tried("fp16", {"io_types": "float32"}), workdir / MODEL_FILE,
                   lambda out: quantize.to_fp16(request.source, out), plan.providers)
    else:
        progress("preparing the model for quantization")
        prepared = quantize.prepare(request.source, workdir)
        for variant in variants.for_target(request.target):
            candidate = workdir / f"{variant.name}.onnx"
            make = functools.partial(quantize.quantize, prepared, variant=variant,
                                     calibration=data.calibration)
            if judge.onnx(Tried(variant.name, variant.settings()), candidate, make,
                          plan.providers):
                os.replace(candidate, workdir / MODEL_FILE)
                break
    _finish(report, workdir)
    report.peak_rss_mb = peak.mb()
    report.write(workdir)
    return report


class _Judge:
    """Runs a candidate on the held-out inputs and decides its verdict by the gate."""

    def __init__(self, request: BuildRequest, report: BuildReport,
                 original: ort.InferenceSession, expected: list[list[np.ndarray]],
                 heldout: Sequence[Feed], measure: Measure | None, progress: Progress) -> None:
        self.request, self.report, self.original = request, report, original
        self.expected, self.heldout = expected, heldout
        self.measure, self.progress = measure, progress

    def onnx(self, tried: Tried, output: Path, make: Callable[[Path], None],
             providers: Sequence[Any]) -> bool:
        self.report.tried.append(tried)
        self.progress(f"building {tried.name}")
        try:
            make(output)
            tried.size_bytes = output.stat().st_size
            built = session(output, providers)
            self.progress(f"checking {tried.name} on the held-out inputs")
            outputs = run_all(built, self.heldout)
        except quantize.NothingQuantized as pointless:
            tried.reason = str(pointless)
            return False
        except BuildError as error:
            tried.verdict, tried.reason = "failed", str(error)
            return False
        return self.verdict(tried, outputs, built)

    def verdict(self, tried: Tried, outputs: list[list[np.ndarray]],
                built: ort.InferenceSession | None) -> bool:
        gate = self.request.gate
        tried.agreement = found = agreement(self.expected, outputs)
        if found.top1 is not None and found.top1 < gate.top1:
            tried.reason = f"top-1 agreement {found.top1:.3f} is below {gate.top1:g}"
        elif found.cosine_mean < gate.cosine:
            tried.reason = f"cosine {found.cosine_mean:.4f} is below {gate.cosine:g}"
        elif self.measure is not None and built is not None and gate.speed > 0:
            self.progress(f"timing {tried.name} against the original")
            tried.speed_ratio = self.measure(self.original, built, self.heldout[0])
            if tried.speed_ratio < gate.speed:
                tried.reason = (f"{tried.speed_ratio:.2f}x the original's speed, below "
                                f"{gate.speed:g}x: not faster here")
        if tried.reason:
            return False
        tried.verdict = "passed"
        return True


def _converter(request: BuildRequest) -> Path | None:
    """The .rknn converter's python for an rknn target (None for the ONNX targets)."""
    if not request.rknn_platform:
        return None
    import agent.modelbuild.rknn as rknn

    return rknn.converter_python(request.rknn_python)


def _rknn(request: BuildRequest, workdir: Path, data: input_files.Inputs,
          judge: _Judge, python: Path) -> None:
    import agent.modelbuild.rknn as rknn

    tried = Tried(f"rknn-{request.rknn_platform}-{request.precision}",
                  {"platform": request.rknn_platform, "precision": request.precision})
    judge.report.tried.append(tried)
    try:
        converted = rknn.convert(request.source, workdir, str(request.rknn_platform),
                                 request.precision, data.calibration, data.heldout, python,
                                 rknn.TIMEOUT_S, judge.progress)
    except BuildError as error:
        tried.verdict, tried.reason = "failed", str(error)
        return
    judge.report.tools["rknn-toolkit2"] = converted.toolkit_version
    tried.size_bytes = converted.model.stat().st_size
    if judge.verdict(tried, converted.outputs, None):
        if converted.model != workdir / RKNN_FILE:
            os.replace(converted.model, workdir / RKNN_FILE)
        shutil.copyfile(request.source, workdir / MODEL_FILE)  # the backend reads its I/O


def _finish(report: BuildReport, workdir: Path) -> None:
    """The verdict of the whole build, and the working directory left with the chosen file
    only (candidates and the prepared copy go)."""
    chosen = next((t for t in report.tried if t.verdict == "passed"), None)
    keep = {MODEL_FILE, RKNN_FILE} if chosen is not None else set()
    for path in workdir.iterdir():
        if path.name not in keep:
            path.unlink() if not path.is_dir() else shutil.rmtree(path, ignore_errors=True)
    if chosen is None:
        tried = "; ".join(f"{t.name}: {t.reason}" for t in report.tried)
        report.reason = f"the original stays; no build passed the gate ({tried})"
        return
    report.passed, report.chosen = True, chosen.name
    report.model_file = workdir / (RKNN_FILE if report.request.rknn_platform else MODEL_FILE)
    ratio = "" if chosen.speed_ratio is None else f", {chosen.speed_ratio:.2f}x the original"
    report.reason = f"{chosen.name} passed the gate{ratio}"


def _tools() -> dict[str, str]:
    return {"onnxruntime": ort.__version__, "onnx": onnx.__version__,
            "machine": variants.machine(), "python": platform.python_version()}
