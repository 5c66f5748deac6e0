"""The instant levers the QoS controller moves on a served version, live: its queue delay and
preferred batch sizes (the queue's next cut uses them) and an admission cap in requests per
second.  The control plane decides; this only checks what it is asked and executes it.
``cpus`` (the CPUs a model's threads run on) moves its threads where they are
(Version.place), ``realtime`` lifts them to SCHED_FIFO (Version.lift, placement.py).
``threads`` (intra-op threads per session) is not instant: it rebuilds the model's versions
off the hot path and swaps them in (rebuild.py); the route answers at once
and the statistics show them once swapped.

What comes in is a JSON document from a socket (the token-guarded ``…/levers`` route), so it
is checked in full, bounded, before anything changes: a document that names an unknown key
or a value out of range changes nothing.  Nothing here is written to config.yaml: a reload
of the model, or a new data plane, serves config.yaml's values again, which the statistics
show beside the live ones (``edge_agent.levers``).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from agent.kernel.parsers import format_cpulist
from agent.serving.errors import invalid
from agent.serving.policy import SchedulePolicy

MAX_DELAY_US = 10_000_000  # as config.yaml's dynamic_batching.max_queue_delay_us
MAX_PREFERRED = 16  # sizes in one preferred_batch_size list
MAX_ADMIT_RPS = 1_000_000.0
MAX_THREADS = 1024  # as config.yaml's instances[].threads; rebuild.py bounds it per model
KEYS = ("max_queue_delay_us", "preferred_batch_size", "admit_rps", "threads", "cpus",
        "realtime")
BURST_S = 0.1  # an admission cap lets this much of a second's rate through at once
# ... and at least this many requests: a bucket one token deep drops what accrues while it
# is full, so requests that come a little late against the cap's period (any real client's
# jitter) were admitted at about 3.1 a second under a cap of 4 (bench/qos.py)
MIN_BURST = 2.0


@dataclass(frozen=True)
class LeverChange:
    """What to change (None: leave as it is; ``admit`` set with ``admit_rps`` None: no cap;
    ``rethread`` set with ``threads`` None: config.yaml's threads; ``place`` set with
    ``cpus`` None: no placement; ``lift`` set: ``realtime`` as it says)."""

    delay_us: int | None = None
    preferred: tuple[int, ...] | None = None
    admit: bool = False
    admit_rps: float | None = None
    rethread: bool = False
    threads: int | None = None
    place: bool = False
    cpus: tuple[int, ...] | None = None
    lift: bool = False
    realtime: bool = False

    @property
    def rebuilds(self) -> bool:
        """Whether the change needs the versions rebuilt (rebuild.py): new threads do, CPUs
        alone do not (the threads move where they are)."""
        return self.rethread


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_change(document: Any) -> LeverChange:
    """A levers request checked: an object of KEYS, at least one; INVALID_ARGUMENT naming
    the key and what it takes otherwise."""
    if not isinstance(document, Mapping) or not document:
        raise invalid(f"the levers request must be a JSON object with at least one of "
                      f"{', '.join(KEYS)}")
    unknown = [str(key)[:40] for key in document if key not in KEYS]
    if unknown:
        raise invalid(f"unknown lever {unknown[0]!r} (levers: {', '.join(KEYS)})")
    delay = document.get("max_queue_delay_us")
    if delay is not None and not (_integer(delay) and 0 <= delay <= MAX_DELAY_US):
        raise invalid(f"max_queue_delay_us must be an integer 0..{MAX_DELAY_US}")
    preferred = document.get("preferred_batch_size")
    if preferred is not None and not (
            isinstance(preferred, list) and len(preferred) <= MAX_PREFERRED
            and all(_integer(size) and 1 <= size <= 1 << 16 for size in preferred)):
        raise invalid(f"preferred_batch_size must be a list of at most {MAX_PREFERRED} "
                      "integers 1..65536")
    rate = document.get("admit_rps")
    if rate is not None and (isinstance(rate, bool) or not isinstance(rate, int | float)
                             or not 0.001 <= rate <= MAX_ADMIT_RPS):
        raise invalid(f"admit_rps must be null (no cap) or a number 0.001..{MAX_ADMIT_RPS:g}")
    threads = document.get("threads")
    if threads is not None and not (_integer(threads) and 1 <= threads <= MAX_THREADS):
        raise invalid(f"threads must be null (config.yaml's) or an integer 1..{MAX_THREADS}")
    realtime = document.get("realtime", False)
    if not isinstance(realtime, bool):
        raise invalid("realtime must be true (the model's threads at SCHED_FIFO) or false")
    return LeverChange(delay, None if preferred is None else tuple(sorted(set(preferred))),
                       "admit_rps" in document, None if rate is None else float(rate),
                       "threads" in document, threads, "cpus" in document,
                       _cpus(document.get("cpus")), "realtime" in document, realtime)


def _cpus(value: Any) -> tuple[int, ...] | None:
    """A placement: CPU ids this process may run on (sched_getaffinity), each once."""
    if value is None:
        return None
    allowed = sorted(os.sched_getaffinity(0))
    if not (isinstance(value, list) and 0 < len(value) <= len(allowed)
            and all(_integer(cpu) and cpu in allowed for cpu in value)
            and len(set(value)) == len(value)):
        raise invalid("cpus must be null (no placement) or a list of distinct CPU ids this "
                      f"data plane may run on (allowed: {format_cpulist(allowed)})")
    return tuple(sorted(value))


def retuned(policy: SchedulePolicy, change: LeverChange, label: str) -> SchedulePolicy:
    """``policy`` with the change's queue delay and preferred sizes; INVALID_ARGUMENT for a
    version that does not batch, or a preferred size above its max_batch_size."""
    if change.delay_us is None and change.preferred is None:
        return policy
    if not policy.batching:
        raise invalid(f"{label} does not batch (max_batch_size 0): it has no queue delay "
                      "or preferred batch size to change")
    preferred = policy.preferred if change.preferred is None else change.preferred
    if preferred and preferred[-1] > policy.max_batch:
        raise invalid(f"preferred_batch_size {preferred[-1]} is above the max_batch_size "
                      f"{policy.max_batch} of {label}")
    delay = policy.delay_ns if change.delay_us is None else change.delay_us * 1000
    return dataclasses.replace(policy, preferred=preferred, delay_ns=delay)


def view(policy: SchedulePolicy, admission: Admission | None = None) -> dict[str, Any]:
    """The levers as served (the statistics' and the route's answer); without
    ``admission``, as config.yaml sets them (no cap)."""
    return {"max_queue_delay_us": policy.delay_ns // 1000,
            "preferred_batch_size": list(policy.preferred),
            "max_batch_size": policy.max_batch,
            "admit_rps": admission.rate if admission is not None else None,
            "not_admitted": admission.refused if admission is not None else 0}


class Admission:
    """A cap on the requests a version admits per second: a token bucket BURST_S deep (at
    least MIN_BURST), with one token when the cap is set.  With no cap (the default)
    ``admit`` reads one attribute and takes no lock."""

    def __init__(self, clock: Callable[[], int] = time.perf_counter_ns) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self.rate: float | None = None
        self.refused = 0  # requests refused by the cap, since the version was built
        self._tokens = 0.0
        self._at = 0

    def set_rate(self, rate: float | None) -> None:
        with self._lock:
            self.rate = rate
            self._tokens = 1.0
            self._at = self._clock()

    @staticmethod
    def _depth(rate: float) -> float:
        return max(MIN_BURST, rate * BURST_S)

    def admit(self) -> bool:
        """Whether one more request is admitted now (counted in ``refused`` if not)."""
        if self.rate is None:
            return True
        with self._lock:
            rate = self.rate
            if rate is None:
                return True
            now = self._clock()
            self._tokens = min(self._depth(rate), self._tokens + (now - self._at) * rate / 1e9)
            self._at = now
            if self._tokens >= 1.0:
                self._tokens -= 1.0
                return True
            self.refused += 1
            return False
