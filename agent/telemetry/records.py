"""What every outgoing message carries: schema, timestamps and the (session, seq) pair.

``session`` is a persisted counter bumped on every start and every broker connect, and ``seq``
rises by one per telemetry record within a session, so a subscriber can see gaps and drop
duplicates by (session, seq).  ``clock_synced`` tells whether ``ts`` can be trusted: edge
boxes often boot without an RTC and run for minutes on a wrong wall clock.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
_TIME_ERROR = 5  # adjtimex(2): the clock is not synchronised
_CLOCK_CHECK_S = 60.0


class _ClockState:
    """adjtimex(2) with modes 0 reads the kernel's NTP state without changing anything."""

    def __init__(self) -> None:
        self._checked_at = -_CLOCK_CHECK_S
        self._synced = False
        name = ctypes.util.find_library("c")
        self._adjtimex = getattr(ctypes.CDLL(name), "adjtimex", None) if name else None

    def synced(self) -> bool:
        now = time.monotonic()
        if now - self._checked_at >= _CLOCK_CHECK_S:
            self._checked_at = now
            self._synced = self._read()
        return self._synced

    def _read(self) -> bool:
        if self._adjtimex is None:
            return False
        buffer = ctypes.create_string_buffer(512)  # struct timex is ~208 bytes; modes=0 first
        state = int(self._adjtimex(buffer))
        return 0 <= state != _TIME_ERROR


_clock = _ClockState()


def stamp(schema: str, **fields: Any) -> dict[str, Any]:
    """A payload with the contract's schema name and timestamps."""
    return {"schema": schema, "ts": int(time.time() * 1000),
            "mono_ms": int(time.monotonic() * 1000), "clock_synced": _clock.synced(), **fields}


def encode(payload: dict[str, Any]) -> bytes:
    """Compact JSON: telemetry is sent every second by thousands of nodes."""
    return json.dumps(payload, separators=(",", ":")).encode()


def hottest_c(metrics: dict[str, Any]) -> float | None:
    """The hottest thermal zone of a record's ``metrics`` (None without a reading): what
    the status line, the health guard and ``fleet watch`` all show."""
    temperatures = [zone["temp_c"] for zone in metrics.get("thermal") or []
                    if zone.get("temp_c") is not None]
    return max(temperatures) if temperatures else None


class Sequence:
    """The current session and the next ``seq``; shared by the sampler and the link."""

    def __init__(self, session: int) -> None:
        self._lock = threading.Lock()
        self._session, self._next = session, 0

    def begin(self, session: int, mark: Callable[[], None] = lambda: None) -> int:
        """A new session (a connect): ``seq`` starts again at 0.  ``mark`` runs under the lock
        that :meth:`issue` holds while a record is numbered and queued: the link marks its
        backlog there, so the backlog holds every record of the ended session and none of the
        new one, however the sampler's thread interleaves.  Returns how many records the
        session that ends took, so the link can say how many a subscriber should have."""
        with self._lock:
            taken = self._next
            self._session, self._next = session, 0
            mark()
            return taken

    @property
    def session(self) -> int:
        return self._session

    def issue(self, queue: Callable[[int, int], T]) -> T:
        """Number the next record (session, seq) and queue it, as one step (see begin)."""
        with self._lock:
            seq = self._next
            self._next += 1
            return queue(self._session, seq)
