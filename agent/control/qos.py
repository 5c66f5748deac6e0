"""The QoS controller's decisions: from each model's window figures and objective to at most
one lever change per model per window.  Pure: it reads numbers and returns actions; the
service layer feeds it the data plane's windows and executes what it returns.

It acts in order of cost.  For a model whose p99 objective is violated: its own queue delay
first, then its preferred batch size (both cost only that model's batching gain), then
admission of the models of a lower class (best_effort before throughput: they lose
throughput, capped in requests per second, never below their own ``min_rps``).  It relaxes in
the reverse order (admission first: best-effort throughput comes back first), only toward
what config.yaml configured, never past it.

The queue delay goes first because a batch cut at once (delay 0) still takes every request
queued meanwhile, so a loaded model keeps its batches; a smaller preferred batch splits them
(and with no delay it makes nobody wait anyway, so it moves only while a delay is left).

Hysteresis, so that it does not oscillate: a model acts only after ``violate_windows``
violating windows in a row; the window a move falls in is not judged (it mixes both
settings), and each further step then waits one window to see the last one's effect (an
instant lever shows at once); it relaxes only after
``relax_windows`` windows in a row in which every objective holds with ``margin``; a lever
is not relaxed within ``hold_windows`` of its last move; a relaxation is a probe: one
violating window undoes it at once, and doubles the wait before the next relaxation (up to
``max_relax_windows``), so a load that sits at the edge settles instead of probing every few
seconds.  With every lever at its limit a violated model is ``unmet`` (with the best p99
seen since), and nothing moves for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

CLASSES = ("latency_critical", "throughput", "best_effort")  # most protected first
DELAY = "max_queue_delay_us"
PREFERRED = "preferred_batch_size"
ADMIT = "admit_rps"
ADMIT_STEP = 0.7  # each admission step keeps this share of the rate admitted before
ADMIT_FLOOR_RPS = 1.0  # a model without min_rps is never held below this
MIN_DELAY_US = 100  # a queue delay below this is no delay: the step goes to 0


@dataclass(frozen=True)
class Objective:
    """A model's ``qos`` in config.yaml."""

    service_class: str
    p99_ms: float | None = None
    min_rps: float | None = None

    @property
    def rank(self) -> int:
        return CLASSES.index(self.service_class)


@dataclass(frozen=True)
class Figures:
    """One model's window: p99 of its calls, queue wait (p99), calls per second, and
    requests refused (queue full, shed, expired, not admitted)."""

    p99_ms: float
    queue_ms: float = 0.0
    rate_rps: float = 0.0
    rejections: int = 0
    count: int = 0


@dataclass(frozen=True)
class Levers:
    """A model's instant levers as served: queue delay, largest preferred batch (0: the
    model does not batch), the admission cap (None: every request admitted)."""

    max_queue_delay_us: int
    preferred_batch_size: int
    admit_rps: float | None = None

    def get(self, lever: str) -> float | None:
        return {DELAY: self.max_queue_delay_us, PREFERRED: self.preferred_batch_size,
                ADMIT: self.admit_rps}[lever]

    def set(self, lever: str, value: float | None) -> Levers:
        if lever == ADMIT:
            return replace(self, admit_rps=value)
        assert value is not None
        return replace(self, **{lever: int(value)})


@dataclass(frozen=True)
class Action:
    """One lever moved: on ``model``, for the objective of ``serves``."""

    model: str
    lever: str
    before: float | None
    after: float | None
    why: str
    serves: str
    tighten: bool


@dataclass(frozen=True)
class Unmet:
    """A model whose objective cannot be met with every lever at its limit."""

    model: str
    p99_ms: float  # the objective
    best_p99_ms: float  # the best window seen since the levers ran out


@dataclass(frozen=True)
class Hysteresis:
    violate_windows: int = 2
    relax_windows: int = 5
    hold_windows: int = 3
    max_relax_windows: int = 300
    margin: float = 0.7  # "holds with margin": p99 at most this share of the objective
    min_count: int = 1  # a window with fewer calls says nothing about latency
    # windows not judged after a move: the one the move fell in mixes both settings (with
    # twenty calls a window, one request that waited under the old delay is the p99)
    settle_windows: int = 1


@dataclass
class _Track:
    violating: int = 0
    unmet: Unmet | None = None


@dataclass
class _Moved:
    window: int
    tighten: bool


@dataclass
class Decision:
    actions: list[Action] = field(default_factory=list)
    unmet: dict[str, Unmet] = field(default_factory=dict)  # every model unmet now


class QosController:
    """Decides each window; ``baseline`` (config.yaml's levers) bounds every relaxation."""

    def __init__(self, hysteresis: Hysteresis | None = None) -> None:
        self.h = hysteresis or Hysteresis()
        self.window = 0
        self._tracks: dict[str, _Track] = {}
        self._moved: dict[tuple[str, str], _Moved] = {}
        self._comfortable = 0
        self._relax_needed = self.h.relax_windows
        self._last_relax: int | None = None
        self._settle_until = 0  # the last window after a move that is not judged

    def decide(self, figures: Mapping[str, Figures], objectives: Mapping[str, Objective],
               levers: Mapping[str, Levers], baseline: Mapping[str, Levers]) -> Decision:
        """This window's actions (at most one per model whose lever moves) and the models
        unmet; ``levers``/``baseline``: the models served now, as served and as
        configured."""
        self.window += 1
        decision = Decision()
        if self.window <= self._settle_until:
            decision.unmet = self._unmet(objectives)
            return decision
        held = [m for m in sorted(objectives, key=lambda m: (objectives[m].rank, m))
                if objectives[m].p99_ms is not None and m in levers]
        violated, comfortable = [], True
        for model in held:
            state = self._judge(model, figures.get(model), objectives[model])
            if state == "violated":
                violated.append(model)
            if state in ("violated", "holding"):  # an idle model is no reason to hold back
                comfortable = False
        moved: set[str] = set()
        for model in violated:
            track = self._tracks[model]
            if track.violating < self.h.violate_windows or track.unmet is not None:
                continue
            action = self._tighten(model, objectives, levers, figures, moved)
            if action is False:  # every lever at its limit: say so, and stop moving
                p99 = figures[model].p99_ms
                track.unmet = Unmet(model, float(objectives[model].p99_ms or 0), p99)
                continue
            if not isinstance(action, Action):
                continue  # its steps are on models moved this window: the next one
            track.violating = self.h.violate_windows - 1  # the next step: after one window
            moved.add(action.model)
            decision.actions.append(action)
        self._after_relax(violated)
        self._comfortable = self._comfortable + 1 if comfortable and held else 0
        if not decision.actions and self._comfortable >= self._relax_needed:
            relaxed = self._relax(objectives, levers, baseline, figures)
            if relaxed is not None:
                self._comfortable = 0
                self._last_relax = self.window
                decision.actions.append(relaxed)
                for model in held:  # one violating window undoes this probe
                    self._tracks[model].violating = self.h.violate_windows - 1
        if decision.actions:
            self._settle_until = self.window + self.h.settle_windows
        decision.unmet = self._unmet(objectives)
        return decision

    def _unmet(self, objectives: Mapping[str, Objective]) -> dict[str, Unmet]:
        return {m: t.unmet for m, t in self._tracks.items()
                if t.unmet is not None and m in objectives}

    def _judge(self, model: str, window: Figures | None, objective: Objective) -> str:
        """violated | comfortable | holding | idle, with the model's counts kept."""
        track = self._tracks.setdefault(model, _Track())
        if window is None or window.count < self.h.min_count:
            return "idle"  # no calls: neither a violation nor a sign of margin
        limit = float(objective.p99_ms or 0)
        if window.p99_ms > limit:
            track.violating += 1
            if track.unmet is not None:
                track.unmet = replace(track.unmet, best_p99_ms=min(track.unmet.best_p99_ms,
                                                                    window.p99_ms))
            return "violated"
        track.violating = 0
        if track.unmet is not None:  # it holds again: the levers may move once more
            track.unmet = None
        return "comfortable" if window.p99_ms <= self.h.margin * limit else "holding"

    def _after_relax(self, violated: list[str]) -> None:
        """A violation soon after a relaxation: that one went too far, so wait longer."""
        last = self._last_relax
        if last is None:
            return
        if violated and self.window - last <= self._relax_needed:
            self._relax_needed = min(self._relax_needed * 2, self.h.max_relax_windows)
            self._last_relax = None
        elif self.window - last > self._relax_needed:
            self._last_relax = None  # it held: the next relaxation need not wait longer

    def _may_move(self, model: str, lever: str, tighten: bool) -> bool:
        """A lever is not relaxed within ``hold_windows`` of its last move; tightening is
        never held (a relaxation that violates is undone at once: that is a probe that
        failed, not an oscillation)."""
        last = self._moved.get((model, lever))
        return tighten or last is None or self.window - last.window >= self.h.hold_windows

    def _tighten(self, model: str, objectives: Mapping[str, Objective],
                 levers: Mapping[str, Levers], figures: Mapping[str, Figures],
                 moved: set[str]) -> Action | bool:
        """The cheapest step toward ``model``'s objective; True when the steps left are on
        models already moved this window, False when none is left (unmet)."""
        p99, limit = figures[model].p99_ms, objectives[model].p99_ms
        why = f"p99 {p99:.1f} ms above the objective {limit:g} ms of {model}"
        steps: list[tuple[str, str, float | None, str]] = []
        own = levers[model]
        if own.max_queue_delay_us > 0:
            delay = own.max_queue_delay_us // 4
            steps.append((model, DELAY, 0 if delay < MIN_DELAY_US else delay, why))
        if own.preferred_batch_size > 1 and own.max_queue_delay_us > 0:  # else it waits not
            steps.append((model, PREFERRED, own.preferred_batch_size // 2, why))
        rank = objectives[model].rank
        for other in sorted((m for m in levers if _rank(objectives, m) > rank),
                            key=lambda m: (-_rank(objectives, m), m)):
            floor = _floor(objectives.get(other))
            current = levers[other].admit_rps
            rate = figures[other].rate_rps if other in figures else 0.0
            if current is None and rate <= floor:
                continue  # asking for no more than its floor: holding it frees nothing
            capped = round(max(floor, (rate if current is None else current) * ADMIT_STEP), 3)
            if current is None or capped < current:
                steps.append((other, ADMIT, capped, f"{why}: admission of {other} "
                              f"({_class(objectives, other)}) held"))
        for target, lever, after, reason in steps:
            if target not in moved and self._may_move(target, lever, True):
                return self._move(target, lever, levers[target], after, reason, model, True)
        return bool(steps)

    def _relax(self, objectives: Mapping[str, Objective], levers: Mapping[str, Levers],
               baseline: Mapping[str, Levers], figures: Mapping[str, Figures]
               ) -> Action | None:
        """One step back toward config.yaml: admission of the lowest class first, then each
        model's preferred batch and queue delay, the least protected model first."""
        why = "every objective holds with margin"
        order = sorted(levers, key=lambda m: (-_rank(objectives, m), m))
        for model in order:
            current = levers[model].admit_rps
            if current is not None and self._may_move(model, ADMIT, False):
                refused = figures[model].rejections if model in figures else 0
                # nothing refused: the cap does not bind, so none at all
                after = round(current / ADMIT_STEP, 3) if refused else None
                return self._move(model, ADMIT, levers[model], after, why, model, False)
        for lever in (PREFERRED, DELAY):
            for model in order:
                if model not in baseline:
                    continue
                now, configured = levers[model].get(lever), baseline[model].get(lever)
                assert now is not None and configured is not None
                if now < configured and self._may_move(model, lever, False):
                    floor = 1 if lever == PREFERRED else MIN_DELAY_US
                    step = min(configured, max(now * 2, floor))
                    return self._move(model, lever, levers[model], step, why, model, False)
        return None

    def _move(self, model: str, lever: str, levers: Levers, after: float | None, why: str,
              serves: str, tighten: bool) -> Action:
        self._moved[(model, lever)] = _Moved(self.window, tighten)
        return Action(model, lever, levers.get(lever), after, why, serves, tighten)


def _rank(objectives: Mapping[str, Objective], model: str) -> int:
    """A model without a qos is best effort: it yields to every model that has one."""
    objective = objectives.get(model)
    return objective.rank if objective is not None else len(CLASSES)


def _class(objectives: Mapping[str, Objective], model: str) -> str:
    objective = objectives.get(model)
    return objective.service_class if objective is not None else "no qos"


def _floor(objective: Objective | None) -> float:
    """The least admission a model is ever held to: its min_rps."""
    if objective is not None and objective.min_rps is not None:
        return max(objective.min_rps, ADMIT_FLOOR_RPS)
    return ADMIT_FLOOR_RPS
