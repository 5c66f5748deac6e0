"""What the composition root starts in order and stops in reverse (the link and tuning last).

Every running piece of the agent (the hot-plug watch, tuning, inference, the MQTT link, the
controller, the exporter, the sampler) is a ``Part``; a supervised child process (the
inference data plane) is one more ``Part`` in the same list, reporting its faults through
``problems()`` so that they make the agent ``degraded`` without touching the root.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class Ending:
    """How this stop goes: how long the link may flush the outbox, whether tuning rolls back."""

    flush_s: float
    rollback: bool


class Part(Protocol):
    """Started once, stopped once; ``problems()`` says what an operator must fix (empty when
    it works)."""

    def start(self) -> None: ...

    def stop(self, ending: Ending) -> None: ...

    def problems(self) -> list[str]: ...


def _no_problems() -> list[str]:
    return []


@dataclass(frozen=True)
class Wrapped:
    """A part made of another package's start and stop (the link, the sampler, ...), which
    know nothing of ``Ending``."""

    start: Callable[[], None]
    stop: Callable[[Ending], None]
    problems: Callable[[], list[str]] = field(default=_no_problems)
