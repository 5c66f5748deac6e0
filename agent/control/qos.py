"""The QoS controller's decisions: from each model's window figures and objective to at most
one lever change per model per window.  Pure: it reads numbers and returns actions; the
service layer feeds it the data plane's windows and the device's ladder, and executes what
it returns.  The steps and their order of cost are in qos_steps.

Hysteresis, so that it does not oscillate: a model acts only after ``violate_windows`` violating
windows among its last ``violate_span`` (so a violation that comes and goes every other window
is acted on as one that stays, and one lone window is not); the window a move falls in is not
judged (it mixes both settings; a relaxation's is, so that one violating window undoes it, but
for threads: their window holds the rebuild), nor is any window while a model's sessions are
being rebuilt, and each further step then waits one window to see the last one's effect; it
relaxes only after ``relax_windows`` windows in a row in which every model's p99 level (see
below) holds with ``margin`` (or ``probe_factor`` times as many in which it holds at all: as
many, once the last probe held, until one is undone or a model acts again), with fewer violating
windows among its last ``violate_span`` than act (one stalled window of the machine's does not
start the count again); a lever is not relaxed within ``hold_windows`` of its last move; a
relaxation is a probe: one violating window undoes it at once, and doubles the wait before the
next relaxation (up to ``max_relax_windows``), so a load that sits at the edge settles instead
of probing every few seconds; a probe of that lever that holds halves the wait again, so the
wait is not left at its longest for good once the edge has gone (or once stalls of the machine's
have stopped undoing probes); and when the cores busy outside the agent fall ``foreign_drop``
below their level at the last tightening (a co-located app stopped), probing starts again as
after a probe that held.

Every step on another model (or the device) is a trial: it stays only when the model's p99 level
over the next ``trial_windows`` judged windows is below ``helped`` times its level over the last
``violate_span`` before the step (or back within the objective from above it, or without a miss
where ``violate_windows`` of those had one), a level being the median of a run of windows
without its worst one.  One that did not help is given back (``why`` says "did not help") and
passed over for that model while its level stays below ``risen`` times what it was then
(``futile_windows``, doubled each time the same lever fails again): a violation the machine
makes (a stall of the VM, another process) then costs the other models little, while one they
make is still met, step by step.  Without the worst window, so that one stalled window neither
makes a step look helpful nor hides a cause that stays: two stalls among four windows leave the
level where it was, three violations of four raise it.

With every lever at its limit (or passed over) a violated model is ``unmet`` (with the best p99
of its last ``violate_span`` windows, and of every window since), and nothing more moves for it
until it holds again, its p99 level rises ``risen`` times past what it was then (a new cause,
which the levers passed over may now remove), or a lever passed over (or refused) is due to be
tried again: a lever that looked no help because stalls of the machine's fell in its trial is
not lost for good.  It stays unmet while such a lever is tried: one episode, until a window
holds, is one ``qos_unmet``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import replace

from agent.control.qos_model import (
    ADMIT,
    ADMIT_FLOOR_RPS,
    CPUS,
    DELAY,
    PREFERRED,
    REALTIME,
    REBUILT,
    RUNG,
    THREADS,
    Action,
    Decision,
    Device,
    Figures,
    Hysteresis,
    Levers,
    Objective,
    Unmet,
    Value,
)
from agent.control.qos_steps import DEVICE, Step, lift_steps, relax_steps, tighten_steps
from agent.control.qos_track import Foreign, Futile, Moved, Track, Trial, level

__all__ = ["ADMIT", "ADMIT_FLOOR_RPS", "CPUS", "DELAY", "PREFERRED", "REBUILT", "RUNG", "THREADS",
           "Action", "Decision", "Device", "Figures", "Hysteresis", "Levers", "Objective",
           "QosController", "Unmet"]


class QosController:
    """Decides each window; ``baseline`` (config.yaml's levers) bounds every relaxation."""

    def __init__(self, hysteresis: Hysteresis | None = None, advising: bool = False) -> None:
        """``advising``: its moves are reported, never made, so none is judged by its
        effect (none would look like no help and be given back)."""
        self.h = hysteresis or Hysteresis()
        self.advising = advising
        self.window = 0
        self._tracks: dict[str, Track] = {}
        self._moved: dict[tuple[str, str], Moved] = {}
        self._comfortable = 0  # windows in a row every model's level held with margin
        self._holding = 0  # windows in a row no model stood violated (_standing)
        self._relax_needed = self.h.relax_windows
        self._last_relax: int | None = None
        self._relaxed: tuple[str, str] = ("", "")  # the lever the last relaxation moved
        self._backed_off: set[tuple[str, str]] = set()  # levers whose probes lengthened it
        self._held: dict[str, int] = {}  # probes of a model's admission cap in a row held
        self._probe_held = False  # the last probe held, and no step has tightened since
        self._settle_until = 0  # the last window after a move that is not judged
        self._probing = False  # the last move was a relaxation
        self._failed: dict[tuple[str, str], int] = {}  # when a lever's probe was undone
        self._refused: dict[tuple[str, str], int] = {}  # when a lever was refused
        self._futile: dict[tuple[str, str, str], Futile] = {}  # (for, target, lever)
        self._foreign = Foreign(deque(maxlen=self.h.violate_span))

    def decide(self, figures: Mapping[str, Figures], objectives: Mapping[str, Objective],
               levers: Mapping[str, Levers], baseline: Mapping[str, Levers],
               device: Device | None = None, cpus: int = 0,
               foreign: float | None = None) -> Decision:
        """This window's actions (at most one per model whose lever moves, and at most one
        on the device) and the models unmet; ``levers``/``baseline``: the models served
        now, as served and as configured; ``device``: its latency ladder (None: none to
        move); ``cpus``: the CPUs a model may be confined within (0: no placement);
        ``foreign``: the cores busy outside the agent and its data plane (None: unknown)."""
        self.window += 1
        decision = Decision()
        self._foreign.seen(foreign)
        if self._foreign.dropped(self.h.foreign_drop):  # the load met has gone: probe as
            self._relax_needed = self.h.relax_windows  # after a probe that held
            self._backed_off.clear()
            self._failed.clear()
            self._probe_held = True
        if any(lever.rebuilding for lever in levers.values()):  # judged once swapped
            self._settle_until = max(self._settle_until, self.window + self.h.settle_windows)
            self._probing = False
        if self.window <= self._settle_until and not self._probing:
            decision.unmet = self._unmet(objectives)
            return decision
        held = [m for m in sorted(objectives, key=lambda m: (objectives[m].rank, m))
                if objectives[m].p99_ms is not None and m in levers]
        violated, comfortable, holding = [], True, True
        for model in held:
            if self._judge(model, figures.get(model), objectives[model]):
                violated.append(model)
            standing = self._standing(model, figures.get(model), objectives[model])
            if standing in ("violated", "holding"):  # an idle one is no reason to wait
                comfortable = False
            holding = holding and standing != "violated"
        # acting on its violations (before a step's arming below forgets them)
        troubled = any(self._tracks[m].violating >= self.h.violate_windows for m in violated)
        moved: set[str] = set()
        for step in lift_steps(objectives, levers, baseline, figures):  # not a tightening
            if lift := self._first([step], levers, device, step[0], moved, step[2] is True):
                moved.add(step[0])
                decision.actions.append(lift)
        for model in held:
            limit = float(objectives[model].p99_ms or 0)
            for back in self._judge_trials(model, limit, levers, device, moved):
                moved.add(back.model if back.lever != RUNG else DEVICE)
                decision.actions.append(back)
        for model in violated:
            track, limit = self._tracks[model], float(objectives[model].p99_ms or 0)
            if track.violating < self.h.violate_windows:
                continue
            misses = [p for p in track.p99s if p > limit]
            action = self._tighten(model, objectives, levers, baseline, figures, device,
                                   cpus, moved)
            if track.unmet is not None and not isinstance(action, Action):
                continue  # still unmet: nothing moves (a lever due again is tried, unmet
                # until a window holds: one episode, one event)
            if action is False:  # every lever at its limit: say so, and stop moving
                track.unmet = Unmet(model, limit, min(misses, default=limit))  # the best
                # miss of its last windows: what it misses by at least
                track.unmet_at = level(track.p99s)
                continue
            if not isinstance(action, Action):
                continue  # its steps are on models moved this window: the next one
            track.arm(self.h.violate_windows - 1)  # the next step: in a window
            target = DEVICE if action.lever == RUNG else action.model
            # on trial, but not a failed probe undone: that one is known to help
            if target != model and self._failed.get((target, action.lever)) != self.window \
                    and not self.advising:
                for trial in track.trials:
                    trial.overlap(target, action.lever)
                track.trials.append(Trial(target, action.lever, action.before, action.after,
                                          level(track.p99s), misses=len(misses)))
            moved.add(target)
            decision.actions.append(action)
        self._after_relax(troubled)
        # no objective left (one removed while serving): what was moved for it goes back
        self._comfortable = self._comfortable + 1 if comfortable else 0
        self._holding = self._holding + 1 if holding else 0
        relaxed = None
        if any(action.tighten and action.lever != REALTIME for action in decision.actions):
            self._probe_held = False  # the load turned against the levers: probe as at first
            self._foreign.tightened()
        # without margin a probe waits probe_factor times as long, unless the last one held
        probe_wait = self._relax_needed * (1 if self._probe_held else self.h.probe_factor)
        if not decision.actions and self._comfortable >= self._relax_needed:
            relaxed = self._first(relax_steps(objectives, levers, baseline, figures, device,
                                              cpus=cpus, held=self._held), levers, device,
                                  "", set(), False)
        elif not decision.actions and self._holding >= probe_wait:  # not own batching
            relaxed = self._first(relax_steps(objectives, levers, baseline, figures, device,
                                              below_rank=-1, cpus=cpus, held=self._held),
                                  levers, device, "", set(), False)
        if relaxed is not None:
            self._comfortable = self._holding = 0
            self._last_relax = self.window
            self._relaxed = (DEVICE if relaxed.lever == RUNG else relaxed.model, relaxed.lever)
            decision.actions.append(relaxed)
            for model in held:  # one violating window undoes this probe
                self._tracks[model].arm(self.h.violate_windows - 1)
        # a relaxation is judged at once: a window that violates with it, even mixed with the
        # old setting, undoes it; not one of threads (judged once swapped: its window builds)
        self._probing = relaxed is not None and relaxed.lever not in REBUILT
        if decision.actions:
            self._settle_until = self.window + self.h.settle_windows
        decision.unmet = self._unmet(objectives)
        return decision

    def _unmet(self, objectives: Mapping[str, Objective]) -> dict[str, Unmet]:
        return {m: t.unmet for m, t in self._tracks.items()
                if t.unmet is not None and m in objectives}

    def _judge(self, model: str, window: Figures | None, objective: Objective) -> bool:
        """Whether this window violates ``objective``, with the model's counts kept."""
        track = self._tracks.setdefault(model, Track(
            deque(maxlen=self.h.violate_span), deque(maxlen=self.h.violate_span)))
        if window is None or window.count < self.h.min_count:
            return False  # no calls: neither a violation nor a sign of margin
        track.p99s.append(window.p99_ms)
        for trial in track.trials:
            if len(trial.samples) < self.h.trial_windows:
                trial.samples.append(window.p99_ms)
        limit = float(objective.p99_ms or 0)
        if window.p99_ms > limit:
            track.recent.append(True)
            if track.unmet is not None and level(track.p99s) > \
                    self.h.risen * track.unmet_at:
                track.unmet = None  # well past what it missed by: the levers may tell now
            if track.unmet is not None:
                track.unmet = replace(track.unmet, best_p99_ms=min(track.unmet.best_p99_ms,
                                                                    window.p99_ms))
            return True
        track.recent.append(False)
        track.unmet = None  # it holds (again): the levers may move once more
        return False

    def _standing(self, model: str, window: Figures | None, objective: Objective) -> str:
        """How the model stands for relaxing: idle (no calls this window), violated (as
        many violating windows among its last ``violate_span`` as act, or a level above the
        objective), comfortable (a level within ``margin``) or holding.  Its level, not
        this one window: one window the machine stalled neither holds the relaxations back
        nor, on a probe, goes unanswered (that one window undoes it, in ``decide``)."""
        if window is None or window.count < self.h.min_count:
            return "idle"
        track, limit = self._tracks[model], float(objective.p99_ms or 0)
        at = level(track.p99s)
        if track.violating >= self.h.violate_windows or at > limit:
            return "violated"
        return "comfortable" if at <= self.h.margin * limit else "holding"

    def _after_relax(self, troubled: bool) -> None:
        """A model acting on its violations soon after a relaxation: that one went too far,
        so the next waits twice as long.  One stalled window is no such sign, and a lever
        whose probe lengthened the wait shortens it again (halves it) once a probe of it
        holds: else stalls of the machine's that undid probes would ratchet the wait to its
        limit for good.  Other levers' probes holding do not: at a load on the edge, a
        lever that relaxes safely would otherwise undo the back-off of one that does not."""
        last = self._last_relax
        if last is None:
            return
        target, lever = self._relaxed
        if troubled and self.window - last <= self._relax_needed:
            self._relax_needed = min(self._relax_needed * 2, self.h.max_relax_windows)
            self._backed_off.add(self._relaxed)
            self._last_relax = None
            self._held.pop(target, None)
            self._probe_held = False
        elif self.window - last >= self._relax_needed:
            self._last_relax = None  # it held
            self._probe_held = True
            if lever == ADMIT:
                self._held[target] = self._held.get(target, 0) + 1
            if self._relaxed in self._backed_off:
                self._relax_needed = max(self._relax_needed // 2, self.h.relax_windows)
                if self._relax_needed == self.h.relax_windows:
                    self._backed_off.discard(self._relaxed)

    def _may_move(self, target: str, lever: str, tighten: bool) -> bool:
        """A lever is not relaxed within ``hold_windows`` of its last move; tightening is
        never held (a relaxation that violates is undone at once: that is a probe that
        failed, not an oscillation)."""
        last = self._moved.get((target, lever))
        return tighten or last is None or self.window - last.window >= self.h.hold_windows

    def refused(self, action: Action) -> None:
        """The data plane (or the tuning engine) refused ``action``: that lever is left
        out of the steps for ``refused_windows``, so a lever this data plane or device does
        not have reads as one at its limit instead of being asked for every window."""
        target = DEVICE if action.lever == RUNG else action.model
        self._refused[(target, action.lever)] = self.window
        self._moved.pop((target, action.lever), None)

    def _available(self, target: str, lever: str) -> bool:
        refused = self._refused.get((target, lever))
        return refused is None or self.window - refused >= self.h.refused_windows

    def _failed_lately(self, target: str, lever: str) -> bool:
        """A lever whose last relaxation had to be undone is not probed again for twice
        the wait with margin: the next probe tries the next lever in the order instead.
        Not for as long as a probe without margin waits (ten times that): one stall that
        undid a probe of the best-effort cap then kept it for minutes."""
        failed = self._failed.get((target, lever))
        return failed is not None and self.window - failed < self._relax_needed * 2

    def _tighten(self, model: str, objectives: Mapping[str, Objective],
                 levers: Mapping[str, Levers], baseline: Mapping[str, Levers],
                 figures: Mapping[str, Figures], device: Device | None, cpus: int,
                 moved: set[str]) -> Action | bool:
        """The cheapest step toward ``model``'s objective; True when the steps left are on
        models (or the device) already moved this window, False when none is left."""
        steps = [step for step in tighten_steps(model, objectives, levers, baseline, figures,
                                                device, cpus)
                 if self._available(step[0], step[1])
                 and not self._futile_now(model, step[0], step[1])]
        action = self._first(steps, levers, device, model, moved, True)
        return action if action is not None else bool(steps)

    def _judge_trials(self, model: str, limit: float, levers: Mapping[str, Levers],
                      device: Device | None, moved: set[str]) -> list[Action]:
        """``model``'s trials with their windows in: the steps that helped (``helped``, or
        back within the objective ``limit``, or no window missing it where enough to act
        had: misses that came and went, which the level, without the worst, hides) stay,
        the others are given back (to the value before them, with any later step on the
        same lever)."""
        track, backs = self._tracks[model], []
        for trial in [t for t in track.trials if len(t.samples) >= self.h.trial_windows]:
            if trial not in track.trials:
                continue  # dropped with an earlier one on the same lever
            key = (model, trial.target, trial.lever)
            after = level(trial.samples)
            helped = after < self.h.helped * trial.reference or after <= limit < trial.reference \
                or (trial.misses >= self.h.violate_windows and max(trial.samples) <= limit)
            if not helped and trial.overlapped:
                trial.samples.clear()  # judged again over windows after the later step
                trial.overlapped = False
                continue
            at = track.trials.index(trial)
            track.trials.remove(trial)
            if helped:
                self._futile.pop(key, None)
                continue
            chain = [trial] + [t for t in track.trials[at:]
                               if (t.target, t.lever) == (trial.target, trial.lever)]
            for later in chain[1:]:
                track.trials.remove(later)
            if trial.target == DEVICE:
                if device is None:
                    continue  # no ladder any more
                now: Value = device.rung
            elif trial.target in levers:
                now = levers[trial.target].get(trial.lever)
            else:
                continue  # no longer served
            if now not in [t.after for t in chain] or trial.target in moved:
                continue  # relaxed since, or moved by another model's trial this window
            fails = (self._futile[key].fails if key in self._futile else 0) + len(chain)
            self._futile[key] = Futile(self.window + min(
                self.h.futile_windows * 2 ** (fails - 1), self.h.max_relax_windows),
                trial.reference, fails)
            self._moved[(trial.target, trial.lever)] = Moved(self.window, False, model)
            why = (f"{trial.lever} of {trial.target or 'the device'} for {model} did not "
                   f"help (p99 {trial.reference:.1f} ms before, {after:.1f} ms "
                   "after): given back")
            backs.append(Action(trial.target or model, trial.lever, now, trial.before, why,
                                model, False))
        return backs

    def _futile_now(self, model: str, target: str, lever: str) -> bool:
        """``lever`` on ``target`` did not help ``model`` lately, at about its p99 now."""
        futile = self._futile.get((model, target, lever))
        if futile is None:
            return False
        if level(self._tracks[model].p99s) > self.h.risen * futile.reference:
            del self._futile[(model, target, lever)]  # a new cause: tried afresh
            return False
        return self.window < futile.until

    def _first(self, steps: list[Step], levers: Mapping[str, Levers], device: Device | None,
               serves: str, moved: set[str], tighten: bool) -> Action | None:
        """The first of ``steps`` that may move now (not refused lately), moved."""
        for target, lever, after, why in steps:
            if target not in moved and self._may_move(target, lever, tighten) and (
                    tighten or not self._failed_lately(target, lever)) and \
                    self._available(target, lever):
                last = self._moved.get((target, lever))
                if tighten and last is not None and not last.tighten and (
                        self.window - last.window <= self._relax_needed):
                    self._failed[(target, lever)] = self.window  # a probe undone
                model = target or serves or "device"
                serves = serves or (last.serves if last is not None else "") or model
                self._moved[(target, lever)] = Moved(self.window, tighten, serves)
                if tighten and lever == ADMIT:
                    self._held.pop(target, None)  # it climbs back from one step again
                before: Value = (device.rung if device is not None and target == DEVICE
                                 else levers[target].get(lever))
                return Action(model, lever, before, after, why, serves, tighten)
        return None
