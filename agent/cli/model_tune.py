"""``edge-agent model tune M``: instances, threads, max batch and queue delay (and with
``--variants`` the backend/precision builds ``model build`` made) searched live on this
device against the model's latency objective, the best written to its config.yaml (refused,
exit 1, when even the best misses); ``--rollback`` puts the old file back."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from agent.cli.common import (
    UsageError,
    add_repository_choice,
    emit,
    open_root,
    positive_float,
    ranged_float,
    render_table,
    resolve_state_dir,
)
from agent.stopping import raising_on_termination

WINDOW_S = (0.05, 3600.0)  # seconds of load per measurement (qos.window_s stops at 3600 too)

if TYPE_CHECKING:
    from agent.config import Config
    from agent.discovery.model import Topology
    from agent.kernel.fsroot import Root
    from agent.modeltune.knobs import KnobRungs
    from agent.modeltune.report import TuneReport


def register_tune(actions: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sub = actions.add_parser(
        "tune", help="search instances, threads, max batch and queue delay on this device "
        "against a p99 objective; write the best to the model's config.yaml")
    sub.add_argument("model", metavar="M", help="the model's name in the repository")
    sub.add_argument("--p99-ms", type=_p99_ms, metavar="N",
                     help="the latency objective (default: the model's qos.p99_ms; none: "
                     "the most throughput)")
    sub.add_argument("--rate", type=_rate, metavar="N",
                     help="requests per second of an open-loop load (default: the larger of the "
                     "rate the running data plane recorded for the model and its "
                     "qos.min_rps; neither: a closed loop of 1, 2, 4, ... clients)")
    sub.add_argument("--budget-s", type=positive_float, default=60.0, metavar="N",
                     help="seconds after which the quick search starts no new candidate "
                     "(the one under way ends its levels of load; default: 60)")
    sub.add_argument("--exhaustive", action="store_true",
                     help="measure every candidate of the grid instead")
    sub.add_argument("--space", action="append", default=[], metavar="KEY=N,N",
                     help="the values of one dimension: threads, count, batch, delay_us "
                     "(default: threads 1, 2, 4 .. CPUs; count 1, 2; batch 1, 4, 8; "
                     "delay_us 0, 500, 2000)")
    sub.add_argument("--variants", action="store_true",
                     help="search the versions model build made of the model too (each "
                     "build, the served version and the builds' source); the chosen one is "
                     "pinned with version_policy")
    sub.add_argument("--knobs", action="store_true",
                     help="search the device's latency knobs too: CPU frequency floors and a "
                     "PM QoS hold, within the applied profile's bounds (each rung of the "
                     "ladder the QoS controller climbs); put back when the search ends, "
                     "never written to config.yaml")
    sub.add_argument("--root", default="/", metavar="DIR",
                     help="the filesystem root the knobs are written under and the power "
                     "rails read from (default: /)")
    sub.add_argument("--window-s", type=ranged_float(*WINDOW_S), default=1.0, metavar="N",
                     help="seconds of load per measurement (default: 1)")
    sub.add_argument("--rollback", action="store_true",
                     help="put back the config.yaml the model had before model tune")
    add_repository_choice(sub, "repository is used")
    sub.add_argument("--json", action="store_true", help="print the report as JSON")
    sub.set_defaults(handler=tune_command)


def _p99_ms(text: str) -> float:
    """qos.p99_ms's bounds (read when the flag is given: every command builds this parser)."""
    from agent.serving.settings import QOS_P99_MS

    return ranged_float(*QOS_P99_MS)(text)


def _rate(text: str) -> float:
    """qos.min_rps's bounds."""
    from agent.serving.settings import QOS_MIN_RPS

    return ranged_float(*QOS_MIN_RPS)(text)


def tune_command(args: argparse.Namespace) -> int:
    from agent.cli.service import command_config
    from agent.modeltune import configfile
    from agent.modeltune.plane import PlaneError
    from agent.modeltune.power import RailPower
    from agent.modeltune.tune import TuneError, TuneRequest, tune
    from agent.serving.repository import valid_name

    if not valid_name(args.model):
        raise UsageError(f"model {args.model!r}: letters, digits, '.', '_' and '-', not "
                         "starting with '.'")
    config = command_config(args) if args.repository is None else None
    repository = args.repository or Path(config.repository if config else "")
    if args.rollback:
        done = configfile.rollback(repository / args.model)
        emit(args.json, {"model": args.model, "rolled_back": done}, done)
        return 0
    builtins: dict[str, Path] = {}
    if config is not None:
        from agent.service.serve import builtin_models

        builtins = builtin_models(config)
    else:
        from agent.inference.demo_model import DEMO_MODEL_PATH
        from agent.service.serve import DEMO

        builtins = {DEMO: DEMO_MODEL_PATH}
    recorded = _recorded(config, args.model) if config and args.rate is None else None
    root, topology = _device(args.root)
    request = TuneRequest(args.model, repository, builtins, args.p99_ms, args.rate,
                          args.budget_s, args.exhaustive, args.space, args.window_s,
                          config.inference.model if config else None, recorded,
                          args.variants,
                          _knobs(args, root, topology) if args.knobs else None,
                          RailPower.of(root, topology))
    progress = (lambda step: None) if args.json else (
        lambda step: print(f"  ... {step}", file=sys.stderr, flush=True))
    try:
        with raising_on_termination():  # the knobs and the scratch put back, as on Ctrl-C
            report = tune(request, progress)
    except TuneError as error:
        raise UsageError(str(error)) from None
    except PlaneError as error:
        raise OSError(str(error)) from None
    emit(args.json, report.to_dict(), render(report))
    return 0 if report.met else 1


def _device(directory: str) -> tuple[Root, Topology]:
    """The device under ``--root``: its latency knobs and its power rails are both its."""
    from agent.discovery import discover

    root = open_root(directory)
    return root, discover(root)


def _knobs(args: argparse.Namespace, root: Root, topology: Topology) -> KnobRungs:
    """The device's latency ladder over the profile applied under ``--root`` (its journal
    in the state directory), as the search's rungs."""
    from agent.modeltune.knobs import KnobRungs
    from agent.tuning.journal import Journal
    from agent.tuning.latency_knobs import LatencyKnobs

    journal = Journal(resolve_state_dir(args.state_dir, root.base))
    return KnobRungs.of(LatencyKnobs(root, topology, journal), label=rung_label)


def rung_label(step: object) -> str:
    """One rung in a table cell: its floors in MHz and its hold."""
    from agent.tuning.latency_knobs import KnobStep

    assert isinstance(step, KnobStep)
    parts = [f"{policy} >= {khz // 1000} MHz"
             for policy, khz in sorted((step.cpu_floor_khz or {}).items())]
    if step.pm_qos_us is not None:
        parts.append(f"PM QoS {step.pm_qos_us} us")
    return ", ".join(parts) or "the profile's"


def _recorded(config: Config, model: str) -> float | None:
    """The rate the running data plane recorded for ``model``, or None."""
    from agent.cli.running import running_data_plane
    from agent.modeltune.measure import recorded_rate
    from agent.serving.errors import ServeError

    client, _ = running_data_plane(config)
    if client is None:
        return None
    try:
        with client:
            return recorded_rate(client.statistics(model), model)
    except ServeError:
        return None


def render(report: TuneReport) -> str:
    from agent.modeltune.search import pareto

    searched = bool(report.variants)
    knobs = bool(report.knobs)
    power = any(r.power_mw is not None for r in report.results)
    rows = [["", *(["variant"] if searched else []), "instances x threads", "batch",
             "delay_us", *(["knobs"] if knobs else []), "p99_ms", "rps", "goodput", "cpu",
             *(["power_mw"] if power else []), "pareto", "load"]]
    for r, front in zip(report.results, pareto(report.results), strict=True):
        c = r.candidate
        variant = report.variant(r)
        rows.append(["*" if r is report.chosen else "",
                     *([variant.label() if variant else ""] if searched else []),
                     f"{c.count} x {c.threads}",
                     str(c.max_batch_size), str(c.max_queue_delay_us),
                     *([report.knobs[c.knobs]] if knobs else []), f"{r.p99_ms:.2f}",
                     f"{r.throughput_rps:.1f}", f"{r.goodput_rps:.1f}",
                     "" if r.cpu_cores is None else f"{r.cpu_cores:.2f}",
                     *(["" if r.power_mw is None else f"{r.power_mw:.0f}"] if power else []),
                     "yes" if front else "", r.problem or r.load])
    goal = ", ".join(f"{k} {v:g}" for k, v in (("p99_ms", report.objective.p99_ms),
                                                ("min_rps", report.objective.min_rps))
                     if v is not None) or "none (the most throughput)"
    lines = [f"model {report.model} version {report.version}: {report.search}, "
             f"{len(report.results)} candidates in {report.measured_s:.1f} s; objective: "
             f"{goal}", render_table(rows, "  ")]
    lines += [f"  note: {note}" for note in report.notes]
    if report.confirmed is not None:
        lines.append(f"  measured again: p99 {report.confirmed.p99_ms:.2f} ms, "
                     f"{report.confirmed.throughput_rps:.1f} rps")
    if report.met:
        lines.append(f"  chosen: {report.chosen.candidate.label()}"
                     + (f"; written to {report.written}" if report.written else ""))
    else:
        lines.append(f"  refused: the best candidate ({report.chosen.candidate.label()}) "
                     f"misses the objective: {report.miss()}; nothing written")
    return "\n".join(lines)
