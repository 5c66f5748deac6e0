"""The audit trail and what keeps junk from flooding it: one JSON object per line, a token
bucket for the replies and records that junk earns, and the counts that summarise the rest.

Audit records go to the ``agent.audit`` logger (journald keeps them; a SIEM parses them).
Every value is a JSON value encoded with ``ensure_ascii``: an id holding a newline or a fake
log line stays inside its string, so no message can forge a second record.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

audit_logger = logging.getLogger("agent.audit")

JUNK_REPLIES_PER_S = 5.0  # refill of the bucket for replies to unsigned or malformed messages
JUNK_BURST = 20  # what a quiet node answers at once before the rate applies


def record(event: str, level: int = logging.INFO, **fields: Any) -> None:
    """One audit line: ``{"event": ..., <fields not None>}``, untrusted values escaped."""
    document = {"event": event, **{k: v for k, v in fields.items() if v is not None}}
    try:
        text = json.dumps(document, ensure_ascii=True, allow_nan=False, default=str)
    except (ValueError, TypeError, RecursionError):  # a value JSON has no form for
        text = json.dumps({k: v if isinstance(v, str | int | bool) else repr(v)
                           for k, v in document.items()}, ensure_ascii=True)
    audit_logger.log(level, "%s", text)


class TokenBucket:
    """``rate`` tokens a second up to ``burst``: bursts pass, a flood is cut to the rate."""

    def __init__(self, rate: float, burst: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst, self.clock = rate, burst, clock
        self._tokens, self._at = float(burst), clock()
        self._lock = threading.Lock()

    def take(self) -> bool:
        with self._lock:
            now = self.clock()
            self._tokens = min(float(self.burst), self._tokens + (now - self._at) * self.rate)
            self._at = now
            if self._tokens < 1:
                return False
            self._tokens -= 1
            return True


class JunkCounter:
    """Why messages were refused, by code, and how many refusals went unanswered."""

    def __init__(self, bucket: TokenBucket) -> None:
        self.bucket = bucket
        self.by_code: Counter[str] = Counter()
        self.suppressed = 0  # replies and audit lines left out by the bucket
        self._since_last = 0  # suppressed since the last audit line that got through
        self._lock = threading.Lock()

    def admit(self, code: str) -> int | None:
        """Count a refusal of junk; the number suppressed since the last one answered when
        this one may be answered (and audited), None when the bucket says no."""
        with self._lock:
            self.by_code[code] += 1
            if not self.bucket.take():
                self.suppressed += 1
                self._since_last += 1
                return None
            skipped, self._since_last = self._since_last, 0
            return skipped

    def count(self, code: str) -> None:
        """A refusal that is always answered (the envelope was validly signed)."""
        with self._lock:
            self.by_code[code] += 1
