"""``build-model``: build a model on this node with agent.modelbuild's core and install it
through the data plane's canary.  A build runs for minutes, so it is a job beside the
command worker (agent.control.running): ``ping`` and the other commands go on meanwhile,
and a second build is answered ``busy``.

The handler checks at once what it can: the source (an ``.onnx`` file) and the calibration
directory under the model directories as set-model checks them, a target this node runs,
a data plane ready to load, the guard.  The job then builds into a work directory under
``<state_dir>/builds`` (removed whatever happens), sends each step the core reports as
progress, and, when the report passed, installs model.onnx, a model.rknn beside it and
build.json as the next version exactly as set-model installs a file.  A failed gate is
``gate_failed`` with the report; nothing is installed.  A stop cancels the build at its
next step and never installs it.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.control.controller import CommandFailed, Progress
from agent.control.running import Job
from agent.modelbuild.report import MODEL_FILE, REPORT_FILE, RKNN_FILE
from agent.service import builds

if TYPE_CHECKING:
    from agent.service.collaborators import Collaborators

logger = logging.getLogger(__name__)

SLOT = "build"  # one build at a time
BUILDS_DIR = "builds"
WORKDIR_PREFIX = "job-"
MAX_STEP_CHARS = 200


def build_model(parts: Collaborators, args: dict[str, Any],
                guard: dict[str, Any]) -> Job:
    """Check what can be checked now (failing the command at once), then the build job."""
    spec = _spec(parts, args)
    inference = parts.inference
    runnable = builds.runnable_targets(parts.topology(), inference.available)
    if spec.target not in runnable:
        raise CommandFailed("bad_args", f"target {spec.target}: this node runs "
                            f"{', '.join(runnable)} (a model built for another target "
                            "could not serve here)")
    if not inference.enabled or not inference.supervisor.ready:
        raise CommandFailed("model_rejected", "the data plane is not ready: "
                            + ("; ".join(inference.problems()) or "inference is disabled"))
    canary = builds.canary_of(guard)

    def run(progress: Progress, cancel: threading.Event) -> dict[str, Any]:
        return _build_and_install(parts, spec, canary, progress, cancel)

    return Job(SLOT, run)


def _spec(parts: Collaborators, args: dict[str, Any]) -> builds.BuildSpec:
    source = Path(args["source"])
    if not parts.model_allowed(source):
        raise CommandFailed("not_allowed", f"{source} is outside the model directories "
                            "(control.model_dirs, <state_dir>/models)")
    if source.suffix != ".onnx":
        raise CommandFailed("bad_args", f"source {source}: expected an .onnx file")
    if not source.is_file():
        raise CommandFailed("model_rejected", f"source {source}: no such file")
    calibration = Path(args["calibration"]) if "calibration" in args else None
    if calibration is not None:
        if not parts.model_allowed(calibration):
            raise CommandFailed("not_allowed", f"calibration {calibration} is outside the "
                                "model directories (control.model_dirs, <state_dir>/models)")
        if not calibration.is_dir():
            raise CommandFailed("bad_args", f"calibration {calibration}: not a directory "
                                "(of .npy input batches or images)")
    return builds.BuildSpec(source=source, name=args.get("name") or parts.inference.default,
                            target=args.get("target", "cpu"),
                            precision=args.get("precision", "int8"), calibration=calibration,
                            gate=dict(args.get("gate", {})),
                            preprocess=dict(args.get("preprocess", {})),
                            rknn_python=parts.rknn_python)


def _build_and_install(parts: Collaborators, spec: builds.BuildSpec, canary: dict[str, Any],
                       progress: Progress, cancel: threading.Event) -> dict[str, Any]:
    from agent.service.inference import InstallFailed

    def step(text: str) -> None:
        progress(str(text)[:MAX_STEP_CHARS])

    workdir = _workdir(parts.state_dir / BUILDS_DIR)
    try:
        step(f"building {spec.name} for {spec.target} ({spec.precision})")
        report = parts.builder(spec, workdir, step, cancel)
        summary = report.to_dict()
        if not report.passed:
            why = report.reason or "the gate refused every variant"
            raise CommandFailed("gate_failed", f"{spec.name}: {why}; nothing installed",
                                {"report": summary})
        step("installing")  # the last point a stop cancels at: it never half-installs
        extras = {REPORT_FILE: workdir / REPORT_FILE}  # the builder wrote it (Builder)
        if (workdir / RKNN_FILE).is_file():
            extras[RKNN_FILE] = workdir / RKNN_FILE
        try:
            installed = parts.inference.install(workdir / MODEL_FILE, None, spec.name,
                                                canary, extras, temporary=True)
        except InstallFailed as failure:
            raise CommandFailed(failure.code, str(failure),
                                {"report": summary, "model": parts.inference.model_path}) \
                from None
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    parts.link().rebirth()  # birth lists the served models
    return {**installed, "canary": "passed", "build": builds.figures(summary),
            "report": summary}


def _workdir(directory: Path) -> Path:
    """A fresh work directory; those an earlier agent left (it stopped or died in a build:
    builds run one at a time, so none is in use) are removed first."""
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob(f"{WORKDIR_PREFIX}*"):
        logger.warning("%s: left by a build that did not finish; removed", stale)
        shutil.rmtree(stale, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=WORKDIR_PREFIX, dir=directory))
