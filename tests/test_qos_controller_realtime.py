"""The QoS controller's real-time lever against the simulated data plane: a co-located
load is met by lifting the latency-critical model's threads before any other model yields,
the lift stays while the model's objective calls for it, and where the data plane has no
such lever, or refuses it, the others yield as before."""

from __future__ import annotations

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
    trace = run(controller, sim, objectives, baseline, 300)
    tightened = [(a.model, a.lever) for a in sim.applied if a.tighten]
    assert tightened == [(LC, DELAY), (LC, DELAY), (LC, REALTIME)], tightened
    assert not [a for a in sim.applied if a.model == BE]
    assert sim.levers[BE].admit_rps is None and sim.levers[LC].realtime is True
    assert sim.applied[2].why.endswith("its threads lifted to real time")
    lifted = next(i for i, (_, d) in enumerate(trace) for a in d.actions if a.lever == REALTIME)
    assert held(trace[lifted + 1:], 12.0) == 1.0  # and it stays: no probe that misses

    fixed, objectives, baseline = liftable(None)
    controller = QosController()
    run(controller, fixed, objectives, baseline, 30)
    fixed.foreign = 0.5
    run(controller, fixed, objectives, baseline, 60)
    assert not [a for a in fixed.applied if a.lever == REALTIME]
    assert fixed.levers[BE].admit_rps is not None  # without the lift, BE yields


def test_the_lift_stays_while_the_objective_calls_for_it_and_goes_when_it_does_not() -> None:
    """Once lifted, LC holds with margin beside the co-located load: its batching comes
    back, but the lift stays (giving it back would return no power and no throughput, only
    a miss); once LC's objective is removed it is given back; config.yaml's own lift is
    never moved."""
    sim, objectives, baseline = liftable()
    controller = QosController()
    run(controller, sim, objectives, baseline, 30)
    sim.foreign = 0.5
    trace = run(controller, sim, objectives, baseline, 200)
    relaxed = [(a.lever, a.after) for a in sim.applied if not a.tighten]
    assert relaxed and all(lever == DELAY for lever, _ in relaxed), relaxed
    assert sim.levers[LC].realtime is True and sim.levers[LC].max_queue_delay_us > 1000
    assert held(trace[4:], 12.0) == 1.0
    run(controller, sim, {BE: objectives[BE]}, baseline, 100)  # qos: removed from LC's file
    assert sim.levers[LC] == baseline[LC]

    lifted, objectives, baseline = liftable(True)
    controller = QosController()
    run(controller, lifted, objectives, baseline, 30)
    lifted.foreign = 0.5
    run(controller, lifted, objectives, baseline, 90)
    assert not [a for a in lifted.applied if a.lever == REALTIME]


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
