"""One candidate measured on the scratch data plane: warmed up, then loaded at the rate
asked for (open loop), or by a closed loop of 1, 2, 4, ... clients until more clients no
longer add throughput or break the latency objective (the candidate's figures are its best
level, as Model Analyzer sweeps concurrency per configuration).  The quick search starts a
sweep where the best candidate so far peaked (halving from there while the objective
breaks): neighbours on its path peak near each other, and the levels below cost it windows
that tell it nothing."""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from agent.inference.stats import Window
from agent.modeltune.load import Call, Sample, closed_loop, open_loop
from agent.modeltune.power import Sampling
from agent.modeltune.search import Result, choose
from agent.modeltune.space import Candidate
from agent.serving.http_client import HttpClient

MAX_CLIENTS = 64
WARMUP_S = 0.5  # a new session's first runs allocate and plan: not what serving looks like
GAIN = 1.05  # another doubling of clients must add this much throughput to go on
MIN_RECORDED = 100  # requests a recorded rate needs before it shapes the load
KEPT_UP = 0.95  # an open loop at min_rps holds it when this share of the rate is answered


@dataclass(frozen=True)
class Objective:
    p99_ms: float | None = None
    min_rps: float | None = None


@dataclass(frozen=True)
class Load:
    """``rate``: an open loop at that many requests per second; None: the closed loop."""

    rate: float | None
    window_s: float


def judge(sample: Sample, candidate: Candidate, objective: Objective, load: str,
          cpu_s: float | None = None, power_mw: float | None = None) -> Result:
    """``cpu_s``: the data plane's CPU seconds during the sample, ``power_mw`` the device's
    mean power (None: not known)."""
    p99 = sample.p99_ms()
    throughput = sample.throughput_rps()
    fast = objective.p99_ms is None or p99 <= objective.p99_ms
    enough = objective.min_rps is None or throughput >= objective.min_rps * KEPT_UP
    goodput = throughput if fast else sample.within_rps(objective.p99_ms)
    cores = round(cpu_s / sample.elapsed_s, 2) if cpu_s is not None and sample.elapsed_s \
        else None
    return Result(candidate, p99, throughput, goodput, fast and enough and not sample.errors,
                  load, sample.errors, cpu_cores=cores, first_error=sample.first_error[:300],
                  power_mw=power_mw)


class Clients:
    """One HttpClient per load thread (a connection is not shared), closed together."""

    def __init__(self, make: Callable[[], HttpClient], model: str,
                 feeds: Mapping[str, np.ndarray]) -> None:
        self._make, self._model, self._feeds = make, model, feeds
        self._clients: dict[int, HttpClient] = {}
        self._lock = threading.Lock()

    def call(self, index: int) -> None:
        client = self._clients.get(index)
        if client is None:
            with self._lock:
                client = self._clients.setdefault(index, self._make())
        client.infer(self._model, self._feeds)

    def close(self) -> None:
        with self._lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()


def measure(call: Call, candidate: Candidate, objective: Objective, load: Load,
            cpu: Callable[[], float] | None = None,
            power: Callable[[], float | None] | None = None, start_clients: int = 1,
            sweep: bool = True) -> Result:
    """``cpu``: the data plane's CPU seconds so far (psutil), for each result's cpu_cores;
    ``power``: the device's power now (mW), sampled through each load for its power_mw;
    ``start_clients``: the closed loop's first level (the quick search's hint: where the
    best candidate so far peaked), halved from there while the objective breaks; without
    ``sweep``, that level only (a chosen result confirmed where it was measured; a miss
    there is measured once more, as at the lowest level)."""
    width = candidate.count * max(1, candidate.max_batch_size)
    closed_loop(call, min(MAX_CLIENTS, width), min(WARMUP_S, load.window_s))

    def timed(run: Callable[[], Sample], label: str, decisive: bool) -> Result:
        """``decisive``: a load whose miss of the p99 objective decides (the open loop, the
        lowest level, below which there is none, a confirmation's level) is measured once
        more and judged on both runs' requests together: one stall of a busy device's
        breaks a 1-s window's p99, and a candidate judged missing on it is passed over by
        the search (bench/model_tune.py: the best one was, once)."""
        before = cpu() if cpu is not None else None
        with Sampling(power) as sampling:
            sample = run()
            if decisive and _missed(sample, objective):
                sample = sample.joined(run())
        spent = cpu() - before if cpu is not None and before is not None else None
        return judge(sample, candidate, objective, label, spent, sampling.mean_mw())

    if load.rate is not None:
        workers = min(MAX_CLIENTS, max(8, 2 * width))
        return timed(functools.partial(open_loop, call, load.rate, load.window_s, workers),
                     f"open loop, {load.rate:g} rps", True)

    def level(clients: int, decisive: bool = False) -> Result:
        return dataclasses.replace(timed(functools.partial(
            closed_loop, call, clients, load.window_s), f"closed loop, {clients} clients",
            decisive or clients == 1), clients=clients)

    top = min(MAX_CLIENTS, max(2, 2 * width))
    if not sweep:
        return level(min(MAX_CLIENTS, max(1, start_clients)), True)
    clients = min(top, max(1, start_clients))
    levels = [level(clients)]
    if not levels[0].met:  # above the level that holds: down until one does
        while clients > 1 and not levels[-1].met:
            clients //= 2
            levels.append(level(clients))
        return choose(levels)
    while clients * 2 <= top:
        clients *= 2
        levels.append(level(clients))
        if not levels[-1].met or levels[-1].throughput_rps < levels[-2].throughput_rps * GAIN:
            break
    return choose(levels)


def _missed(sample: Sample, objective: Objective) -> bool:
    """Whether every request was answered but the p99 broke the objective."""
    return objective.p99_ms is not None and not sample.errors and (
        sample.p99_ms() > objective.p99_ms)


def recorded_rate(statistics: list[dict[str, Any]], model: str) -> float | None:
    """The requests per second the model's versions were sent while serving (each version's
    queue window: every request from the first enqueued to the last answered, idle gaps
    included), or None when they hold fewer than MIN_RECORDED requests or nothing usable."""
    count, rate = 0, 0.0
    for entry in statistics:
        try:
            if entry.get("name") != model:
                continue
            window = Window.from_dict(entry["edge_agent"]["queue"]["window"])
        except (KeyError, TypeError, ValueError, AttributeError):
            continue
        count += window.count
        rate += window.throughput_per_s
    return rate if count >= MIN_RECORDED and rate > 0 else None
