"""Built models as the service sees them: the build core (agent.modelbuild) as the
``build-model`` job calls it, the targets this node runs, and the ``build.json`` report
beside a model file that ``set-model`` installs (a model built elsewhere, copied under
``control.model_dirs``).

What a report must say for the node to judge it: ``passed`` (true only when the build met
its gate) and ``target`` (what it was built for: ``cpu``, ``tensorrt``, ``openvino``,
``rknn:<soc>``).  Its gate figures travel in the reply (``FIGURES``).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from agent.control.controller import CommandFailed, Progress
from agent.modelbuild.report import REPORT_FILE, RKNN_FILE
from agent.modelbuild.request import PROVIDERS

if TYPE_CHECKING:
    from agent.discovery.model import Topology

MAX_REPORT_BYTES = 1 << 20  # a build.json is a few kB; a bigger one is not a report
FIGURES = ("passed", "reason", "target", "precision", "gate", "chosen", "measured_with",
           "speed_note", "source")


@dataclass(frozen=True)
class BuildSpec:
    """What one ``build-model`` command asks, its defaults filled in and paths checked."""

    source: Path
    name: str
    target: str = "cpu"
    precision: str = "int8"
    calibration: Path | None = None
    gate: dict[str, float] = field(default_factory=dict)  # keys left out: the core's default
    preprocess: dict[str, Any] = field(default_factory=dict)
    rknn_python: str | None = None  # the converter's interpreter (model_build.rknn_python)


class Report(Protocol):
    """What the job needs of the core's BuildReport."""

    @property
    def passed(self) -> bool: ...

    @property
    def reason(self) -> str: ...

    @property
    def model_file(self) -> Path | None: ...

    def to_dict(self) -> dict[str, Any]: ...


# (spec, work directory, progress, cancel) -> the report; the chosen model and build.json
# are written into the work directory.  ``progress`` raises once the agent is stopping.
Builder = Callable[[BuildSpec, Path, Progress, threading.Event], Report]


def core_builder(spec: BuildSpec, workdir: Path, progress: Progress,
                 cancel: threading.Event) -> Report:
    """agent.modelbuild's ``build_candidate``, imported when a build runs (quantization
    pulls in onnx).  A BuildError (a file, a value the request got wrong) is
    ``build_failed``; ``cancel`` reaches the core through ``progress``."""
    from agent.modelbuild.build import build_candidate
    from agent.modelbuild.request import BuildError, BuildRequest, Gate, Preprocess

    given, default = spec.preprocess, Preprocess()
    preprocess = Preprocess(mean=tuple(given.get("mean", default.mean)),
                            std=tuple(given.get("std", default.std)),
                            order=str(given.get("order", default.order)))
    request = BuildRequest(source=spec.source, name=spec.name, target=spec.target,
                           precision=spec.precision, calibration=spec.calibration,
                           gate=Gate(**spec.gate), preprocess=preprocess,
                           rknn_python=spec.rknn_python)
    try:
        return build_candidate(request, workdir, progress)
    except BuildError as error:
        raise CommandFailed("build_failed", str(error)) from None


def runnable_targets(topology: Topology, available: Sequence[str]) -> list[str]:
    """The build targets this node runs: the CPU, the ONNX Runtime providers installed
    here, and the Rockchip NPU of its own SoC."""
    targets = ["cpu", *(target for target, provider in PROVIDERS.items()
                        if provider in available)]
    if topology.board.family == "rockchip" and topology.board.soc:
        targets.append(f"rknn:{topology.board.soc}")
    return targets


def read_report(model: Path) -> dict[str, Any] | None:
    """The build.json beside ``model``, None when there is none; one that cannot be read
    is ``model_rejected`` (a model whose report is unreadable is not judged blind)."""
    path = model.parent / REPORT_FILE
    try:
        if not path.exists():
            return None
        with open(path, "rb") as handle:
            data = handle.read(MAX_REPORT_BYTES + 1)
        if len(data) > MAX_REPORT_BYTES:
            raise ValueError(f"over {MAX_REPORT_BYTES} bytes")
        report = json.loads(data)
        if not isinstance(report, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError, RecursionError) as error:
        raise CommandFailed("model_rejected", f"{path}: cannot be read as a build report "
                            f"({getattr(error, 'strerror', None) or error}); not installed") \
            from None
    return report


def figures(report: dict[str, Any]) -> dict[str, Any]:
    """What a reply says of a report: its verdict, target and gate figures."""
    return {key: report[key] for key in FIGURES if key in report}


def refusal(model: Path, report: dict[str, Any], runnable: Sequence[str]) -> str | None:
    """Why set-model must not install ``model`` with this report beside it, or None."""
    where = model.parent / REPORT_FILE
    if report.get("passed") is not True:
        reason = report.get("reason")
        return (f"{where}: the build failed its gate"
                + (f" ({reason})" if isinstance(reason, str) and reason else "")
                + "; not installed")
    target = report.get("target")
    if not isinstance(target, str) or target not in runnable:
        return (f"{where}: built for target {target!r}; this node runs "
                f"{', '.join(runnable)}; not installed")
    return None


def version_files(directory: Path, report: dict[str, Any]) -> dict[str, Path]:
    """The files beside a model that go into its version: build.json, and for an RKNN
    target the model.rknn (model_rejected when it is missing)."""
    files = {REPORT_FILE: directory / REPORT_FILE}
    if str(report.get("target", "")).startswith("rknn:"):
        if not (directory / RKNN_FILE).is_file():
            raise CommandFailed("model_rejected", f"{directory}: built for "
                                f"{report['target']} but holds no {RKNN_FILE}; not installed")
        files[RKNN_FILE] = directory / RKNN_FILE
    return files


def canary_of(guard: dict[str, Any]) -> dict[str, Any]:
    """The data plane's canary thresholds from a model guard (unset ones left out)."""
    return {key: guard[key] for key in ("canary_s", "max_p99_ratio", "max_error_rate",
                                        "max_p99_ms") if guard.get(key) is not None}
