"""``model tune``'s parts that need no data plane: the grid and its limits, the config.yaml a
candidate makes, coordinate descent against a deterministic model of latency and throughput,
the percentile, and the config.yaml kept beside a tuned one."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.modeltune import configfile
from agent.modeltune.load import Sample
from agent.modeltune.measure import MIN_RECORDED, recorded_rate
from agent.modeltune.search import Result, choose, coordinate_descent, exhaustive, pareto
from agent.modeltune.space import (
    Candidate,
    SpaceError,
    default_space,
    grid,
    parse_space,
    with_candidate,
)


def test_the_default_space_follows_the_cpus_and_batching() -> None:
    assert default_space(6, True) == {"threads": (1, 2, 4, 6), "count": (1, 2),
                                      "max_batch_size": (1, 4, 8),
                                      "max_queue_delay_us": (0, 500, 2000)}
    assert default_space(8, False) == {"threads": (1, 2, 4, 8), "count": (1, 2, 4),
                                       "max_batch_size": (0,), "max_queue_delay_us": (0,)}


def test_the_grid_keeps_the_thread_rule_and_gives_a_batch_of_one_no_delay() -> None:
    space = {"threads": (1, 2, 4), "count": (1, 2), "max_batch_size": (1, 4),
             "max_queue_delay_us": (0, 500)}
    points = grid(space, 2)  # at most 4 threads in all
    assert Candidate(4, 2, 4, 0) not in points and Candidate(2, 2, 4, 500) in points
    assert [p for p in points if p.max_batch_size == 1 and p.max_queue_delay_us] == []
    assert len(points) == 5 * 3  # (t, c) pairs within 4 threads x (batch 1; batch 4 x 2)


def test_space_flags_replace_one_dimension_each() -> None:
    base = default_space(4, True)
    space = parse_space(["batch=8,2,8", "delay_us=0"], base, True)
    assert space["max_batch_size"] == (2, 8) and space["max_queue_delay_us"] == (0,)
    assert space["threads"] == base["threads"]
    with pytest.raises(SpaceError, match="first dimension is fixed"):
        parse_space(["batch=4"], default_space(4, False), False)
    with pytest.raises(SpaceError, match=r"expected 1 to 16 integers 0\.\.10000000"):
        parse_space(["delay_us=a"], base, True)


def test_a_candidate_sets_its_keys_and_keeps_the_others() -> None:
    original = {"max_run_ms": 100, "instances": [{"count": 3, "device": "cpu"}],
                "dynamic_batching": {"preferred_batch_size": [2, 8], "priority_levels": 2}}
    assert with_candidate(original, Candidate(2, 1, 4, 100), "cpu") == {
        "max_run_ms": 100, "max_batch_size": 4,
        "instances": [{"count": 1, "threads": 2, "device": "cpu"}],
        "dynamic_batching": {"preferred_batch_size": [2], "priority_levels": 2,
                             "max_queue_delay_us": 100}}
    assert with_candidate(original, Candidate(1, 1, 0, 0), None) == {
        "max_run_ms": 100, "max_batch_size": 0, "instances": [{"count": 1, "threads": 1}]}


def model(candidate: Candidate) -> Result:
    """A device of 4 CPUs: throughput grows with batch and instances up to the CPUs, p99 with
    the batch and its queue delay; the best within 20 ms is 2 x 2 threads, batch 8."""
    used = min(4, candidate.count * candidate.threads)
    batch = max(1, candidate.max_batch_size)
    rps = 100.0 * used * (1 + 0.2 * (batch - 1)) - (250 if candidate.threads > 2 else 0)
    p99 = 2.0 * batch + candidate.max_queue_delay_us / 1000 + 4.0 / candidate.threads
    met = p99 <= 20.0
    return Result(candidate, p99, rps, rps if met else 0.0, met, "model")


def test_coordinate_descent_finds_the_grid_best_measuring_part_of_it() -> None:
    space = default_space(4, True)
    points = grid(space, 4)
    full = exhaustive(points, model)
    best = choose(full)
    assert best.candidate == Candidate(2, 2, 8, 0)
    seen: list[Candidate] = []

    def measured(candidate: Candidate) -> Result:
        seen.append(candidate)
        return model(candidate)

    quick = coordinate_descent(space, 4, measured, lambda: False)
    assert choose(quick).candidate == best.candidate
    assert len(seen) == len(set(seen)) < len(points) // 2  # none twice; under half the grid


def test_a_batch_is_tried_with_a_wait_since_without_one_it_seldom_forms() -> None:
    def no_wait_no_batch(candidate: Candidate) -> Result:
        batch = candidate.max_batch_size if candidate.max_queue_delay_us else 1
        rps = 100.0 * batch
        p99 = 2.0 + candidate.max_queue_delay_us / 1000
        return Result(candidate, p99, rps, rps, True, "model")

    space = {"threads": (1,), "count": (1,), "max_batch_size": (1, 4),
             "max_queue_delay_us": (0, 500, 2000)}
    results = coordinate_descent(space, 2, no_wait_no_batch, lambda: False)
    assert choose(results).candidate == Candidate(1, 1, 4, 500)
    assert Candidate(1, 1, 4, 0) in [r.candidate for r in results]  # the delay's sweep


def test_in_a_closed_loop_a_batch_is_tried_without_a_wait_and_no_delay_is_swept() -> None:
    """Clients queued behind a running batch form the next one, so a wait only adds to it:
    a closed loop's descent sweeps the batch first, at the delay of 0, and no delay (the
    exhaustive search measures them); where the space has no 0, its smallest delay."""
    def queued(candidate: Candidate) -> Result:
        rps = 100.0 * (1 + 0.5 * (candidate.max_batch_size > 1)) * (
            1 - candidate.max_queue_delay_us / 4000)
        return Result(candidate, 2.0, rps, rps, True, "model")

    space = {"threads": (1,), "count": (1,), "max_batch_size": (1, 4),
             "max_queue_delay_us": (0, 500, 2000)}
    seen = [r.candidate for r in coordinate_descent(space, 2, queued, lambda: False,
                                                    waits=False)]
    assert seen == [Candidate(1, 1, 1, 0), Candidate(1, 1, 4, 0)]
    space = {**space, "threads": (1, 2), "max_queue_delay_us": (500, 2000)}
    seen = [r.candidate for r in coordinate_descent(space, 2, queued, lambda: False,
                                                    waits=False)]
    assert seen == [Candidate(2, 1, 1, 0), Candidate(2, 1, 4, 500), Candidate(1, 1, 4, 500)]


def test_a_gain_within_measuring_noise_is_chosen_but_not_moved_to() -> None:
    """Batch 4 serves 5 % more than batch 1: above a tie, so it is the choice, but below
    MOVE, so the descent stays at batch 1 and measures no delay beside batch 4, nor any
    point of a second pass."""
    def slight(candidate: Candidate) -> Result:
        rps = 100.0 * (1.05 if candidate.max_batch_size > 1 else 1.0) * (
            1.2 if candidate.threads > 1 else 1.0)
        return Result(candidate, 2.0, rps, rps, True, "model")

    space = {"threads": (1, 2), "count": (1,), "max_batch_size": (1, 4),
             "max_queue_delay_us": (0, 500)}
    results = coordinate_descent(space, 1, slight, lambda: False, waits=False)
    assert [r.candidate for r in results] == [Candidate(2, 1, 1, 0), Candidate(2, 1, 4, 0),
                                              Candidate(1, 1, 1, 0)]
    assert choose(results).candidate == Candidate(2, 1, 4, 0)


def test_the_budget_stops_the_descent_after_the_first_measurement() -> None:
    results = coordinate_descent(default_space(4, True), 4, model, lambda: True)
    assert [r.candidate for r in results] == [Candidate(4, 1, 1, 0)]  # the start point


def test_choose_prefers_met_then_goodput_then_the_lower_p99_among_ties() -> None:
    a, b, c = Candidate(1, 1, 1, 0), Candidate(2, 1, 1, 0), Candidate(4, 1, 1, 0)
    assert choose([Result(a, 30, 500, 10, False, ""), Result(b, 9, 100, 100, True, "")]
                  ).candidate == b
    assert choose([Result(a, 9, 100, 100, True, ""), Result(b, 5, 99, 99, True, ""),
                   Result(c, 1, 50, 50, True, "")]).candidate == b


def test_p99_is_the_nearest_rank_and_goodput_counts_within_the_limit() -> None:
    sample = Sample([i / 1000 for i in range(1, 201)], 0, 2.0)  # 1..200 ms over 2 s
    assert sample.p99_ms() == pytest.approx(198.0)
    assert sample.throughput_rps() == 100.0
    assert sample.within_rps(50) == 25.0 and sample.within_rps(None) == 100.0
    assert Sample().p99_ms() == float("inf") and Sample().throughput_rps() == 0.0


def test_a_second_tune_keeps_the_first_original_for_rollback(tmp_path: Path) -> None:
    directory = tmp_path / "m"
    directory.mkdir()
    (directory / "config.yaml").write_bytes(b"max_run_ms: 7\n# mine\n")
    (directory / "config.yaml").chmod(0o640)
    configfile.write_tuned(directory, b"max_batch_size: 4\n", b"max_run_ms: 7\n# mine\n")
    with pytest.raises(configfile.ChangedError, match="changed while model tune measured"):
        configfile.write_tuned(directory, b"max_batch_size: 8\n", b"max_run_ms: 7\n# mine\n")
    configfile.write_tuned(directory, b"max_batch_size: 8\n", b"max_batch_size: 4\n")
    assert (directory / "config.yaml").read_bytes() == b"max_batch_size: 8\n"
    assert (directory / "config.yaml").stat().st_mode & 0o777 == 0o640
    assert "restored" in configfile.rollback(directory)
    assert (directory / "config.yaml").read_bytes() == b"max_run_ms: 7\n# mine\n"
    fresh = tmp_path / "n"
    assert configfile.read_current(fresh) is None
    configfile.write_tuned(fresh, b"max_batch_size: 4\n", None)
    assert "removed" in configfile.rollback(fresh)
    assert list(fresh.iterdir()) == []
    with pytest.raises(configfile.RollbackError, match="model tune has not changed it"):
        configfile.rollback(fresh)


def test_a_write_put_back_to_the_original_leaves_no_trace_and_one_after_a_tune_keeps_it(
        tmp_path: Path) -> None:
    """Put back to the original kept beside it, the directory is as before any write (a
    rollback then has nothing to do); put back over an earlier tune's file, the original
    stays kept for that tune's rollback."""
    directory, absent = tmp_path / "m", tmp_path / "n"
    directory.mkdir()
    (directory / "config.yaml").write_bytes(b"max_run_ms: 7\n")
    configfile.write_tuned(directory, b"qos: {class: best_effort}\n", b"max_run_ms: 7\n")
    configfile.put_back(directory, b"max_run_ms: 7\n", b"qos: {class: best_effort}\n")
    configfile.write_tuned(absent, b"qos: {class: best_effort}\n", None)
    configfile.put_back(absent, None, b"qos: {class: best_effort}\n")
    assert sorted(p.name for p in directory.iterdir()) == ["config.yaml"]
    assert (directory / "config.yaml").read_bytes() == b"max_run_ms: 7\n"
    assert list(absent.iterdir()) == []
    with pytest.raises(configfile.RollbackError):
        configfile.rollback(directory)
    configfile.write_tuned(directory, b"max_batch_size: 4\n", b"max_run_ms: 7\n")
    configfile.write_tuned(directory, b"qos: {class: best_effort}\n", b"max_batch_size: 4\n")
    configfile.put_back(directory, b"max_batch_size: 4\n", b"qos: {class: best_effort}\n")
    assert (directory / configfile.WRITTEN).read_bytes() == b"max_batch_size: 4\n"
    assert "restored" in configfile.rollback(directory)
    assert (directory / "config.yaml").read_bytes() == b"max_run_ms: 7\n"


def test_the_recorded_rate_is_read_from_a_real_registrys_statistics(tmp_path: Path) -> None:
    from agent.inference.demo_model import DEMO_MODEL_PATH
    from agent.serving.core import InferRequest
    from agent.serving.registry import ModelRegistry
    from agent.serving.versions import synthetic
    from tests.serving_helpers import cpu_factory

    registry = ModelRegistry(tmp_path / "repo", {"demo": DEMO_MODEL_PATH}, cpu_factory,
                             probe_interval_s=60)
    registry.start()
    try:
        inputs = synthetic(registry.model_metadata("demo", "").inputs)
        for _ in range(MIN_RECORDED - 1):
            registry.infer(InferRequest("demo", "", inputs))
        assert recorded_rate(registry.statistics("demo", ""), "demo") is None  # too few
        registry.infer(InferRequest("demo", "", inputs))
        stats = registry.statistics("demo", "")
    finally:
        registry.stop()
    window = stats[0]["edge_agent"]["queue"]["window"]
    span_s = (window["last_end_ns"] - window["first_start_ns"]) / 1e9
    assert recorded_rate(stats, "demo") == pytest.approx(MIN_RECORDED / span_s)
    assert recorded_rate(stats, "other") is None
    assert recorded_rate([{"name": "demo", "edge_agent": {}}], "demo") is None


def test_the_load_rate_is_the_flag_else_the_larger_of_recorded_and_min_rps() -> None:
    from agent.modeltune.tune import TuneRequest

    def request(rate: float | None, recorded: float | None) -> TuneRequest:
        return TuneRequest("m", Path("."), rate=rate, recorded_rate=recorded)

    assert request(5, 50).load_rate(80) == (5, "--rate")
    assert request(None, 50).load_rate(80) == (80, "qos.min_rps")
    assert request(None, 90).load_rate(80) == (90, "the running data plane's statistics")
    assert request(None, None).load_rate(None) == (None, "")


def test_the_pareto_front_is_what_no_other_candidate_beats_at_both() -> None:
    a, b, c, d = (Candidate(1, n, 1, 0) for n in (1, 2, 3, 4))
    results = [Result(a, 5, 100, 100, True, ""), Result(b, 8, 150, 150, True, ""),
               Result(c, 9, 120, 120, True, ""),  # slower and less than b
               Result(d, float("inf"), 0, 0, False, "", problem="refused")]
    assert pareto(results) == [True, True, False, False]


def test_a_choice_that_misses_when_measured_again_is_not_met() -> None:
    from agent.modeltune.measure import Objective
    from agent.modeltune.report import TuneReport

    chosen = Result(Candidate(1, 1, 4, 500), 8.0, 100, 100, True, "closed loop, 2 clients")
    again = Result(chosen.candidate, 12.5, 90, 60, False, "closed loop, 2 clients")
    report = TuneReport("m", 1, Objective(10.0, 95.0), "exhaustive", [chosen], chosen,
                        chosen.candidate.settings(), 3.0, confirmed=again)
    assert not report.met
    assert report.miss() == ("it met the objective in the search but not when measured "
                             "again: p99 12.50 ms is 2.50 ms (25 %) above p99_ms 10; "
                             "throughput 90.0 rps is 5.0 below min_rps 95")
    assert report.to_dict()["confirmed"] == {"p99_ms": 12.5, "throughput_rps": 90,
                                             "goodput_rps": 60, "power_mw": None,
                                             "met": False}
    kept = TuneReport("m", 1, Objective(10.0), "exhaustive", [chosen], chosen,
                      chosen.candidate.settings(), 3.0,
                      confirmed=Result(chosen.candidate, 9.0, 100, 100, True, ""))
    assert kept.met and kept.miss() == ""


def levels_measured(monkeypatch: pytest.MonkeyPatch, start: int, p99_ms: dict[int, float],
                    sweep: bool = True) -> tuple[list[int], Result]:
    """The closed loop's levels ``measure`` runs from ``start`` for a candidate of batch 8
    (up to 16 clients), each level answering 100 requests a second per client up to 4, with
    the p99 given per level (2 ms elsewhere): the levels in order and the result."""
    import agent.modeltune.measure as measuring

    run: list[int] = []

    def loop(call: object, clients: int, seconds: float) -> Sample:
        if seconds == measuring.WARMUP_S:
            return Sample()
        run.append(clients)
        return Sample([p99_ms.get(clients, 2.0) / 1000] * (100 * min(clients, 4)),
                      elapsed_s=1.0)

    monkeypatch.setattr(measuring, "closed_loop", loop)
    result = measuring.measure(lambda index: None, Candidate(1, 1, 8, 0),
                               measuring.Objective(10.0), measuring.Load(None, 1.0),
                               start_clients=start, sweep=sweep)
    return run, result


def test_the_quick_search_starts_a_sweep_at_its_hint_and_halves_while_it_breaks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """From one client the sweep climbs to where throughput stops growing (4, then 8 adds
    nothing); from a hint of 4 it skips 1 and 2 and finds the same level; from a hint of 16
    that breaks the objective it halves until a level holds."""
    levels, result = levels_measured(monkeypatch, 1, {})
    assert levels == [1, 2, 4, 8] and result.clients == 4 and result.met
    levels, result = levels_measured(monkeypatch, 4, {})
    assert levels == [4, 8] and result.clients == 4
    levels, result = levels_measured(monkeypatch, 16, {16: 30.0, 8: 12.0})
    assert levels == [16, 8, 4] and result.clients == 4 and result.met
    levels, result = levels_measured(monkeypatch, 1, {1: 30.0})
    assert levels == [1, 1] and not result.met  # one client broken twice: that ends it


def test_a_lowest_level_that_misses_once_is_judged_on_a_second_run_too(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One stall in the first window of one client (2 slow requests of 100: its p99) is
    outweighed by a second window without one (2 of 200: the 1 % above the p99), so the
    candidate meets and its sweep goes on; a level above one that breaks is not run
    again."""
    import agent.modeltune.measure as measuring

    runs: list[int] = []

    def loop(call: object, clients: int, seconds: float) -> Sample:
        if seconds == measuring.WARMUP_S:
            return Sample()
        runs.append(clients)
        slow = 2 if len(runs) == 1 else 0
        return Sample([0.030] * slow + [0.002] * (100 * clients - slow), elapsed_s=1.0)

    monkeypatch.setattr(measuring, "closed_loop", loop)
    result = measuring.measure(lambda index: None, Candidate(1, 1, 8, 0),
                               measuring.Objective(10.0), measuring.Load(None, 1.0))
    assert runs[:3] == [1, 1, 2] and result.met and result.clients >= 2
    runs.clear()
    levels, result = levels_measured(monkeypatch, 4, {4: 30.0, 2: 30.0})
    assert levels == [4, 2, 1] and result.clients == 1 and result.met


def test_a_confirmation_measures_the_chosen_level_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The chosen result's level again, no sweep around it; a miss there is run twice, and
    stays a miss (the tune then writes nothing) rather than settling on a lower level."""
    levels, result = levels_measured(monkeypatch, 8, {}, sweep=False)
    assert levels == [8] and result.clients == 8 and result.met
    levels, result = levels_measured(monkeypatch, 8, {8: 30.0}, sweep=False)
    assert levels == [8, 8] and not result.met


def test_past_the_current_point_a_line_stops_at_its_first_fall() -> None:
    """A model that loses with every batch step (and with a second instance): the batch line
    stops at 4, so batch 8 is never measured, nor any delay beside batch 4 (the batch line
    kept 1); the choice is the grid's best all the same."""
    def falling(candidate: Candidate) -> Result:
        rps = 200.0 / max(1, candidate.max_batch_size) / candidate.count * candidate.threads
        return Result(candidate, 5.0, rps, rps, True, "model")

    space = default_space(2, True)
    seen: list[Candidate] = []

    def measured(candidate: Candidate) -> Result:
        seen.append(candidate)
        return falling(candidate)

    quick = coordinate_descent(space, 2, measured, lambda: False)
    assert choose(quick).candidate == choose(exhaustive(grid(space, 2), falling)).candidate
    assert {c.max_batch_size for c in seen} == {1, 4}
    assert len(seen) == 4  # the start, 1 thread, 2 instances, batch 4


def test_a_tie_on_a_line_is_chosen_in_the_end_but_costs_no_further_pass() -> None:
    """Two instances serve within a tie of one (2 % more: noise between two measurements)
    at a lower p99.  The descent does not move for it, so one pass of four measurements
    ends the search (bench/model_tune.py's grid has 28 candidates, and the quick search
    is to take at most a fifth of their measuring time); the final choice still takes the
    tie's lower p99.  Before, moving to it swept every line again: a fifth candidate."""
    def tie(candidate: Candidate) -> Result:
        rps = (340.0 if candidate.threads == 2 else 260.0) * (
            1.02 if candidate.count == 2 else 1.0) / max(1, candidate.max_batch_size) ** 0.2
        p99 = 3.3 if candidate.count == 2 else 3.6
        return Result(candidate, p99, rps, rps, True, "model")

    seen: list[Candidate] = []

    def measured(candidate: Candidate) -> Result:
        seen.append(candidate)
        return tie(candidate)

    quick = coordinate_descent(default_space(2, True), 2, measured, lambda: False)
    assert choose(quick).candidate == Candidate(2, 2, 1, 0)
    assert seen == [Candidate(2, 1, 1, 0), Candidate(1, 1, 1, 0), Candidate(2, 2, 1, 0),
                    Candidate(2, 1, 4, 500)]
