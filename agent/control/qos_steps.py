"""The steps the QoS controller may take, in order of cost, each one notch of one lever.

Tightening, for a model whose objective is violated: its own queue delay (a quarter at a
time, or all of it when the p99 is further above the objective than the delay itself), then
its own preferred batch (both cost only its batching gain); then, on every model of a lower
class (the least protected first), admission (a rate cap, never below its ``min_rps``), then
its intra-op threads (the data plane rebuilds its sessions off the hot path) and its CPUs, then
the device's latency ladder (a higher CPU frequency floor, PM QoS: through the tuning
engine, within the profile's bounds, never while the device throttles).  Relaxing walks the
same levers back in the reverse order, so the costliest comes back first: the device's
power, then the other models' CPUs, threads and admission (best-effort throughput), then
the model's own batching; never past what config.yaml (or the profile) set.

Before any of these, a latency-critical model is lifted to real time as soon as it serves
(``lift_steps``), and the lift is not relaxed while its model is latency-critical: giving
it back returns no power and no throughput, only windows that miss (on bench/qos.py's
2-core VM lc lifted held every window beside the CPU hog, and missed most of them without);
it is put back once the model's objective no longer calls for it (removed, or another
class).

One exception to that order: when the busy models' intra-op threads, as configured,
outnumber the CPUs (``contended``), a lower class's threads and CPUs come before its
admission, and its admission comes back before them.  ONNX Runtime's intra-op workers spin
between operators, so there the surplus threads are what delays the protected model, and
halving them costs the lower class less throughput than a rate cap does (bench/qos.py: a
best-effort ResNet-50 on one thread instead of two kept almost all its rate).
"""

from __future__ import annotations

from collections.abc import Mapping

from agent.control.qos_model import (
    ADMIT,
    ADMIT_FLOOR_RPS,
    ADMIT_STEP,
    CLASSES,
    CPUS,
    DELAY,
    MIN_DELAY_US,
    PREFERRED,
    REALTIME,
    RUNG,
    THREADS,
    Device,
    Figures,
    Levers,
    Objective,
    Value,
)
from agent.kernel.parsers import format_cpulist

DEVICE = ""  # the target of a step on the device's ladder rather than on a model
Step = tuple[str, str, Value, str]  # (target model or DEVICE, lever, after, why)
RELAXED = "every objective holds with margin"
PROBED = "every objective holds, not all with margin: a probe"


def tighten_steps(model: str, objectives: Mapping[str, Objective],
                  levers: Mapping[str, Levers], baseline: Mapping[str, Levers],
                  figures: Mapping[str, Figures], device: Device | None,
                  cpus: int) -> list[Step]:
    """Every step toward ``model``'s objective, cheapest first."""
    p99, limit = figures[model].p99_ms, objectives[model].p99_ms
    why = f"p99 {p99:.1f} ms above the objective {limit:g} ms of {model}"
    steps: list[Step] = []
    own = levers[model]
    if own.max_queue_delay_us > 0:
        delay = own.max_queue_delay_us // 4
        # the delay adds at most itself to a request's wait: a p99 further above the
        # objective than that is past what a quarter step can bring in, so it goes at once
        excess_us = (p99 - (limit or 0.0)) * 1000
        if delay < MIN_DELAY_US or excess_us > own.max_queue_delay_us:
            delay = 0
        steps.append((model, DELAY, delay, why))
    if own.preferred_batch_size > 1 and own.max_queue_delay_us > 0:  # else it waits not
        steps.append((model, PREFERRED, own.preferred_batch_size // 2, why))
    lower = below(objectives, levers, rank(objectives, model))
    admission: list[Step] = []
    for other in lower:
        floor = admit_floor(objectives.get(other))
        current = levers[other].admit_rps
        rate = figures[other].rate_rps if other in figures else 0.0
        if current is None and rate <= floor:
            continue  # asking for no more than its floor: holding it frees nothing
        capped = round(max(floor, (rate if current is None else current) * ADMIT_STEP), 3)
        if current is None or capped < current:
            admission.append((other, ADMIT, capped, f"{why}: admission of {other} "
                              f"({service_class(objectives, other)}) held"))
    busy = [m for m in lower if m in figures and figures[m].rate_rps > 0]  # idle: no CPU
    placement: list[Step] = []
    for other in busy:
        if levers[other].threads > 1 and not levers[other].rebuilding:
            placement.append((other, THREADS, levers[other].threads // 2,
                              f"{why}: threads of {other} halved"))
    if cpus >= 2:
        kept = tuple(range(cpus // 2, cpus))  # the first half stays free of them
        for other in busy:
            if levers[other].cpus is None and not levers[other].rebuilding:
                placement.append((other, CPUS, kept, f"{why}: {other} confined to "
                                  f"CPU{'s' if len(kept) > 1 else ''} "
                                  f"{format_cpulist(list(kept))}"))
    if contended(levers, baseline, figures, cpus):
        steps += placement + admission
    else:
        steps += admission + placement
    if device is not None and device.rung < device.rungs - 1 and not device.throttled:
        steps.append((DEVICE, RUNG, device.rung + 1, f"{why}: the device's latency "
                      "ladder raised (CPU frequency floor, PM QoS)"))
    return steps


def relax_steps(objectives: Mapping[str, Objective], levers: Mapping[str, Levers],
                baseline: Mapping[str, Levers], figures: Mapping[str, Figures],
                device: Device | None, below_rank: int | None = None,
                cpus: int = 0, held: Mapping[str, int] | None = None) -> list[Step]:
    """Every step back toward config.yaml, costliest first; with ``below_rank``, only the
    levers moved on models of a lower class and on the device (a probe), not any model's
    own batching.  ``held``: how many probes of a model's admission cap in a row held;
    each such step is that much larger (see ``admit_relaxed``)."""
    why, steps = RELAXED if below_rank is None else PROBED, list[Step]()
    if device is not None and device.rung > 0:
        steps.append((DEVICE, RUNG, device.rung - 1, why))
    order = (below(objectives, levers, below_rank) if below_rank is not None
             else below(objectives, levers, -1))
    placement: list[Step] = []
    for model in order:
        if model in baseline and levers[model].cpus != baseline[model].cpus:
            placement.append((model, CPUS, baseline[model].cpus, why))
    for model in order:
        threads, limit = levers[model].threads, baseline.get(model, levers[model]).threads
        if 0 < threads < limit:
            placement.append((model, THREADS, min(limit, threads * 2), why))
    admission: list[Step] = []
    for model in order:
        current = levers[model].admit_rps
        if current is not None:
            admission.append((model, ADMIT, admit_relaxed(
                current, figures.get(model), (held or {}).get(model, 0)), why))
    if contended(levers, baseline, figures, cpus):
        steps += admission + placement
    else:
        steps += placement + admission
    if below_rank is not None:
        return steps
    for lever in (PREFERRED, DELAY):
        for model in order:
            if model not in baseline:
                continue
            served, configured = levers[model].get(lever), baseline[model].get(lever)
            assert isinstance(served, int) and isinstance(configured, int)
            if served < configured:
                floor = 1 if lever == PREFERRED else MIN_DELAY_US
                after = min(configured, max(served * 2, floor))
                if lever == DELAY and not batches(model, configured, objectives, figures):
                    continue
                steps.append((model, lever, after, why))
    return steps


def batches(model: str, delay_us: int, objectives: Mapping[str, Objective],
            figures: Mapping[str, Figures]) -> bool:
    """Whether giving a model with an objective its configured ``delay_us`` back could
    gather a batch: at its rate, another request is due within that delay (or it has no
    calls: nothing waits).
    Below that the delay is only wait (bench/qos.py: lc at 20 requests/s waited its 1 ms
    every time, and giving it back beside the CPU hog missed windows that lc at no delay
    held)."""
    if model not in objectives or objectives[model].p99_ms is None or model not in figures:
        return True
    rate = figures[model].rate_rps
    return rate == 0 or rate * delay_us >= 1_000_000


def lift_steps(objectives: Mapping[str, Objective], levers: Mapping[str, Levers],
               baseline: Mapping[str, Levers], figures: Mapping[str, Figures]) -> list[Step]:
    """The latency-critical models serving (calls this window) whose threads may be lifted
    to real time and are not: lifted before any miss rather than as a step after one
    (placement.py: the model then runs before anything of normal priority, a co-located
    app's included; the lift costs no model of the agent throughput and the device no
    power, so waiting for a miss would only spend the windows that miss).  And the lifted
    models no objective calls for any more (removed, or another class): put back, unless
    config.yaml lifted them."""
    steps: list[Step] = []
    for m in sorted(levers):
        critical = service_class(objectives, m) == CLASSES[0]
        if critical and levers[m].realtime is False and m in figures and figures[m].count:
            steps.append((m, REALTIME, True, f"{m} is latency-critical: its threads lifted "
                          "to real time"))
        elif not critical and levers[m].realtime and not baseline.get(m, levers[m]).realtime:
            steps.append((m, REALTIME, False, f"{m} is no longer latency-critical: its "
                          "threads put back"))
    return steps


def contended(levers: Mapping[str, Levers], configured: Mapping[str, Levers],
              figures: Mapping[str, Figures], cpus: int) -> bool:
    """The models with calls in this window ask, at ``configured``'s threads, for more
    intra-op threads than the ``cpus`` they may run on (0: unknown, never contended)."""
    busy = [m for m in levers if m in figures and figures[m].rate_rps > 0]
    return 0 < cpus < sum(configured.get(m, levers[m]).threads for m in busy)


def below(objectives: Mapping[str, Objective], levers: Mapping[str, Levers],
          than: int) -> list[str]:
    """The models of a lower class than ``than``, the least protected first."""
    return sorted((m for m in levers if rank(objectives, m) > than),
                  key=lambda m: (-rank(objectives, m), m))


def rank(objectives: Mapping[str, Objective], model: str) -> int:
    """A model without a qos is best effort: it yields to every model that has one."""
    objective = objectives.get(model)
    return objective.rank if objective is not None else len(CLASSES)


def service_class(objectives: Mapping[str, Objective], model: str) -> str:
    objective = objectives.get(model)
    return objective.service_class if objective is not None else "no qos"


def admit_relaxed(current: float, window: Figures | None, held: int) -> float | None:
    """The cap one relaxation step above ``current``: ``1 / ADMIT_STEP`` times it, and
    that again for each of the last ``held`` probes of it that held (up to three), so a
    cap the cause has left climbs back in a few steps rather than a dozen, while one at
    the edge (whose probes are undone) climbs as slowly as it came down.  None (no cap)
    where the cap does not bind (nothing refused) or the step admits every request the
    window offered (fewer refused than it adds to those served)."""
    if window is None or not window.rejections:
        return None
    grown = ADMIT_STEP ** -(1 + min(held, 3))
    if window.count and window.count * grown >= window.count + window.rejections:
        return None
    return round(current * grown, 3)


def admit_floor(objective: Objective | None) -> float:
    """The least admission a model is ever held to: its min_rps."""
    if objective is not None and objective.min_rps is not None:
        return max(objective.min_rps, ADMIT_FLOOR_RPS)
    return ADMIT_FLOOR_RPS
