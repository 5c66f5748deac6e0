"""The device's latency knobs (CPU frequency floors, a PM QoS hold) as one more dimension of
``model tune``: a ladder of rungs, cheapest first, that the search moves along like any other
setting.  Rung 0 is the profile's own settings, what the device runs without the tuner, so a
search without knobs is a search at rung 0.

The ladder is opaque here (labels and an ``apply(rung)``); the tuning layer owns what a rung
writes and how it is journaled and put back.  A rung is device-wide, not a config.yaml key:
the tuner reports the best one and always restores the ladder when it ends.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol


class KnobLadder(Protocol):
    """What the tuning layer's latency knobs offer (``LatencyKnobs``)."""

    def ladder(self) -> Sequence[object]: ...

    def apply(self, rung: int) -> None: ...

    def restore(self) -> None: ...


@dataclass(frozen=True)
class KnobRungs:
    """The rungs' labels (index: the rung), how to move to one, and how to put back what
    the device had before (rung 0 and no hold)."""

    labels: Sequence[str]
    apply: Callable[[int], None]
    restore: Callable[[], None]

    @classmethod
    def of(cls, knobs: KnobLadder, label: Callable[[object], str] = str) -> KnobRungs:
        return cls(tuple(label(step) for step in knobs.ladder()), knobs.apply, knobs.restore)


class KnobSetter:
    """Moves the ladder only when a candidate's rung differs from the one applied (each move
    is a journaled change), and restores it on exit whatever happened in between."""

    def __init__(self, rungs: KnobRungs | None) -> None:
        self.rungs = rungs
        self._applied: int | None = None  # unknown until the first move

    def __enter__(self) -> KnobSetter:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.rungs is not None:
            self._applied = None
            self.rungs.restore()

    def move(self, rung: int) -> None:
        if self.rungs is not None and rung != self._applied:
            self._applied = None  # a refused move may leave it anywhere
            self.rungs.apply(rung)
            self._applied = rung

    def label(self, rung: int) -> str:
        return self.rungs.labels[rung] if self.rungs is not None else ""
