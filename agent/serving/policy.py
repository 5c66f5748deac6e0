"""How a version's queue schedules requests: priority levels, the queue's bounds and timeout,
and whether (and how) it batches — read from config.yaml's ``dynamic_batching`` once, when the
version is built, and applied to each request's ``priority`` and ``timeout`` parameters.

Triton's rules: levels 1..L with 1 the highest, ``priority`` 0 (or absent) meaning the
model's default level; ``timeout`` in microseconds, honoured only when the queue allows an
override and then only to shorten the queue's own timeout.  Unlike Triton, a priority above
L is refused rather than quietly served at the default level, and a queue is never unbounded.

Levels at or above ``serve.privileged_priority`` (numerically at or below it; 0: none) need
the bearer token, so that any local process cannot jump the queue.  An untrusted request that
asks for one is refused PERMISSION_DENIED rather than served at the first open level: a
fleet operator reading a client's 403 knows at once what to fix, where a silent demotion
would show only as a latency nobody can explain.  Only asking for a level *above the
model's default* needs the token: the default level (priority 0 or absent) is what every
client gets anyway, so a model with one level (``priority_levels`` 0 or 1) keeps serving
clients that send ``priority: 1``, and no level gained that way is privileged.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agent.serving.errors import ServeError, invalid
from agent.serving.settings import ModelSettings

DEFAULT_MAX_QUEUE = 1024  # queue.max_size absent or 0: this cap, never an unbounded queue
MAX_TIMEOUT_US = 1 << 40  # ~12.7 days, as config.yaml's queue.timeout_us: every wait fits it


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

    def level(self, parameters: Mapping[str, Any], trusted: bool = False,
              privileged: int = 0) -> int:
        """The request's priority level, 1..levels; INVALID_ARGUMENT for a bad ``priority``,
        PERMISSION_DENIED for a level above the default at or above ``privileged`` asked
        for without the token (``trusted``)."""
        priority = _count(parameters, "priority", self.levels,
                          f"this model's priority_levels: 1 is the highest, 0 its default "
                          f"{self.default_level}")
        if priority == 0:
            return self.default_level
        if not trusted and priority <= privileged and priority < self.default_level:
            raise ServeError("PERMISSION_DENIED", f"priority {priority} needs the bearer "
                             f"token (serve.privileged_priority {privileged}); without it "
                             f"ask for {min(self.default_level, privileged + 1)}.."
                             f"{self.levels}, or 0 for the default {self.default_level}")
        return priority

    def timeout(self, parameters: Mapping[str, Any]) -> int:
        """How long (ns) the request may wait in the queue; 0 for as long as it takes."""
        asked = _count(parameters, "timeout", MAX_TIMEOUT_US, "microseconds") * 1000
        if not self.allow_timeout_override or asked == 0:
            return self.timeout_ns
        return asked if self.timeout_ns == 0 else min(asked, self.timeout_ns)


def _count(parameters: Mapping[str, Any], key: str, maximum: int, meaning: str) -> int:
    """An integer parameter 0..maximum (0 when absent); a bool is not an integer here."""
    value = parameters.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= maximum:
        raise invalid(f"parameter {key} must be an integer 0..{maximum} ({meaning}), not "
                      f"{_quoted(value)}")
    return value


def _quoted(value: Any) -> str:
    """A refused value as short as it can be told: a 5,000-digit integer cannot even be
    printed (Python's int limit), a long string or a list is named by its type."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**18:
        return f"an integer of {value.bit_length()} bits"
    if isinstance(value, bool | int | float) or (isinstance(value, str) and len(value) <= 32):
        return repr(value)
    return f"a {type(value).__name__}"
