"""A simulated data plane and device for the QoS controller's tests: a deterministic model of
each model's p99 from the CPU's load (the admitted rates times their costs), its queue delay
and preferred batch, the interference of a lower-class model's threads and CPUs, and the
device's latency ladder."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from agent.control.qos import QosController
from agent.control.qos_model import (
    REBUILT,
    RUNG,
    Action,
    Decision,
    Device,
    Figures,
    Levers,
    Objective,
)

LC, BE = "lc", "be"


@dataclass
class Sim:
    """p99 = cost / (1 - u) + the batching wait (the queue delay, or the time the
    preferred batch takes to fill, whichever is less) + ``extra_ms`` (a cause no lever of
    the others removes), u the CPU's load from every model's admitted rate; a request above
    a model's admission cap is refused.  BE's threads cost LC ``interference_ms`` at its
    configured threads and 10 requests a second (half once confined to other CPUs, in
    proportion to its threads and its rate up to 10);
    each rung of the device's ladder takes ``rung_gain`` off every cost; ``foreign`` cores
    busy outside the agent (a co-located app) add to u, and the controller is told them,
    with BE's client's (``client_cores_per_rps`` of each BE request admitted: a co-located
    process whose CPU follows what it is served, inside BE's cost here).  LC lifted to real
    time (``realtime``) runs before every thread of normal priority: its load is its own,
    and neither the others' threads nor the foreign cores delay it."""

    cost_ms: dict[str, float]
    demand: dict[str, float]
    levers: dict[str, Levers]
    cores: float = 1.0
    cliff: float = 1.0  # a load above it costs every model 50 ms more (memory saturates)
    # the window a move falls in still holds a request served as before it (the worse p99)
    mixed: bool = False
    extra_ms: float = 0.0
    foreign: float | None = None
    client_cores_per_rps: float = 0.0
    outside: float | None = None  # what the controller is told this window
    interference_ms: float = 0.0
    device: Device | None = None
    rung_gain: float = 0.1
    applied: list[Action] = field(default_factory=list)
    refuse: set[str] = field(default_factory=set)  # levers this data plane does not have
    refused: list[Action] = field(default_factory=list)
    rebuilds: int = 0  # windows a rebuild still takes, once one is asked for
    rebuild_ms: float = 0.0  # LC's p99 rises this much in the window a rebuild runs in
    _building: bool = False
    _before: dict[str, Figures] = field(default_factory=dict)
    _rebuilding: dict[str, int] = field(default_factory=dict)

    def window(self) -> dict[str, Figures]:
        admitted = {m: min(d, self.levers[m].admit_rps or d) for m, d in self.demand.items()}
        gain = 1 - self.rung_gain * (self.device.rung if self.device else 0)
        load = min(0.98, (sum(admitted[m] * self.cost_ms[m] * gain / 1000 for m in admitted)
                          + (self.foreign or 0.0)) / self.cores)
        self.outside = None if self.foreign is None and not self.client_cores_per_rps else (
            (self.foreign or 0.0) + self.client_cores_per_rps * admitted.get(BE, 0.0))
        figures: dict[str, Figures] = {}
        for model, rate in admitted.items():
            levers = self.levers[model]
            fill_ms = ((levers.preferred_batch_size - 1) / rate * 1000
                       if rate and levers.preferred_batch_size > 1 else 0.0)
            wait = min(levers.max_queue_delay_us / 1000, fill_ms)
            lifted = model == LC and bool(levers.realtime)
            seen = min(0.98, rate * self.cost_ms[model] * gain / 1000 / self.cores
                       ) if lifted else load
            p99 = self.cost_ms[model] * gain / (1 - seen) + wait + (
                50 if load > self.cliff else 0)
            if model == LC:
                p99 += self.extra_ms + (0.0 if lifted else self._interference(admitted)) + (
                    self.rebuild_ms if self._building else 0.0)
            figures[model] = Figures(p99_ms=round(p99, 3), queue_ms=wait, rate_rps=rate,
                                     rejections=round(self.demand[model] - rate),
                                     count=round(rate))
        if self.mixed and self._before:
            figures = {m: max(f, self._before.get(m, f), key=lambda g: g.p99_ms)
                       for m, f in figures.items()}
            self._before = {}
        self._building = False
        self._tick()
        return figures

    def _interference(self, admitted: dict[str, float]) -> float:
        be = self.levers[BE]
        if not self.interference_ms or not admitted.get(BE) or not be.threads:
            return 0.0
        share = be.threads / CONFIGURED_BE_THREADS * min(1.0, admitted[BE] / 10)
        return self.interference_ms * share * (0.5 if be.cpus is not None else 1.0)

    def _tick(self) -> None:
        for model, left in list(self._rebuilding.items()):
            if left <= 1:
                del self._rebuilding[model]
                self.levers[model] = replace(self.levers[model], rebuilding=False)
            else:
                self._rebuilding[model] = left - 1

    def apply(self, decision: Decision) -> None:
        if decision.actions and self.mixed:
            self._before = self.window()
        for action in decision.actions:
            if action.lever == RUNG:
                assert self.device is not None and isinstance(action.after, int)
                self.device = replace(self.device, rung=action.after)
            else:
                changed = self.levers[action.model].set(action.lever, action.after)
                self._building = self._building or action.lever in REBUILT
                if action.lever in REBUILT and self.rebuilds:
                    changed = replace(changed, rebuilding=True)
                    self._rebuilding[action.model] = self.rebuilds
                self.levers[action.model] = changed
            self.applied.append(action)


CONFIGURED_BE_THREADS = 4


def two_models(lc_demand: float = 50, be_demand: float = 10, lc_p99: float = 12.0,
               be_threads: int = 0) -> tuple[Sim, dict[str, Objective], dict[str, Levers]]:
    baseline = {LC: Levers(4000, 8), BE: Levers(2000, 4, threads=be_threads)}
    sim = Sim({LC: 5.0, BE: 25.0}, {LC: lc_demand, BE: be_demand}, dict(baseline))
    objectives = {LC: Objective("latency_critical", p99_ms=lc_p99),
                  BE: Objective("best_effort", min_rps=5)}
    return sim, objectives, baseline


def run(controller: QosController, sim: Sim, objectives: dict[str, Objective],
        baseline: dict[str, Levers], windows: int, cpus: int = 0, told: bool = True
        ) -> list[tuple[dict[str, Figures], Decision]]:
    """``told``: the controller is given the foreign load (else only its effect)."""
    trace = []
    for _ in range(windows):
        figures = sim.window()
        decision = controller.decide(figures, objectives, dict(sim.levers), baseline,
                                     sim.device, cpus, sim.outside if told else None)
        for action in [a for a in decision.actions if a.lever in sim.refuse]:
            controller.refused(action)  # as the service does when the plane says no
            decision.actions.remove(action)
            sim.refused.append(action)
        sim.apply(decision)
        trace.append((figures, decision))
    return trace


def held(trace: list[tuple[dict[str, Figures], Decision]], limit: float) -> float:
    return sum(f[LC].p99_ms <= limit for f, _ in trace) / len(trace)
