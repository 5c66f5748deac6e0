"""The QoS controller's real-time lever against the simulated data plane: a
latency-critical model is lifted as soon as it serves, before any miss, so a co-located
load later costs it nothing and no other model yields; the lift stays while the model's
objective calls for it; where the data plane has no such lever, or refuses it, the others
yield as before; no model of another class is lifted."""

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


def test_a_latency_critical_model_is_lifted_as_it_serves_and_a_load_then_costs_nothing(
        ) -> None:
    """Lifted in its first window with calls, with no miss to wait for; half a core busy
    outside the agent later moves nothing: LC holds every window, BE keeps its whole rate.
    Where LC cannot be lifted, the same load costs LC windows and BE its admission."""
    sim, objectives, baseline = liftable()
    controller = QosController()
    first = run(controller, sim, objectives, baseline, 30)
    assert [(a.model, a.lever, a.after) for a in first[0][1].actions] == [(LC, REALTIME, True)]
    assert first[0][1].actions[0].why == f"{LC} is latency-critical: its threads lifted to " \
        "real time"
    sim.foreign = 0.5
    trace = run(controller, sim, objectives, baseline, 300)
    assert [a.lever for a in sim.applied if a.tighten] == [REALTIME]
    assert sim.levers[BE].admit_rps is None and sim.levers[LC].realtime is True
    assert held(trace, 12.0) == 1.0

    fixed, objectives, baseline = liftable(None)
    controller = QosController()
    run(controller, fixed, objectives, baseline, 30)
    fixed.foreign = 0.5
    trace = run(controller, fixed, objectives, baseline, 300)
    assert not [a for a in fixed.applied if a.lever == REALTIME]
    assert fixed.levers[BE].admit_rps is not None  # without the lift, BE yields
    assert held(trace, 12.0) < 1.0


def test_the_lift_stays_while_the_objective_calls_for_it_and_goes_when_it_does_not() -> None:
    """An idle model is not lifted; once lifted beside the load, LC holds with margin, but
    the lift stays (giving it back would return no power and no throughput, only misses);
    once LC's objective is removed it is put back in the next window; config.yaml's own
    lift is never moved."""
    sim, objectives, baseline = liftable()
    sim.demand[LC] = 0.0
    controller = QosController()
    run(controller, sim, objectives, baseline, 10)
    assert not sim.applied  # no calls: nothing to lift for
    sim.demand[LC], sim.foreign = 20.0, 0.5
    trace = run(controller, sim, objectives, baseline, 200)
    assert [(a.lever, a.tighten) for a in sim.applied][:1] == [(REALTIME, True)]
    assert sim.levers[LC].realtime is True
    assert not [a for a in sim.applied if a.lever == REALTIME and not a.tighten]
    assert held(trace[1:], 12.0) == 1.0  # the first window, before the lift, missed
    moved = len(sim.applied)
    run(controller, sim, {BE: objectives[BE]}, baseline, 2)  # qos: removed from LC's file
    assert [(a.lever, a.after, a.why) for a in sim.applied[moved:]] == [
        (REALTIME, False, f"{LC} is no longer latency-critical: its threads put back")]

    lifted, objectives, baseline = liftable(True)
    controller = QosController()
    run(controller, lifted, objectives, baseline, 30)
    lifted.foreign = 0.5
    run(controller, lifted, objectives, baseline, 90)
    assert not [a for a in lifted.applied if a.lever == REALTIME]


def test_only_a_latency_critical_model_is_lifted_and_a_refused_lift_is_not_asked_again() -> None:
    """A throughput model's threads are never lifted (it does not outrank a co-located
    app); a lift the data plane refuses (no CAP_SYS_NICE, spinning workers) is asked for
    again only after ``refused_windows``, and BE yields meanwhile."""
    sim, objectives, baseline = liftable(lc_class="throughput")
    controller = QosController()
    run(controller, sim, objectives, baseline, 30)
    sim.foreign = 0.5
    run(controller, sim, objectives, baseline, 60)
    assert not [a for a in sim.applied if a.lever == REALTIME]
    assert next(a.lever for a in sim.applied if a.tighten) == DELAY

    refusing, objectives, baseline = liftable()
    refusing.refuse = {REALTIME}
    controller = QosController()
    run(controller, refusing, objectives, baseline, 29)
    assert len(refusing.refused) == 1  # not asked again within refused_windows (30)
    refusing.foreign = 0.5
    run(controller, refusing, objectives, baseline, 25)
    assert len(refusing.refused) == 2  # asked again once they are over
    assert [a.model for a in refusing.applied if a.lever == ADMIT][:1] == [BE]
