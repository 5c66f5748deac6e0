"""How a version's queue schedules requests: priority levels, the queue's bounds and timeout,
and whether (and how) it batches — read from config.yaml's ``dynamic_batching`` once, when the
version is built, and applied to each request's ``priority`` and ``timeout`` parameters.

Triton's rules: levels 1..L with 1 the highest, ``priority`` 0 (or absent) meaning the
model's default level; ``timeout`` in microseconds, honoured only when the queue allows an
override and then only to shorten the queue's own timeout.  Unlike Triton, a priority above
L is refused rather than quietly served at the default level, and a queue is never unbounded.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agent.serving.errors import invalid
from agent.serving.settings import ModelSettings

DEFAULT_MAX_QUEUE = 1024  # queue.max_size absent or 0: this cap, never an unbounded queue


@dataclass(frozen=True)
class SchedulePolicy:
    levels: int = 1
    default_level: int = 1
    max_queue: int = DEFAULT_MAX_QUEUE
    timeout_ns: int = 0  # 0: a queued request waits as long as it takes
    allow_timeout_override: bool = False
    max_batch: int = 0  # 0: every request runs alone
    preferred: tuple[int, ...] = ()  # ascending, each within max_batch
    delay_ns: int = 0

    @classmethod
    def of(cls, settings: ModelSettings, max_batch_size: int) -> SchedulePolicy:
        """The policy of a version with this config and (derived) max_batch_size; without
        ``dynamic_batching`` requests run one by one through a default queue."""
        dynamic = settings.dynamic_batching
        if dynamic is None:
            return cls()
        levels = max(1, int(dynamic.get("priority_levels", 0)))
        queue = dynamic.get("queue", {})
        return cls(
            levels=levels,
            default_level=int(dynamic.get("default_priority_level") or levels),
            max_queue=int(queue.get("max_size") or DEFAULT_MAX_QUEUE),
            timeout_ns=int(queue.get("timeout_us", 0)) * 1000,
            allow_timeout_override=bool(queue.get("allow_timeout_override", False)),
            max_batch=max_batch_size,
            preferred=tuple(sorted({size for size in dynamic.get("preferred_batch_size", [])
                                    if size <= max_batch_size})),
            delay_ns=int(dynamic.get("max_queue_delay_us", 0)) * 1000,
        )

    @property
    def batching(self) -> bool:
        return self.max_batch > 0

    def level(self, parameters: Mapping[str, Any]) -> int:
        """The request's priority level, 1..levels; INVALID_ARGUMENT for a bad ``priority``."""
        priority = _count(parameters, "priority")
        if priority == 0:
            return self.default_level
        if priority > self.levels:
            raise invalid(f"priority {priority} is above this model's priority_levels "
                          f"{self.levels} (1 is the highest; 0 the default, "
                          f"{self.default_level})")
        return priority

    def timeout(self, parameters: Mapping[str, Any]) -> int:
        """How long (ns) the request may wait in the queue; 0 for as long as it takes."""
        asked = _count(parameters, "timeout") * 1000
        if not self.allow_timeout_override or asked == 0:
            return self.timeout_ns
        return asked if self.timeout_ns == 0 else min(asked, self.timeout_ns)


def _count(parameters: Mapping[str, Any], key: str) -> int:
    """A non-negative integer parameter (0 when absent); a bool is not an integer here."""
    value = parameters.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise invalid(f"parameter {key} must be a non-negative integer, not {value!r}")
    return value
