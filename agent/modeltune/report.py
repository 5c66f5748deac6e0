"""What ``model tune`` found: the DESIGN's ``--json`` document and the table a person reads."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from agent.modeltune.measure import Objective
from agent.modeltune.search import Result, pareto


def _ms(value: float) -> float | None:
    """JSON has no infinity: a candidate that answered nothing has no p99."""
    return round(value, 3) if math.isfinite(value) else None


@dataclass
class TuneReport:
    model: str
    version: int
    objective: Objective
    search: str  # "coordinate descent" | "exhaustive"
    results: list[Result]
    chosen: Result
    chosen_settings: dict[str, Any]
    measured_s: float
    written: str = ""  # the config.yaml written, "" when nothing was
    notes: list[str] = field(default_factory=list)

    @property
    def met(self) -> bool:
        return self.chosen.met

    def miss(self) -> str:
        """By how much the best candidate misses the objective ("" when it meets it)."""
        best, goal = self.chosen, self.objective
        parts = []
        if best.errors:
            parts.append(f"{best.errors} requests failed or were not answered in time")
        if goal.p99_ms is not None and not best.p99_ms <= goal.p99_ms:
            over = best.p99_ms - goal.p99_ms
            parts.append(f"p99 {best.p99_ms:.2f} ms is {over:.2f} ms "
                         f"({100 * over / goal.p99_ms:.0f} %) above p99_ms {goal.p99_ms:g}"
                         if math.isfinite(over) else "no request was answered")
        if goal.min_rps is not None and not best.met and best.throughput_rps < goal.min_rps:
            parts.append(f"throughput {best.throughput_rps:.1f} rps is "
                         f"{goal.min_rps - best.throughput_rps:.1f} below min_rps "
                         f"{goal.min_rps:g}")
        return "; ".join(parts) if not self.met else ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model, "version": self.version,
            "objective": {"p99_ms": self.objective.p99_ms, "min_rps": self.objective.min_rps},
            "search": self.search,
            "chosen": self.chosen_settings,
            "p99_ms": _ms(self.chosen.p99_ms),
            "throughput_rps": round(self.chosen.throughput_rps, 2),
            "goodput_rps": round(self.chosen.goodput_rps, 2),
            "measured_s": round(self.measured_s, 2),
            "candidates": [{"settings": r.candidate.settings(), "p99_ms": _ms(r.p99_ms),
                            "throughput_rps": round(r.throughput_rps, 2),
                            "goodput_rps": round(r.goodput_rps, 2), "met": r.met,
                            "cpu_cores": r.cpu_cores, "pareto": front, "load": r.load,
                            "errors": r.errors, **({"problem": r.problem} if r.problem else {})}
                           for r, front in zip(self.results, pareto(self.results),
                                               strict=True)],
            "met": self.met,
            "miss": self.miss(),
            "written": self.written or None,
            "notes": self.notes,
        }
