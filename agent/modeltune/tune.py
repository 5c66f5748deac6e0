"""``model tune``'s run: the model's default version (and with ``--variants`` the versions
``model build`` made of it) copied into a scratch repository, a scratch data plane started
over it, the candidates measured (coordinate descent within a
budget, or the whole grid), and the best written to the model's config.yaml when it meets
the objective."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from agent import yamlfile
from agent.modeltune import configfile, search, variants
from agent.modeltune.knobs import KnobRungs, KnobSetter
from agent.modeltune.measure import Clients, Load, Objective, measure
from agent.modeltune.plane import ScratchPlane, stage_model
from agent.modeltune.power import SAMPLE_S, RailPower
from agent.modeltune.report import TuneReport
from agent.modeltune.search import Result
from agent.modeltune.space import (
    Candidate,
    SpaceError,
    default_space,
    grid,
    parse_space,
    with_candidate,
)
from agent.serving.errors import ServeError
from agent.serving.repository import CONFIG_FILE, scan_model
from agent.serving.settings import THREADS_PER_CPU, parse_settings
from agent.serving.versions import synthetic

MAX_GRID = 512  # an exhaustive search of more points than this is refused, not started


class TuneError(ValueError):
    """The model or the request cannot be tuned (a usage error: one line, exit 2)."""


@dataclass(frozen=True)
class TuneRequest:
    model: str
    repository: Path
    builtins: Mapping[str, Path] = field(default_factory=dict)
    p99_ms: float | None = None  # None: the model's qos.p99_ms
    rate: float | None = None  # None: qos.min_rps, else the closed loop
    budget_s: float = 60.0
    exhaustive: bool = False
    space: Sequence[str] = ()  # --space KEY=N,N
    window_s: float = 1.0
    inference_model: str | None = None  # the config's built-in model, served the same way
    recorded_rate: float | None = None  # what the running data plane recorded for it
    variants: bool = False  # search the versions model build made too (--variants)
    knobs: KnobRungs | None = None  # the device's latency knobs ladder, searched too
    power: RailPower | None = None  # the device's rails, sampled through each load

    def load_rate(self, min_rps: float | None) -> tuple[float | None, str]:
        """The open loop's rate and where it came from; None: the closed loop."""
        if self.rate is not None:
            return self.rate, "--rate"
        known = [(r, why) for r, why in ((self.recorded_rate, "the running data plane's "
                                          "statistics"), (min_rps, "qos.min_rps"))
                 if r is not None]
        return max(known) if known else (None, "")


def _original(directory: Path) -> dict[str, Any]:
    """The model's config.yaml as a mapping ({} when there is none); scan_model checked it."""
    try:
        data = yamlfile.load(yamlfile.decode((directory / CONFIG_FILE).read_bytes()))
    except FileNotFoundError:
        return {}
    return dict(data or {})


def _space(items: Sequence[str], cpus: int, batched: bool) -> dict[str, tuple[int, ...]]:
    try:
        return parse_space(items, default_space(cpus, batched), batched)
    except SpaceError as error:
        raise TuneError(str(error)) from None


def _grid_sizes(items: Sequence[str], cpus: int, extra: Mapping[str, Sequence[int]]
                ) -> list[int]:
    """The grid's size for a model that batches and one that does not (the data plane's
    metadata tells which), of those ``--space`` allows: a size that is too large (or nil)
    either way is refused before the scratch plane starts."""
    sizes = []
    for batched in (True, False):
        try:
            space = _space(items, cpus, batched)
        except TuneError:
            if batched:
                raise
            continue  # batching keys: only a model that batches can be asked for them
        sizes.append(len(grid({**space, **extra}, cpus)))
    return sizes


def _too_many(candidates: int) -> TuneError:
    return TuneError(f"--exhaustive: {candidates} candidates, above {MAX_GRID}: narrow it "
                     "with --space")


def _variants(request: TuneRequest, versions: Mapping[int, Path], served: int
              ) -> dict[int, variants.Variant]:
    """The variants searched by version ({} without --variants)."""
    if not request.variants:
        return {}
    try:
        return variants.find(request.model, versions, served)
    except variants.NoVariantsError as error:
        raise TuneError(str(error)) from None


def tune(request: TuneRequest, progress: Callable[[str], None] = lambda line: None
         ) -> TuneReport:
    """The search, and with a knobs ladder the device put back afterwards, whatever ended
    it (a refusal, a failed measurement, an interrupt)."""
    with KnobSetter(request.knobs) as knobs:
        return _tune(request, progress, knobs)


def _tune(request: TuneRequest, progress: Callable[[str], None], knobs: KnobSetter
          ) -> TuneReport:
    entry = scan_model(request.repository, request.builtins, request.model)
    if entry is None:
        raise TuneError(f"model {request.model!r}: not in {request.repository} (nor a "
                        "built-in model)")
    if entry.error:
        raise TuneError(f"model {request.model}: {entry.error}")
    wanted = entry.wanted()
    number = max(wanted)
    directory = request.repository / request.model
    before = configfile.read_current(directory)
    original = _original(directory)
    qos = entry.settings.qos
    objective = Objective(request.p99_ms if request.p99_ms is not None else
                          qos.p99_ms if qos else None, qos.min_rps if qos else None)
    rate, source = request.load_rate(objective.min_rps)
    first = entry.settings.instances[0].device
    device = None if first == "auto" else first
    cpus = len(os.sched_getaffinity(0))
    found = _variants(request, entry.versions, number)
    extra = {"version": tuple(found)} if found else {}
    if request.knobs is not None and request.knobs.labels:
        extra["knobs"] = tuple(range(len(request.knobs.labels)))
    files = {v: entry.versions[v] for v in found} or {number: wanted[number]}
    sizes = _grid_sizes(request.space, cpus, extra)  # refused before anything starts
    if not max(sizes):
        raise TuneError(f"--space leaves no candidate within {THREADS_PER_CPU} threads per "
                        f"CPU ({cpus} CPUs)")
    if request.exhaustive and min(sizes) > MAX_GRID:
        raise _too_many(min(sizes))
    with tempfile.TemporaryDirectory(prefix="edge-agent-tune-") as scratch:
        config_file = stage_model(Path(scratch), request.model, files, directory, original,
                                  number)
        progress("starting a scratch data plane")
        with ScratchPlane(Path(scratch), request.inference_model) as plane:
            def here(message: str) -> str:  # the operator's file, not the scratch copy
                return message.replace(str(config_file.parent), str(directory))

            try:
                with plane.client() as client:
                    specs = client.model_metadata(request.model).inputs
            except ServeError as error:
                raise TuneError(here(error.message)) from None
            feeds = {t.name: t.array for t in synthetic(specs)}
            batched = all(s.shape and s.shape[0] < 0 for s in specs)
            space = {**_space(request.space, cpus, batched), **extra}
            points = grid(space, cpus)
            if request.exhaustive and len(points) > MAX_GRID:
                raise _too_many(len(points))
            load = Load(rate, request.window_s)
            power = request.power.read if request.power is not None else None

            seen: list[Result] = []  # the quick search starts each sweep at their best

            def measured(candidate: Candidate, again: Result | None = None) -> Result:
                """``again``: the candidate's result to confirm, at its own level only."""
                config = with_candidate(original, candidate, device,
                                        _precision(found, candidate))
                knobs.move(candidate.knobs)
                problem = plane.reload(request.model, config_file, config,
                                       candidate.version)
                if problem:
                    return Result(candidate, float("inf"), 0.0, 0.0, False, "", 0,
                                  here(problem))
                start = 1 if request.exhaustive or not seen else max(
                    1, search.choose(seen).clients)
                clients = Clients(plane.client, request.model, feeds)
                try:
                    result = measure(clients.call, candidate, objective, load,
                                     plane.cpu_seconds, power,
                                     start if again is None else again.clients,
                                     sweep=again is None)
                finally:
                    clients.close()
                seen.append(result)
                named = f"{found[candidate.version].name}: " if candidate.version else ""
                drawn = "" if result.power_mw is None else f", {result.power_mw:.0f} mW"
                progress(f"{named}{candidate.label()}: p99 {result.p99_ms:.2f} ms, "
                         f"{result.throughput_rps:.1f} rps{drawn}")
                return result

            began = time.monotonic()
            if request.exhaustive:
                # one move of the device's knobs per rung, not per candidate
                results = search.exhaustive(sorted(points, key=lambda c: c.knobs), measured)
            else:
                results = search.coordinate_descent(
                    space, cpus, measured,
                    lambda: time.monotonic() - began >= request.budget_s, rate is not None)
            best = search.choose(results)
            searched = time.monotonic() - began
            if best.met:
                progress("measuring the best again before writing it")
            confirmed = measured(best.candidate, best) if best.met else None
            took = time.monotonic() - began
    precision = _precision(found, best.candidate)
    chosen = with_candidate(original, best.candidate, device, precision)
    report = TuneReport(request.model, number, objective,
                        "exhaustive" if request.exhaustive else "coordinate descent",
                        results, best, best.candidate.settings(device, precision), took,
                        confirmed=confirmed, searched_s=searched, variants=found,
                        knobs=tuple(request.knobs.labels) if request.knobs else ())
    shape = f"an open loop at {rate:g} rps ({source})" if rate else "a closed loop"
    report.notes.append(f"load: {shape}, {request.window_s:g} s per measurement; "
                        f"{len(points)} candidates in the grid")
    if request.power is not None and any(r.power_mw is not None for r in results):
        report.notes.append(f"power: {request.power.described}, read every {SAMPLE_S:g} s "
                            "through each load and averaged")
    if found:
        report.notes.append("variants: " + "; ".join(v.label() for v in found.values()))
    if request.knobs is not None and request.knobs.labels:
        report.notes.append(f"latency knobs: best at rung {best.candidate.knobs} "
                            f"({knobs.label(best.candidate.knobs)}); the device is put back "
                            "to the profile's own (a rung is the profile's to hold)")
    if report.met:
        text = yaml.safe_dump(chosen, sort_keys=False)
        parse_settings(yaml.safe_load(text), str(directory / CONFIG_FILE))  # never write bad
        configfile.write_tuned(directory, text.encode(), before)
        report.written = str(directory / CONFIG_FILE)
    return report


def _precision(found: Mapping[int, variants.Variant], candidate: Candidate) -> str | None:
    """The precision key the candidate's variant is served with (None: the config's own)."""
    return found[candidate.version].precision if candidate.version else None
