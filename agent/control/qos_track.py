"""What the QoS controller remembers of each model between windows: its recent verdicts and
p99s (and the level they sit at), whether it is unmet, the steps on trial for it, the levers
that did not help it, and when each lever last moved; and of the device, the CPU load from
outside the agent.  Plain records: the decisions that read and change them are the
controller's (qos)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from statistics import median

from agent.control.qos_model import Unmet, Value


def level(p99s: Iterable[float]) -> float:
    """The p99 a run of windows sits at: their median without the worst one."""
    ordered = sorted(p99s)
    return median(ordered[:-1] if len(ordered) > 1 else ordered)


@dataclass(eq=False)  # each trial is itself: two alike are still two
class Trial:
    """A step on another model (or the device) on trial for the model it was taken for."""

    target: str  # the model moved, or DEVICE
    lever: str
    before: Value
    after: Value
    reference: float  # the model's p99 level before the step
    samples: list[float] = field(default_factory=list)  # its judged windows since
    # a later step on trial for the same model fell in those windows: one that did not
    # help may only have waited for it (threads that tell once admission frees the CPU)
    overlapped: bool = False
    misses: int = 0  # windows over the objective among those the reference is of

    def overlap(self, target: str, lever: str) -> None:
        """A later step for the same model, on ``target``'s ``lever``, falls in this
        trial's windows.  A step on another lever may be what this one waited for: this
        one is judged again over the windows after it.  A step on the same lever (a cap
        taken a notch further) continues this one and is judged with it, once: else
        each notch, taken before the last one's trial ends, gave the whole chain another
        run of windows to look helpful in, and under a load that makes misses of its own
        (a co-located app) the caps were kept for misses they did not cause."""
        if self.samples and (self.target, self.lever) != (target, lever):
            self.overlapped = True


@dataclass
class Futile:
    """A lever that did not help a model: passed over until ``until`` unless the model's
    p99 has since risen well past ``reference`` (what it was when the lever was tried)."""

    until: int
    reference: float
    fails: int


@dataclass
class Track:
    recent: deque[bool]  # the last windows judged: True for a violation
    p99s: deque[float]  # the last judged windows' p99, for its level
    unmet: Unmet | None = None
    unmet_at: float = 0.0  # its p99 level when it became unmet
    trials: list[Trial] = field(default_factory=list)

    @property
    def violating(self) -> int:
        return sum(self.recent)

    def arm(self, violations: int) -> None:
        """Count ``violations`` as just seen, and nothing before them: after a move (or a
        probe) the next violating window is judged against it, not with the old ones."""
        self.recent.clear()
        self.recent.extend([True] * violations)


@dataclass
class Moved:
    window: int
    tighten: bool
    serves: str = ""  # the model it was last tightened for: what giving it back serves


@dataclass
class Foreign:
    """The cores busy outside the agent and its data plane over the last windows, and their
    level (median) when a step last tightened.  A level well below that one says the load
    the steps met has gone (a co-located app stopped): what was held back for it may be
    probed back without waiting out a back-off its misses set."""

    recent: deque[float]
    at_tighten: float | None = None

    def seen(self, cores: float | None) -> None:
        if cores is not None:
            self.recent.append(cores)

    def tightened(self) -> None:
        self.at_tighten = median(self.recent) if self.recent else None

    def dropped(self, by: float) -> bool:
        """Whether the level fell ``by`` cores below the last tightening's (once each)."""
        if self.at_tighten is None or not self.recent \
                or median(self.recent) >= self.at_tighten - by:
            return False
        self.at_tighten = None
        return True
