"""What a build did, as ``build.json`` (in the version's directory and in every reply) and as
the lines a person reads: each variant tried, its figures and why it was kept or refused."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from agent.modelbuild.compare import Agreement
from agent.modelbuild.request import BuildRequest

SCHEMA = "build/1"
REPORT_FILE = "build.json"
MODEL_FILE, RKNN_FILE = "model.onnx", "model.rknn"  # a version's files (the .rknn beside)


@dataclass
class Tried:
    """One candidate: a quantization variant, the FP16 conversion or the ``.rknn``."""

    name: str
    settings: dict[str, Any]
    verdict: str = "refused"  # "passed" | "refused" | "failed" (could not be built)
    reason: str = ""
    agreement: Agreement | None = None
    speed_ratio: float | None = None  # original latency / built latency; None: not measured
    size_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "settings": self.settings, "verdict": self.verdict,
                "reason": self.reason,
                "agreement": None if self.agreement is None else self.agreement.to_dict(),
                "speed_ratio": None if self.speed_ratio is None else round(self.speed_ratio, 3),
                "size_bytes": self.size_bytes}


@dataclass
class BuildReport:
    request: BuildRequest
    source_sha256: str
    source_bytes: int
    tools: dict[str, str]
    measured_with: str  # the execution provider the held-out inputs ran on
    speed_note: str | None  # why no speed ratio was measured, when none was
    inputs: dict[str, int]  # calibration and held-out counts
    tried: list[Tried] = field(default_factory=list)
    passed: bool = False
    reason: str = ""
    chosen: str | None = None
    model_file: Path | None = None  # in the build's working directory
    version: int | None = None  # once installed
    peak_rss_mb: float | None = None  # the build's peak resident memory (measure.PeakMemory)

    def to_dict(self) -> dict[str, Any]:
        request = self.request
        return {"schema": SCHEMA, "name": request.name,
                "source": {"path": str(request.source), "sha256": self.source_sha256,
                           "size_bytes": self.source_bytes},
                "target": request.target, "precision": request.precision,
                "gate": asdict(request.gate), "passed": self.passed, "reason": self.reason,
                "chosen": self.chosen, "version": self.version,
                "measured_with": self.measured_with, "speed_note": self.speed_note,
                "inputs": self.inputs, "peak_rss_mb": self.peak_rss_mb, "tools": self.tools,
                "variants": [t.to_dict() for t in self.tried]}

    def write(self, directory: Path) -> Path:
        """``build.json`` in ``directory``, flushed to disk before the version appears."""
        path = directory / REPORT_FILE
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(self.to_dict(), handle, indent=2)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
        return path

    def render(self) -> str:
        request = self.request
        lines = [f"model build {request.name}: {request.source} for {request.target} "
                 f"({request.precision}), gate top-1 >= {request.gate.top1:g}, cosine >= "
                 f"{request.gate.cosine:g}, speed >= {request.gate.speed:g}x",
                 f"  inputs: {self.inputs['calibration']} calibration, "
                 f"{self.inputs['heldout']} held out; run with {self.measured_with}"
                 + ("" if self.peak_rss_mb is None else
                    f"; peak memory {self.peak_rss_mb:.0f} MB")]
        if self.speed_note:
            lines.append(f"  speed: not measured: {self.speed_note}")
        for tried in self.tried:
            figures = []
            if tried.agreement is not None:
                top1 = tried.agreement.top1
                figures.append("top-1 n/a" if top1 is None else f"top-1 {top1:.3f}")
                figures.append(f"cosine {tried.agreement.cosine_mean:.4f} "
                               f"(min {tried.agreement.cosine_min:.4f})")
            if tried.speed_ratio is not None:
                figures.append(f"{tried.speed_ratio:.2f}x")
            if tried.size_bytes is not None:
                figures.append(f"{tried.size_bytes / 1e6:.1f} MB")
            lines.append(f"  {tried.verdict:7} {tried.name}: {', '.join(figures) or '-'}"
                         + (f" - {tried.reason}" if tried.reason else ""))
        where = f" as version {self.version}" if self.version is not None else ""
        lines.append(f"  {'installed' + where if self.passed else 'not installed'}: "
                     f"{self.reason}")
        return "\n".join(lines)
