"""The backend/precision variants ``model tune --variants`` searches: the versions of a model
that ``model build`` installed (a ``build.json`` that passed its gate beside the model file),
the version the model serves now, and any version that holds a build's source file.

A variant is a version of the same model, so the data plane serves exactly one of them when
the model's config.yaml pins it (``version_policy: {specific: [N]}``); a build for an
accelerator also needs the precision its engine is told to compute in (TensorRT's INT8 or
FP16 flags, OpenVINO's FP16, the RKNN backend's), which is the config's ``precision`` key.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.serving.settings import PRECISIONS
from agent.serving.versions import file_sha256

# model build's report beside the model file (agent.modelbuild.report.REPORT_FILE: model build
# sits beside model tune in the layers, so neither imports the other)
REPORT_FILE = "build.json"
MAX_REPORT_BYTES = 1 << 20  # a build.json is a few kB; a larger one is not a report


class NoVariantsError(ValueError):
    """``--variants`` asked for, and ``model build`` has made none of this model."""


@dataclass(frozen=True)
class Variant:
    version: int
    name: str  # the build's chosen variant ("u8s8-per-channel"), "served" or "build source"
    target: str = ""  # the build's target (cpu, tensorrt, openvino, rknn:...); "": no build
    precision: str | None = None  # config.yaml's precision it needs; None: the file's own

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "name": self.name, "target": self.target or None,
                "precision": self.precision}

    def label(self) -> str:
        built = f" ({self.target})" if self.target else ""
        return f"version {self.version} {self.name}{built}"


def config_precision(target: str, precision: str) -> str | None:
    """The ``precision`` key a build for ``target`` is served with: the engine's flag where
    an accelerator's engine reads one (OpenVINO's CPU/GPU plugins take FP16, and INT8 comes
    from the quantized graph itself); None on the CPU, which runs the file as it is."""
    if precision not in PRECISIONS:
        return None
    if target == "tensorrt" or target.startswith("rknn:"):
        return precision
    return "fp16" if target == "openvino" and precision == "fp16" else None


def _text(value: object, limit: int) -> str:
    """A report's word as a table or a note may show it: printable, bounded ("" for none)."""
    return "".join(c for c in value if c.isprintable())[:limit] if isinstance(value, str) \
        else ""


def _source_of(path: Path, sources: set[str]) -> bool:
    """Whether ``path`` is a build's source (an unreadable file is not)."""
    try:
        return path.suffix == ".onnx" and file_sha256(path) in sources
    except OSError:
        return False


def read_build(model_file: Path) -> dict[str, Any] | None:
    """The passed build.json beside ``model_file``; None when there is none, it failed its
    gate, or it cannot be read (such a version is no build to search, only a version)."""
    try:
        with open(model_file.parent / REPORT_FILE, "rb") as handle:
            data = handle.read(MAX_REPORT_BYTES + 1)
        report = json.loads(data) if len(data) <= MAX_REPORT_BYTES else None
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(report, dict) or report.get("passed") is not True:
        return None
    return report


def find(model: str, versions: Mapping[int, Path], served: int) -> dict[int, Variant]:
    """The variants by version: every passed build, the served version and the builds'
    sources found among the versions.  NoVariantsError (one line: how to make one) when
    there is no build."""
    found: dict[int, Variant] = {}
    sources: set[str] = set()
    for version, path in versions.items():
        report = read_build(path)
        if report is None:
            continue
        target = _text(report.get("target"), 40)
        precision = _text(report.get("precision"), 8)
        name = " ".join(w for w in (precision, _text(report.get("chosen"), 64)) if w)
        found[version] = Variant(version, name or "build", target,
                                 config_precision(target, precision))
        source = report.get("source")
        if isinstance(source, dict) and isinstance(source.get("sha256"), str):
            sources.add(source["sha256"])
    if not found:
        raise NoVariantsError(
            f"model {model}: --variants: model build has made no variant of it (no version "
            f"with a passed {REPORT_FILE}); make one with `edge-agent model build SRC.onnx "
            f"--name {model} --calibration DIR [--target T] [--precision int8|fp16]`")
    for version, path in versions.items():
        if version in found:
            continue
        if sources and _source_of(path, sources):
            found[version] = Variant(version, "build source")
        elif version == served:
            found[version] = Variant(version, "served")
    return dict(sorted(found.items()))
