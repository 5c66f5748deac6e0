"""Which candidates to measure: all of them (``--exhaustive``), or coordinate descent: from a
start point, each dimension in turn is swept with the others held (upward past the current
point only while the line still gains), the best point of the line becomes the new start
where it gains more than measuring noise on it (MOVE), and passes repeat until one changes
nothing or the budget is spent; the choice is the best of every point measured.  Model
Analyzer's quick search is a hill-climb of the same kind; its docs put it above 95 % of the
sweep's optimum at under 10 % of the sweep's cost."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from agent.modeltune.space import DIMENSIONS, Candidate, Space, valid, values

# Goodputs within this fraction of the best count as equal: the lower p99 then wins, since
# under a fixed rate every candidate that keeps up serves the same requests per second.
TIE = 0.03
# A line's best moves the descent only when it serves this much more than the current point:
# two measurements of one candidate on a busy device differ by as much (bench/model_tune.py),
# so a smaller gain is as likely noise, and a move costs a whole further pass; the final
# choice is still the best of everything measured, the points of a line not moved to included
MOVE = 0.10
# A closed loop's order (coordinate_descent's ``waits`` False): the queue delay is held at the
# space's smallest, and the batch comes first, so that a move to a batch (a closed loop's
# usual gain) is followed by the threads and instances lines at it in the same pass, not in
# a second one (bench/model_tune.py: 8 candidates instead of 5 where batch 8 gained 11 %)
CLOSED = ("version", "max_batch_size", "threads", "count", "knobs")
# A cap on passes: moves judged on noisy figures are no strict order, so a cycle is conceivable
MAX_PASSES = 8


@dataclass(frozen=True)
class Result:
    """One candidate measured: ``load`` says how (a rate, or the clients of a closed loop)."""

    candidate: Candidate
    p99_ms: float
    throughput_rps: float
    goodput_rps: float
    met: bool
    load: str
    errors: int = 0
    problem: str = ""  # why it could not be measured (the data plane refused it)
    cpu_cores: float | None = None  # the data plane's CPU time per second of the load
    first_error: str = ""  # what the first failed request was told
    power_mw: float | None = None  # the device's mean power during the load (None: no rails)
    clients: int = 0  # the closed loop's level these figures are of (0: an open loop)


def pareto(results: Sequence[Result]) -> list[bool]:
    """Whether each result is on the front: no other measured one is as good at p99,
    throughput and (where both have it) power, and better at one of them."""
    measured = [r for r in results if not r.problem]
    return [not r.problem and not any(_dominates(o, r) for o in measured) for r in results]


def _dominates(one: Result, other: Result) -> bool:
    """Pairs of figures where lower is better; power counts only between two results that
    both have it (a board without rails, or a rail unread for a whole window)."""
    pairs = [(one.p99_ms, other.p99_ms), (-one.throughput_rps, -other.throughput_rps)]
    if one.power_mw is not None and other.power_mw is not None:
        pairs.append((one.power_mw, other.power_mw))
    return all(a <= b for a, b in pairs) and any(a < b for a, b in pairs)


def choose(results: Sequence[Result]) -> Result:
    """The best: objectives met first, then goodput (within TIE: the lower latency knobs
    rung, since a floor or a hold costs power and buys no goodput there, then the lower
    p99)."""
    pool = [r for r in results if r.met] or [r for r in results if not r.problem] or list(results)
    top = max(r.goodput_rps for r in pool)
    close = [r for r in pool if r.goodput_rps >= top * (1 - TIE)]
    return min(close, key=lambda r: (r.candidate.knobs, r.p99_ms, -r.goodput_rps))


def exhaustive(points: Sequence[Candidate], measure: Callable[[Candidate], Result]
               ) -> list[Result]:
    return [measure(point) for point in points]


def coordinate_descent(space: Space, cpus: int, measure: Callable[[Candidate], Result],
                       spent: Callable[[], bool], waits: bool = True) -> list[Result]:
    """The results measured, in order; ``spent`` says the budget is used up (the first
    candidate is always measured); ``waits``: a batch forms only with a queue delay (an open
    loop, whose requests arrive spaced: see ``_aligned``), not from the requests queued
    behind a running one (a closed loop of several clients, where no delay is swept: with
    one instance no answer returns while the scheduler waits, so a wait gathers nothing
    the queue did not hold already; ``--exhaustive`` measures every delay all the same)."""
    current = _start(space, cpus)
    measured: dict[Candidate, Result] = {current: measure(current)}
    for _ in range(MAX_PASSES):
        before = current
        for dimension in DIMENSIONS if waits else CLOSED:
            line: list[Result] = []
            for value in values(space, dimension):
                point = _aligned(space, current,
                                 dataclasses.replace(current, **{dimension: value}), waits)
                if not valid(point, cpus):
                    continue
                if point not in measured:
                    if spent():
                        return list(measured.values())
                    measured[point] = measure(point)
                line.append(measured[point])
                if value > getattr(current, dimension) and _worse(line[-1], choose(line)):
                    break  # past the current point and falling: the rest of the line too
            best = choose(line) if line else None
            if best is not None and _gains(best, measured[current]):
                current = best.candidate
        if current == before:
            break
    return list(measured.values())


def _gains(result: Result, current: Result) -> bool:
    """Whether the descent moves from ``current`` to a line's best: it meets where the
    current misses, or serves more than MOVE more."""
    if result.met != current.met:
        return result.met
    return result.goodput_rps > current.goodput_rps * (1 + MOVE)


def _worse(result: Result, best: Result) -> bool:
    """Below the line's best: it misses where the best meets, or its goodput is lower by
    more than a tie (a line is taken as unimodal: batching, threads and instances gain up
    to a point and lose past it)."""
    if best.met != result.met:
        return best.met
    return result.goodput_rps < best.goodput_rps * (1 - TIE)


def _aligned(space: Space, current: Candidate, point: Candidate, waits: bool) -> Candidate:
    """A batch of one waits for nothing; where a batch forms only with a wait (``waits``),
    a batch first tried from one waits the smallest delay there is above 0: without it
    the sweep of batch sizes would see none of what batching gives (the delay's own sweep
    then refines it); elsewhere it waits the space's smallest (0 where it is one)."""
    if point.max_batch_size <= 1:
        return dataclasses.replace(point, max_queue_delay_us=0)
    if current.max_batch_size <= 1 and point.max_queue_delay_us == 0 and (
            waits or 0 not in space["max_queue_delay_us"]):
        delays = [d for d in space["max_queue_delay_us"] if d > 0]
        return dataclasses.replace(point, max_queue_delay_us=min(delays, default=0))
    return point


def _start(space: Space, cpus: int) -> Candidate:
    """One instance with the most threads it may have, the smallest batch and delay, the
    lowest version (a build's source comes before the builds made of it), the lowest
    latency knobs rung."""
    count, batch, delay = min(space["count"]), min(space["max_batch_size"]), min(
        space["max_queue_delay_us"])
    threads = [t for t in space["threads"] if valid(Candidate(t, count, batch, 0), cpus)]
    return Candidate(max(threads or [min(space["threads"])]), count, batch,
                     delay if batch > 1 else 0, min(values(space, "version")),
                     min(values(space, "knobs")))
