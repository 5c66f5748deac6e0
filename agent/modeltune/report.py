"""What ``model tune`` found: the DESIGN's ``--json`` document and the table a person reads."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from agent.modeltune.measure import KEPT_UP, Objective
from agent.modeltune.search import Result, pareto
from agent.modeltune.variants import Variant


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
    # the chosen candidate measured once more before anything is written: one lucky window
    # on a busy device must not become the model's configuration (None: nothing to confirm)
    confirmed: Result | None = None
    searched_s: float = 0.0  # of measured_s, the search's (without the confirmation)
    variants: dict[int, Variant] = field(default_factory=dict)  # searched (--variants)
    knobs: tuple[str, ...] = ()  # the latency knobs' rungs searched, by index

    @property
    def met(self) -> bool:
        return self.chosen.met and (self.confirmed is None or self.confirmed.met)

    def miss(self) -> str:
        """By how much the best candidate misses the objective ("" when it meets it)."""
        if not self.chosen.met:
            return self._shortfall(self.chosen)
        if self.confirmed is not None and not self.confirmed.met:
            return "it met the objective in the search but not when measured again: " + \
                self._shortfall(self.confirmed)
        return ""

    def _shortfall(self, result: Result) -> str:
        goal = self.objective
        parts = []
        if result.problem:
            parts.append(result.problem)
        if result.errors:
            parts.append(f"{result.errors} requests failed (the first: {result.first_error})")
        if goal.p99_ms is not None and not result.p99_ms <= goal.p99_ms:
            over = result.p99_ms - goal.p99_ms
            parts.append(f"p99 {result.p99_ms:.2f} ms is {over:.2f} ms "
                         f"({100 * over / goal.p99_ms:.0f} %) above p99_ms {goal.p99_ms:g}"
                         if math.isfinite(over) else "no request was answered")
        if goal.min_rps is not None and result.throughput_rps < goal.min_rps * KEPT_UP:
            parts.append(f"throughput {result.throughput_rps:.1f} rps is "
                         f"{goal.min_rps - result.throughput_rps:.1f} below min_rps "
                         f"{goal.min_rps:g}")
        return "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model, "version": self.version,
            "objective": {"p99_ms": self.objective.p99_ms, "min_rps": self.objective.min_rps},
            "search": self.search,
            "chosen": self.chosen_settings,
            "p99_ms": _ms(self.chosen.p99_ms),
            "throughput_rps": round(self.chosen.throughput_rps, 2),
            "goodput_rps": round(self.chosen.goodput_rps, 2),
            "power_mw": self.chosen.power_mw,
            "measured_s": round(self.measured_s, 2),
            "searched_s": round(self.searched_s, 2),
            "candidates": [{"settings": self._settings(r), **self._variant(r),
                            **self._knobs(r),
                            "p99_ms": _ms(r.p99_ms),
                            "throughput_rps": round(r.throughput_rps, 2),
                            "goodput_rps": round(r.goodput_rps, 2), "met": r.met,
                            "cpu_cores": r.cpu_cores, "power_mw": r.power_mw,
                            "pareto": front, "load": r.load,
                            "errors": r.errors,
                            **({"first_error": r.first_error} if r.first_error else {}),
                            **({"problem": r.problem} if r.problem else {})}
                           for r, front in zip(self.results, pareto(self.results),
                                               strict=True)],
            "confirmed": None if self.confirmed is None else {
                "p99_ms": _ms(self.confirmed.p99_ms),
                "throughput_rps": round(self.confirmed.throughput_rps, 2),
                "goodput_rps": round(self.confirmed.goodput_rps, 2),
                "power_mw": self.confirmed.power_mw, "met": self.confirmed.met},
            "met": self.met,
            "miss": self.miss(),
            "written": self.written or None,
            "notes": self.notes,
            **({"variants": [v.to_dict() for v in self.variants.values()]}
               if self.variants else {}),
            **({"chosen_knobs": self._knobs(self.chosen)["knobs"]} if self.knobs else {}),
        }

    def _knobs(self, result: Result) -> dict[str, Any]:
        rung = result.candidate.knobs
        return {"knobs": {"rung": rung, "label": self.knobs[rung]}} if self.knobs else {}

    def variant(self, result: Result) -> Variant | None:
        """The variant a result measured (None: no variant was searched)."""
        return self.variants.get(result.candidate.version)

    def _settings(self, result: Result) -> dict[str, Any]:
        variant = self.variant(result)
        return result.candidate.settings(None, variant.precision if variant else None)

    def _variant(self, result: Result) -> dict[str, Any]:
        variant = self.variant(result)
        return {"variant": variant.to_dict()} if variant else {}
