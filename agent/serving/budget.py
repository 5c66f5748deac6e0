"""The data plane's memory budget: every byte a request holds while it is in flight (its body
as read, tensors decoded from it, its queued inputs, the outputs being sent) is admitted
against one process-wide limit, ``serve.max_inflight_mb``.

A per-request cap (``serve.max_request_mb``) does not bound the process: sixteen bodies just
under it at once, or a small body that decodes into much more (JSON numbers, typed gRPC
contents), took a 4 GB board into the OOM killer.  Admission happens *before* the work a
reservation pays for, and a request that does not fit is refused at once with
``RESOURCE_EXHAUSTED`` (HTTP 503: the server is busy, try again; not the body's fault as a
413 says) rather than waiting: a waiting request would hold its socket, its thread and,
for gRPC, its already-received message, which is the memory being protected.  Once the
work is done (a run's outputs exist) its bytes are counted without refusal, so the figures
stay true and the next request sees them.
"""

from __future__ import annotations

import threading
from types import TracebackType

from agent.serving.errors import ServeError

MB = 1 << 20
# Without serve.max_inflight_mb: an eighth of the device's memory (512 MB on a 4 GB board),
# never less than a few of the largest requests, never more than this.
DEFAULT_MAX_BYTES = 1 << 30
REQUESTS_AT_LEAST = 4


def default_limit_bytes(total_memory_bytes: int | None, max_request_bytes: int) -> int:
    """The budget when the config leaves it to the device (``max_inflight_mb: null``)."""
    share = (total_memory_bytes or 4 << 30) // 8
    return max(min(share, DEFAULT_MAX_BYTES), REQUESTS_AT_LEAST * max_request_bytes)


def exhausted(message: str) -> ServeError:
    """The refusal of a request the budget has no room for: RESOURCE_EXHAUSTED / 503."""
    return ServeError("RESOURCE_EXHAUSTED", message, http_status=503)


class MemoryBudget:
    """Bytes in flight across the whole process; thread-safe, never blocks."""

    def __init__(self, limit_bytes: int) -> None:
        if limit_bytes <= 0:
            raise ValueError("a memory budget needs a positive limit")
        self.limit_bytes = limit_bytes
        self.in_use = 0
        self.peak = 0
        self.refused = 0  # requests (or their later steps) refused for want of room
        self._lock = threading.Lock()

    def reserve(self, nbytes: int, what: str) -> Reservation:
        """A reservation of ``nbytes``; RESOURCE_EXHAUSTED when they do not fit now."""
        reservation = Reservation(self)
        reservation.grow(nbytes, what)
        return reservation

    def _take(self, nbytes: int, what: str, force: bool) -> None:
        with self._lock:
            if not force and self.in_use + nbytes > self.limit_bytes:
                self.refused += 1
                free = max(self.limit_bytes - self.in_use, 0)
                raise exhausted(f"{what}: {nbytes} bytes do not fit the data plane's memory "
                                f"budget now ({free} of serve.max_inflight_mb "
                                f"{self.limit_bytes / MB:g} MB free); try again")
            self.in_use += nbytes
            self.peak = max(self.peak, self.in_use)

    def _give(self, nbytes: int) -> None:
        with self._lock:
            self.in_use -= nbytes

    def snapshot(self) -> dict[str, int]:
        """For statistics and metrics: the limit, what is held now, the peak, the refusals."""
        with self._lock:
            return {"limit_bytes": self.limit_bytes, "in_use_bytes": self.in_use,
                    "peak_bytes": self.peak, "refused": self.refused}


class Reservation:
    """What one request holds; released once (``release`` or leaving its ``with``)."""

    __slots__ = ("_budget", "held")

    def __init__(self, budget: MemoryBudget) -> None:
        self._budget = budget
        self.held = 0

    def grow(self, nbytes: int, what: str) -> None:
        """More bytes before the work that needs them; RESOURCE_EXHAUSTED if they do not fit
        (what was held stays held until release)."""
        if nbytes > 0:
            self._budget._take(nbytes, what, force=False)
            self.held += nbytes

    def count(self, nbytes: int) -> None:
        """Bytes that already exist (a run's outputs): counted, never refused."""
        if nbytes > 0:
            self._budget._take(nbytes, "", force=True)
            self.held += nbytes

    def release(self) -> None:
        held, self.held = self.held, 0
        if held:
            self._budget._give(held)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.release()
