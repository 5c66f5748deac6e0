"""The QoS controller's real-time lever against the simulated data plane: a co-located
load is met by lifting the latency-critical model's threads before any other model yields,
the lift comes back once every objective holds with margin (and after the others' levers),
and where the data plane has no such lever, or refuses it, the others yield as before."""

from __future__ import annotations

import itertools
from dataclasses import replace

from qos_sim import BE, LC, Sim, held, run, two_models

from agent.control.qos import ADMIT, QosController
from agent.control.qos_model import DELAY, REALTIME, Levers, Objective


def liftable(lift: bool | None = False, lc_class: str = "latency_critical"
             ) -> tuple[Sim, dict[str, Objective], dict[str, Levers]]:
    """LC at 20 rps beside BE at 12 (which it holds its objective beside), its threads
    liftable (``lift`` False), lifted at config.yaml (True) or not a lever (None)."""
    sim, objectives, baseline = two_models(lc_demand=20, be_demand=12)
    baseline = {LC: replace(baseline[LC], realtime=lift), BE: baseline[BE]}
    objectives[LC] = replace(objectives[LC], service_class=lc_class)
    sim.levers = dict(baseline)
    return sim, objectives, baseline


def test_a_co_located_load_is_met_by_the_lift_before_any_other_model_yields() -> None:
    """Half a core busy outside the agent: LC's delay goes, then its threads are lifted,
    and BE keeps its whole rate; where LC cannot be lifted, BE's admission is held."""
    sim, objectives, baseline = liftable()
    controller = QosController()
    run(controller, sim, objectives, baseline, 30)
    sim.foreign = 0.5
    trace = run(controller, sim, objectives, baseline, 60)
    tightened = [(a.model, a.lever) for a in sim.applied if a.tighten]
    assert tightened[:3] == [(LC, DELAY), (LC, DELAY), (LC, REALTIME)], tightened
    assert not [a for a in sim.applied if a.model == BE]
    assert sim.levers[BE].admit_rps is None
    # once lifted, LC misses only in the window after the lift was given back to see
    # whether it is still needed (and it is lifted again in that window)
    lifted = next(i for i, (_, d) in enumerate(trace) for a in d.actions if a.lever == REALTIME)
    dropped = {i + 1 for i, (_, d) in enumerate(trace) for a in d.actions
               if a.lever == REALTIME and not a.tighten}
    missed = {i for i, (f, _) in enumerate(trace) if i > lifted and f[LC].p99_ms > 12.0}
    assert missed and missed <= dropped, (missed, dropped)
    assert all(trace[i][1].actions[0].lever == REALTIME for i in missed)
    assert sim.applied[2].why.endswith("its threads lifted to real time")

    fixed, objectives, baseline = liftable(None)
    controller = QosController()
    run(controller, fixed, objectives, baseline, 30)
    fixed.foreign = 0.5
    run(controller, fixed, objectives, baseline, 60)
    assert not [a for a in fixed.applied if a.lever == REALTIME]
    assert fixed.levers[BE].admit_rps is not None  # without the lift, BE yields


def test_the_lift_comes_back_once_every_objective_holds_with_margin() -> None:
    """When the co-located load goes (and BE's traffic falls), the lift is given back
    before LC's own delay (its batching comes back last), and nothing is lifted that
    config.yaml lifted already."""
    sim, objectives, baseline = liftable()
    controller = QosController()
    run(controller, sim, objectives, baseline, 30)
    sim.foreign = 0.5
    run(controller, sim, objectives, baseline, 60)
    moved = len(sim.applied)
    sim.foreign, sim.demand[BE] = 0.0, 4.0
    trace = run(controller, sim, objectives, baseline, 200)
    relaxed = [(a.lever, a.after) for a in sim.applied[moved:]]
    assert relaxed[0] == (REALTIME, False) and relaxed[1][0] == DELAY, relaxed
    assert sim.levers[LC].realtime is False and sim.levers[LC].max_queue_delay_us > 1000
    assert held(trace, 12.0) == 1.0

    lifted, objectives, baseline = liftable(True)
    controller = QosController()
    run(controller, lifted, objectives, baseline, 30)
    lifted.foreign = 0.5
    run(controller, lifted, objectives, baseline, 90)
    assert not [a for a in lifted.applied if a.lever == REALTIME]


def test_under_a_load_that_stays_the_lift_is_probed_ever_more_rarely() -> None:
    """The lift holds LC with margin, so it is given back to see whether it is still
    needed; each time that fails, the next try waits longer."""
    sim, objectives, baseline = liftable()
    controller = QosController()
    run(controller, sim, objectives, baseline, 30)
    sim.foreign = 0.5
    trace = run(controller, sim, objectives, baseline, 400)
    drops = [i for i, (_, d) in enumerate(trace) for a in d.actions
             if a.lever == REALTIME and not a.tighten]
    gaps = [b - a for a, b in itertools.pairwise(drops)]
    assert len(drops) <= 6 and all(b > a for a, b in itertools.pairwise(gaps)), drops
    assert held(trace[-100:], 12.0) >= 0.97


def test_only_a_latency_critical_model_is_lifted_and_a_refused_lift_is_not_asked_again() -> None:
    """A throughput model's threads are never lifted (it does not outrank a co-located
    app); a lift the data plane refuses (no CAP_SYS_NICE, spinning workers) is passed over
    for ``refused_windows``, and BE yields instead."""
    sim, objectives, baseline = liftable(lc_class="throughput")
    controller = QosController()
    run(controller, sim, objectives, baseline, 30)
    sim.foreign = 0.5
    run(controller, sim, objectives, baseline, 60)
    assert not [a for a in sim.applied if a.lever == REALTIME]

    refusing, objectives, baseline = liftable()
    refusing.refuse = {REALTIME}
    controller = QosController()
    run(controller, refusing, objectives, baseline, 30)
    refusing.foreign = 0.5
    run(controller, refusing, objectives, baseline, 25)
    assert len(refusing.refused) == 1
    assert [a.model for a in refusing.applied if a.lever == ADMIT][:1] == [BE]
