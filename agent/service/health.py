"""The agent's health policy, in one place.

Three verdicts with three consequences: ``Liveness`` decides whether systemd hears
``WATCHDOG=1`` (a hung MQTT link gets the agent restarted); ``degraded``
lists what an operator must fix while the agent stays up and reachable; ``warnings`` what
works but not as well as the board could.  ``guard_problem`` is the health window a guarded
fleet command (``apply-profile``) must pass to keep its change.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from agent.inference.stats import Window
from agent.service.parts import Part
from agent.telemetry.records import hottest_c

LINK_STALL_S = 10.0


class Heartbeat(Protocol):
    @property
    def heartbeat(self) -> float: ...


class LinkView(Protocol):
    """The MQTT link as the watchdog sees it."""

    @property
    def alive(self) -> bool: ...

    @property
    def status(self) -> Heartbeat: ...


class Unused(Protocol):
    @property
    def device(self) -> str: ...

    @property
    def reason(self) -> str: ...


class Liveness:
    """Why the agent must not tell systemd it is alive, or None (see systemd.Watchdog): the
    link ended or its thread made no round for LINK_STALL_S.  The data plane is not asked: a
    fault there makes the agent ``degraded`` and restarts that process (``dataplane``), and
    the control plane must stay up for the fleet to fix the node."""

    def __init__(self, link: Callable[[], LinkView | None]) -> None:
        self.link = link

    def problem(self) -> str | None:
        link = self.link()
        if link is not None:
            if not link.alive:
                return "the MQTT link has ended"
            quiet = time.monotonic() - link.status.heartbeat
            if quiet > LINK_STALL_S:
                return f"the MQTT link made no progress for {quiet:.0f} s"
        return None


LINK_RESTARTS = 5  # link threads started again after dying, per LINK_RESTART_WINDOW_S
LINK_RESTART_WINDOW_S = 600.0


class LinkRestarts:
    """Whether a link thread that died may be started again in this process: at most
    LINK_RESTARTS in LINK_RESTART_WINDOW_S.  Beyond that it stays dead, ``Liveness``
    withholds the watchdog ping and systemd restarts the whole agent.  ``problem`` names a
    death within the window: the agent is ``degraded`` for that long."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._deaths: list[tuple[float, str]] = []  # when, why

    def died(self, why: str) -> None:
        self._deaths.append((self.clock(), why))

    def allowed(self) -> bool:
        """Whether the dead thread may be started again now."""
        return len(self._recent()) <= LINK_RESTARTS

    def _recent(self) -> list[str]:
        now = self.clock()
        self._deaths = [d for d in self._deaths if now - d[0] < LINK_RESTART_WINDOW_S]
        return [why for _when, why in self._deaths]

    def problem(self) -> str | None:
        recent = self._recent()
        if not recent:
            return None
        verdict = ("restarted" if len(recent) <= LINK_RESTARTS else
                   f"not restarted again (more than {LINK_RESTARTS} in "
                   f"{LINK_RESTART_WINDOW_S:.0f} s; the watchdog lets systemd restart the agent)")
        return (f"mqtt: the link thread died {len(recent)} time(s) in the last "
                f"{LINK_RESTART_WINDOW_S:.0f} s (last: {recent[-1]}); {verdict}")


def degraded(parts: Iterable[Part], outbox_error: str | None) -> list[str]:
    """What makes the agent ``degraded``: any part's problems, then an outbox that cannot
    write (its records wait in memory)."""
    found = [problem for part in parts for problem in part.problems()]
    if outbox_error:
        found.append(f"outbox: {outbox_error}")
    return found


def warnings(unused: Iterable[Unused]) -> list[str]:
    """What works but not as well as this board could: an accelerator left unused."""
    return [f"{accelerator.device} is not used: {accelerator.reason}" for accelerator in unused]


def guard_problem(now: Window | None, before: Window | None,
                  last_sample: dict[str, Any] | None, guard: dict[str, Any]) -> str | None:
    """Why the window between ``before`` and ``now`` is unhealthy (inference error rate or
    p99 against the values before, the hottest thermal zone), or None."""
    if now is not None and before is not None and now.generation == before.generation:
        window = now.since(before)
        calls = window.count + window.errors
        if calls and window.errors / calls > guard["max_error_rate"]:
            return (f"inference error rate {window.errors / calls:.2%} above "
                    f"{guard['max_error_rate']:.2%}")
        old_p99 = before.percentile_ns(99)
        new_p99 = window.percentile_ns(99)
        if before.count and window.count and new_p99 > guard["max_p99_ratio"] * old_p99:
            return (f"inference p99 {new_p99 / 1e6:.3f} ms above {guard['max_p99_ratio']}x "
                    f"the {old_p99 / 1e6:.3f} ms before")
    hottest = hottest_c((last_sample or {}).get("metrics") or {})
    if guard.get("max_temp_c") is not None and hottest is not None and \
            hottest > guard["max_temp_c"]:
        return f"hottest thermal zone {hottest:.1f} °C above {guard['max_temp_c']} °C"
    return None
