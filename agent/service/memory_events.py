"""The data plane's ``memory.events`` as agent events: an OOM kill is news for the fleet.

The counters (``high``, ``max``, ``oom``, ``oom_kill``) are hierarchical and live on the
cgroup the limits are on (the slice, or the leaf), so they keep counting across the data
plane's restarts; a rise between two looks is one event with the counts before and after.
``high`` rises continuously while the data plane is throttled at memory.high, so each
counter makes at most one event per look.
"""

from __future__ import annotations

from collections.abc import Callable

from agent.tuning.placement import MEMORY_EVENTS, Placement

EVENT_OF = {"oom_kill": "data_plane_oom_kill", "oom": "data_plane_oom",
            "max": "data_plane_memory_max", "high": "data_plane_memory_high"}


class MemoryEventsWatch:
    """Compare the counters with the last look; ``check`` once a second from the main loop."""

    def __init__(self, placement: Placement, on_event: Callable[..., None]) -> None:
        self.placement, self.on_event = placement, on_event
        self.last = placement.memory_events()

    def check(self) -> list[str]:
        """Report each counter that rose; returns the event types sent."""
        now = self.placement.memory_events()
        if now is None:
            return []
        before, self.last = self.last or {}, now
        sent = []
        for name in MEMORY_EVENTS:
            old, new = before.get(name), now.get(name)
            if new is not None and old is not None and new > old:
                self.on_event(EVENT_OF[name], cgroup=self.placement.limits_dir, counter=name,
                              before=old, after=new)
                sent.append(EVENT_OF[name])
        return sent
