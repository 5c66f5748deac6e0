"""The QoS controller's slower levers against the simulated data plane and device: a lower
class's threads (rebuilt off the hot path: windows not judged until swapped) and CPUs, the
device's latency ladder (within its rungs, never while it throttles), relaxation costliest
first, and steps on others given back when their trial shows they did not help."""

from __future__ import annotations

import math
import random

import pytest
from qos_sim import BE, CONFIGURED_BE_THREADS, LC, held, run, two_models

from agent.control.qos import ADMIT, CPUS, RUNG, THREADS, Device, Levers, QosController


def test_after_admission_at_its_floor_the_other_models_threads_then_cpus_then_the_device() -> None:
    """BE at its min_rps still costs LC more than its objective allows (its threads take the
    CPU's caches and cores): BE's threads are halved, then it is confined to the second
    half of the CPUs, then the device's ladder goes up one rung at a time, and never past
    its last rung."""
    sim, objectives, baseline = two_models(be_demand=30, lc_p99=12.0,
                                           be_threads=CONFIGURED_BE_THREADS)
    sim.interference_ms, sim.device = 40.0, Device(rung=0, rungs=3)
    trace = run(QosController(), sim, objectives, baseline, 120, cpus=4)
    kinds = [a.lever for a in sim.applied if a.tighten]
    assert kinds.index(ADMIT) < kinds.index(THREADS) < kinds.index(CPUS)
    threads = [a for a in sim.applied if a.lever == THREADS]
    assert [(a.model, a.before, a.after) for a in threads] == [(BE, 4, 2), (BE, 2, 1)]
    assert sim.levers[BE].cpus == (2, 3)
    placed = next(a for a in sim.applied if a.lever == CPUS and a.tighten)
    assert placed.why.endswith(f"{BE} confined to CPUs 2-3"), placed.why
    assert sim.levers[BE].admit_rps == 5
    assert held(trace[-30:], 12.0) == 1.0
    rungs = [a for a in sim.applied if a.lever == RUNG]
    assert all(a.model == LC and a.serves == LC for a in rungs)
    assert sim.device is not None and 0 <= sim.device.rung <= 2


def test_the_ladder_stops_at_its_last_rung_and_never_moves_while_the_device_throttles() -> None:
    sim, objectives, baseline = two_models(lc_p99=3.0)
    sim.device = Device(rung=0, rungs=3)
    controller = QosController()
    run(controller, sim, objectives, baseline, 100)
    assert sim.device.rung == 2, "the ladder was not climbed to its top"
    assert all(a.after in (1, 2) for a in sim.applied if a.lever == RUNG)
    sim2, objectives2, baseline2 = two_models(lc_p99=3.0)
    sim2.device = Device(rung=0, rungs=3, throttled=True)
    trace = run(QosController(), sim2, objectives2, baseline2, 100)
    assert not [a for a in sim2.applied if a.lever == RUNG]
    assert set(trace[-1][1].unmet) == {LC}


def test_a_rebuild_is_not_judged_until_it_is_swapped_in() -> None:
    """Threads take a rebuild (here 4 windows): no lever moves while one is under way, so
    one rebuild's effect is judged before the next step."""
    sim, objectives, baseline = two_models(be_demand=30, be_threads=CONFIGURED_BE_THREADS)
    sim.interference_ms, sim.rebuilds = 40.0, 4
    controller = QosController()
    windows = []
    for window in range(150):
        rebuilding = any(levers.rebuilding for levers in sim.levers.values())
        figures = sim.window()
        decision = controller.decide(figures, objectives, dict(sim.levers), baseline,
                                     None, 4)
        if rebuilding:
            windows.append(window)
            assert not decision.actions, "a lever moved while a rebuild was under way"
        sim.apply(decision)
    assert len(windows) >= 8, "no rebuild was asked for"


def test_a_relaxed_rebuild_is_judged_once_swapped_not_by_its_own_build() -> None:
    """A rebuild that swaps within the window after it was asked for (the data plane's
    usual one) takes the CPU in that window, and LC misses there (``rebuild_ms``).  That
    window is the build's, not the probe's: once the interference has gone, BE's threads
    come back to config.yaml's, each step in one relaxation.  Judged as a probe, each such
    window undid the relaxation it was built for, and BE stayed at one thread."""
    sim, objectives, baseline = two_models(be_demand=30, be_threads=CONFIGURED_BE_THREADS)
    sim.interference_ms = 40.0
    controller = QosController()
    run(controller, sim, objectives, baseline, 120, cpus=4)
    assert sim.levers[BE].threads == 1 and sim.levers[BE].cpus is not None
    moved = len(sim.applied)
    sim.interference_ms, sim.demand[BE], sim.rebuild_ms = 0.0, 2, 30.0
    run(controller, sim, objectives, baseline, 300, cpus=4)
    assert sim.levers[BE] == baseline[BE]
    rebuilt = [(a.lever, a.before, a.after, a.tighten) for a in sim.applied[moved:]
               if a.lever in (THREADS, CPUS)]
    assert rebuilt == [(CPUS, (2, 3), None, False), (THREADS, 1, 2, False),
                       (THREADS, 2, 4, False)], rebuilt


@pytest.mark.parametrize(("cpus", "order"), [(8, (RUNG, CPUS, THREADS, ADMIT)),
                                             (2, (RUNG, ADMIT, CPUS, THREADS))])
def test_relaxation_gives_the_device_back_first_then_the_others_in_reverse(
        cpus: int, order: tuple[str, ...]) -> None:
    """Relaxing walks the tightening order back: CPUs, threads, then admission; where BE's
    four threads outnumber the CPUs (contended, tightened threads first) its admission
    comes back before its threads and CPUs."""
    sim, objectives, baseline = two_models(be_demand=30, be_threads=CONFIGURED_BE_THREADS)
    sim.interference_ms, sim.device = 6.0, Device(rung=0, rungs=2)
    sim.extra_ms = 4.0
    controller = QosController()
    run(controller, sim, objectives, baseline, 150, cpus=cpus)
    assert sim.device.rung == 1 and sim.levers[BE].threads == 1
    assert sim.levers[BE].admit_rps is not None
    sim.demand[BE], sim.extra_ms = 2, 0.0
    run(controller, sim, objectives, baseline, 600, cpus=cpus)
    relaxed = [a.lever for a in sim.applied if not a.tighten]
    firsts = [relaxed.index(lever) for lever in order]
    assert firsts == sorted(firsts), relaxed
    assert sim.levers[BE] == baseline[BE] and sim.device.rung == 0


def test_where_threads_outnumber_the_cpus_the_others_threads_come_before_admission() -> None:
    """BE's four threads on two CPUs (ORT's workers spin): its threads are halved before
    its admission is held, and with the interference gone at one thread it keeps its whole
    rate (no cap is ever set); on eight CPUs admission comes first, as its cost says."""
    sim, objectives, baseline = two_models(be_demand=8, be_threads=CONFIGURED_BE_THREADS)
    sim.interference_ms = 12.0
    trace = run(QosController(), sim, objectives, baseline, 50, cpus=2)  # before a probe
    kinds = [a.lever for a in sim.applied if a.tighten and a.model == BE]
    assert kinds[:2] == [THREADS, THREADS], kinds
    assert ADMIT not in kinds and sim.levers[BE].admit_rps is None
    assert held(trace[-20:], 12.0) == 1.0
    sim, objectives, baseline = two_models(be_demand=8, be_threads=CONFIGURED_BE_THREADS)
    sim.interference_ms = 12.0
    run(QosController(), sim, objectives, baseline, 60, cpus=8)
    kinds = [a.lever for a in sim.applied if a.tighten and a.model == BE]
    assert kinds[0] == ADMIT, kinds


def test_a_step_on_others_that_did_not_help_is_given_back_and_then_nothing_moves() -> None:
    """LC misses for a cause of its own (``extra_ms``) that BE's traffic does not make: BE
    is held while the controller tries, its trials show no gain, so its admission comes back
    in full (the chain of notches at once), LC is unmet, and then nothing moves until the
    lever is due again (its wait doubled for each notch given back: 240 windows by now)."""
    sim, objectives, baseline = two_models(be_demand=10)
    sim.cost_ms[BE] = 1.0  # BE is light: holding it frees next to nothing
    sim.extra_ms = 30.0
    controller = QosController()
    trace = run(controller, sim, objectives, baseline, 120)
    assert any(a.lever == ADMIT and a.tighten for a in sim.applied), "BE was never held"
    assert sim.levers[BE].admit_rps is None, "BE's admission was not given back"
    released = [a for a in sim.applied if a.lever == ADMIT and not a.tighten]
    assert released and all("did not help" in a.why and a.serves == LC for a in released)
    assert set(trace[-1][1].unmet) == {LC}
    moves = len(sim.applied)
    run(controller, sim, objectives, baseline, 180)
    assert len(sim.applied) == moves, "levers moved after the release"


def test_two_stalls_among_four_windows_set_off_a_step_that_is_given_back() -> None:
    """LC holds without margin (~0.85 of its objective) whatever BE does.  Two stalled
    windows among four (the machine's, not BE's) set off a step on BE's admission; a third
    stall in its trial windows leaves LC's level (its windows but the worst) where it was:
    the cap is given back once its 4 windows are in, and passed over when the next two
    stalls come.  Without the trial the cap stayed (and went down a step at the second
    pair) until a probe, 50 holding windows later."""
    sim, objectives, baseline = two_models(be_demand=10, lc_p99=8.0)
    sim.levers[LC] = baseline[LC] = Levers(0, 8)  # no delay of its own to take first
    sim.cost_ms[BE] = 1.0  # light: holding it changes LC's p99 by next to nothing
    controller = QosController()
    stalls, capped = {5, 7, 12, 20, 22, 27}, []
    for window in range(40):
        sim.extra_ms = 12.0 if window in stalls else 0.0
        run(controller, sim, objectives, baseline, 1)
        capped.append(sim.levers[BE].admit_rps is not None)
    assert capped[8], "two stalls among four windows set off no step"
    assert sum(capped) <= 8 and not capped[-1], capped
    assert [a.lever for a in sim.applied if a.tighten] == [ADMIT]
    (back,) = [a for a in sim.applied if not a.tighten]
    assert (back.before, back.after) == (7.0, None) and "did not help" in back.why


def test_a_step_after_which_no_window_misses_stays_though_the_level_did_not_move() -> None:
    """Misses that come and go (two windows of four) leave the level, without the worst
    window, below the objective: judged by the level alone, a cap after which no window
    missed 'did not help' and was given back, and the misses came back (a new operator's
    review of the README's example).  No miss in its 4 windows keeps it."""
    sim, objectives, baseline = two_models(be_demand=10, lc_p99=8.0)
    sim.levers[LC] = baseline[LC] = Levers(0, 8)
    sim.cost_ms[BE] = 1.0
    controller = QosController()
    for window in range(40):
        sim.extra_ms = 12.0 if window in (5, 7) else 0.0
        run(controller, sim, objectives, baseline, 1)
    assert [(a.lever, a.tighten) for a in sim.applied] == [(ADMIT, True)]
    assert sim.levers[BE].admit_rps == 7.0


def test_a_lever_passed_over_is_tried_again_when_its_time_is_out_even_if_unmet() -> None:
    """Stalls of the machine's fall in the windows that judge BE's cap: it is given back as
    no help, and LC, with no other lever left, is unmet.  Then BE's traffic triples, a
    cause the cap does remove, though LC's p99 level rises less than 1.5x.  Once the cap's
    time out (30 windows) is over it is tried again and LC holds.  Before, unmet stopped
    every move until a window held: LC stayed unmet and BE uncapped for good."""
    sim, objectives, baseline = two_models(be_demand=6)
    controller = QosController()
    for window in range(30):
        sim.extra_ms = 10.0 if window in (3, 6, 8, 10, 11) else 0.0
        run(controller, sim, objectives, baseline, 1)
    (back,) = [a for a in sim.applied if a.lever == ADMIT and not a.tighten]
    assert "did not help" in back.why and sim.levers[BE].admit_rps is None
    sim.extra_ms, sim.demand[BE] = 0.0, 18
    trace = run(controller, sim, objectives, baseline, 60)
    assert sim.levers[BE].admit_rps is not None and sim.levers[BE].admit_rps >= 5
    assert held(trace[-20:], 12.0) == 1.0 and not trace[-1][1].unmet


def test_one_stalled_window_in_six_does_not_hold_the_relaxation_back() -> None:
    """After a burst of BE's, LC holds with margin but for one stalled window in every six
    (the machine's: no lever of BE's makes it).  Its level (its last windows but the worst)
    keeps the margin, so BE's cap comes back within 30 windows.  Counted window by window,
    each stall started the wait again and BE stayed capped for good; and a probe a stall
    undid kept that lever from the next probes for ten times the wait (140 windows)."""
    sim, objectives, baseline = two_models(be_demand=30)
    controller = QosController()
    run(controller, sim, objectives, baseline, 120)
    assert sim.levers[BE].admit_rps is not None
    sim.demand[BE] = 4
    for window in range(30):
        sim.extra_ms = 12.0 if window % 6 == 0 else 0.0
        run(controller, sim, objectives, baseline, 1)
    assert sim.levers[BE].admit_rps is None


def test_stalls_in_a_quarter_of_the_windows_do_not_keep_best_effort_capped() -> None:
    """The same with stalls at random in a quarter of the windows (seeded): they undo some
    probes, each of which doubles the wait.  A lever a stall undid is probed again after
    twice the wait, and a probe of it that holds halves the wait again, so the cap still
    comes back.  Before, an undone lever waited ten times the wait and the wait only grew:
    the cap stayed at BE's floor for all 300 windows."""
    sim, objectives, baseline = two_models(be_demand=30)
    controller = QosController()
    run(controller, sim, objectives, baseline, 120)
    sim.demand[BE], stalls = 4, random.Random(0)
    for _ in range(300):
        sim.extra_ms = 12.0 if stalls.random() < 0.25 else 0.0
        run(controller, sim, objectives, baseline, 1)
    assert sim.levers[BE].admit_rps is None


def test_a_lever_that_did_not_help_is_tried_again_once_the_p99_rises() -> None:
    """Held at a p99 BE does not make, BE's cap is given back and passed over; when BE's
    traffic then grows into what LC misses by, the cap is tried again, helps, and stays."""
    sim, objectives, baseline = two_models(be_demand=10)
    sim.cost_ms[BE], sim.extra_ms = 1.0, 30.0
    controller = QosController()
    run(controller, sim, objectives, baseline, 60)
    assert sim.levers[BE].admit_rps is None
    given_back = len(sim.applied)
    sim.cost_ms[BE], sim.extra_ms, sim.demand[BE] = 25.0, 0.0, 30.0  # now BE is the cause
    trace = run(controller, sim, objectives, baseline, 60)
    caps = [a for a in sim.applied[given_back:] if a.lever == ADMIT and a.tighten]
    assert caps, "the cap that did not help before was never tried again"
    assert sim.levers[BE].admit_rps is not None and sim.levers[BE].admit_rps >= 5
    assert held(trace[10:], 12.0) >= 0.95


def test_levers_that_helped_stay_held_when_unmet() -> None:
    """The same, but BE's load is what LC misses by: holding it helped, so it stays held."""
    sim, objectives, baseline = two_models(lc_p99=3.0)
    run(QosController(), sim, objectives, baseline, 120)
    assert sim.levers[BE].admit_rps == 5
    assert not [a for a in sim.applied if a.lever == ADMIT and not a.tighten]


def test_objectives_held_without_margin_still_give_best_effort_back_in_probes() -> None:
    """After a burst, LC holds at ~85 % of its objective whatever BE does (a cause of its
    own): the margin is never there, yet BE's cap comes back through probes, spaced further
    apart each time one fails, and at most 1 % of windows violate."""
    sim, objectives, baseline = two_models(be_demand=30)
    controller = QosController()
    run(controller, sim, objectives, baseline, 60)
    assert sim.levers[BE].admit_rps is not None
    sim.demand[BE], sim.cost_ms[BE] = 12, 2.0  # BE now light: its cap costs it for nothing
    sim.extra_ms = 4.5
    trace = run(controller, sim, objectives, baseline, 400)
    assert sim.levers[BE].admit_rps is None, "BE's cap was never given back"
    assert held(trace, 12.0) >= 0.99


def test_once_a_probe_without_margin_holds_the_next_ones_come_at_the_plain_wait() -> None:
    """A burst takes BE's cap down three steps; the last two, taken while LC's p99 stayed
    at a cause of its own (``extra_ms``), did not help and are given back together; then
    LC holds at ~90 % of its objective
    (never with margin) while BE asks for six times its cap.  The first probe waits the
    long wait (ten times the relax wait); once one held, the next wait the plain one, and
    each raises the cap by more, so it is gone within twenty windows of that first probe.
    Before, every probe waited the long wait, and the cap was not back after 400 windows."""
    sim, objectives, baseline = two_models(be_demand=30)
    controller = QosController()
    run(controller, sim, objectives, baseline, 60)
    sim.demand[BE], sim.cost_ms[BE], sim.extra_ms = 60, 1.0, 20.0
    run(controller, sim, objectives, baseline, 6)
    assert sim.levers[BE].admit_rps == 5.042
    sim.extra_ms = 4.5
    trace = run(controller, sim, objectives, baseline, 400)
    moves = [(i, a.why, a.after) for i, (_, d) in enumerate(trace) for a in d.actions
             if a.lever == ADMIT]
    backs = [after for _, why, after in moves if "did not help" in why]
    assert backs == [10.29], moves
    probes = [(i, why) for i, why, _ in moves if "did not help" not in why]
    assert {why for _, why in probes} == {"every objective holds, not all with margin: a probe"}
    first, last = probes[0][0], probes[-1][0]
    assert first >= 50 and last - first <= 20, probes
    assert sim.levers[BE].admit_rps is None
    assert held(trace, 12.0) == 1.0


def test_a_lever_the_data_plane_refuses_is_not_asked_for_every_window() -> None:
    """A data plane without placement (or a device whose kernel refuses the floor): the
    refused lever is left out for a while, so the controller goes on to the next step (here
    none: unmet) instead of asking again each window."""
    sim, objectives, baseline = two_models(be_demand=30, be_threads=CONFIGURED_BE_THREADS)
    sim.interference_ms, sim.refuse = 200.0, {CPUS}
    trace = run(QosController(), sim, objectives, baseline, 200, cpus=2)
    assert 1 <= len(sim.refused) <= 200 // 30 + 1, sim.refused
    assert set(trace[-1][1].unmet) == {LC}
    assert sim.levers[BE].cpus is None


def test_a_model_stays_unmet_while_a_lever_passed_over_is_tried_again() -> None:
    """A cause no lever removes (20 ms on every LC request): BE's cap is no help, given back,
    and LC is unmet, with the best p99 of its last windows.  Each time the cap's time out
    is over it is tried again; LC stays unmet through those tries (one qos_unmet, one status
    line for the whole episode).  Before, each try cleared it and the next exhaustion was a
    new episode: status and telemetry said nothing while LC missed by 2x."""
    sim, objectives, baseline = two_models(be_demand=6)
    sim.extra_ms = 20.0
    trace = run(QosController(), sim, objectives, baseline, 200)
    first = next(i for i, (_, d) in enumerate(trace) if LC in d.unmet)
    assert trace[first][1].unmet[LC].best_p99_ms == min(f[LC].p99_ms for f, _ in
                                                        trace[first - 3:first + 1])
    tries = [a for a in sim.applied if a.lever == ADMIT and a.tighten]
    assert len(tries) >= 3, sim.applied  # the first, and tries after the time outs
    assert held(trace, 12.0) == 0.0
    assert all(LC in d.unmet for _, d in trace[first:])


def test_caps_on_others_are_not_kept_for_misses_of_a_cause_that_comes_and_goes() -> None:
    """LC sits at ~95 % of its objective from a cause of its own whose windows scatter
    (lognormal, as a co-located app makes them in bench/qos.py's hog phase), and BE is so
    light that its cap frees next to nothing.  BE's cap is taken a notch further before
    the last notch's trial ends; the notches are judged as one, by the first one's windows,
    and given back together.  Before, each notch gave the chain another run of windows in
    which to look helpful by chance, and BE kept a third of its demand; now about a half."""
    shares, chains = [], 0
    for seed in range(10):
        sim, objectives, baseline = two_models(be_demand=20)
        sim.cost_ms[BE] = 1.0
        noise, controller, served = random.Random(seed), QosController(), 0.0
        for _ in range(200):
            sim.extra_ms = max(0.0, 12.0 * 0.95 * math.exp(noise.gauss(0, 0.21)) - 6.8)
            served += run(controller, sim, objectives, baseline, 1)[-1][0][BE].rate_rps
        shares.append(served / (20 * 200))
        backs = [a for a in sim.applied if a.lever == ADMIT and "did not help" in a.why]
        chains += sum(a.after is None or a.after > a.before / 0.7 ** 1.5 for a in backs)
    assert sum(shares) / len(shares) >= 0.42, shares
    assert chains >= 5  # given back more than one notch at once
