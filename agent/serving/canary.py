"""The canary of a load: a new version serves unversioned requests beside the old one for a
while, and is judged against it before the old one is dropped.

With live traffic the new version's calls during the window are judged against the old
version's figures from before the switch.  Without it (an idle edge box) the judge makes its
own: synthetic requests sent alternately to the new and the old version, through the same
``infer`` a client's request takes, so both are measured side by side under one load.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from agent.inference.loop import all_finite
from agent.inference.stats import LatencyStats, Window
from agent.serving.core import InferRequest, InferResult
from agent.serving.errors import ServeError, invalid
from agent.serving.state import Served, Slot, swap
from agent.serving.versions import Version, synthetic
from agent.validation import SettingsError, number, validate

LIVE_CALLS = 20  # fewer calls than this in the window: no live traffic to judge
PROBE_PAIRS = 100  # probe calls per version over a window without live traffic
LOAD_PARAMETERS = ("canary",)

Infer = Callable[[InferRequest], InferResult]
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CanaryLimits:
    """How long to watch and what the new version must stay within.  ``p99_floor_ms``: a
    p99 only fails when it is also this much above the old one, so a scheduler hiccup on a
    sub-millisecond model is not a regression."""

    canary_s: float = 5.0
    max_p99_ratio: float = 2.0
    max_error_rate: float = 0.003
    max_p99_ms: float | None = None  # an absolute bound besides the ratio
    p99_floor_ms: float = 1.0


_SCHEMA = {"canary_s": number(0.01, 3600), "max_p99_ratio": number(1.0, 1000),
           "max_error_rate": number(0.0, 1.0), "max_p99_ms": number(0.001, 3_600_000)}


def parse_load_parameters(parameters: Mapping[str, Any],
                          p99_floor_ms: float = 1.0) -> CanaryLimits | None:
    """The canary a load asks for (None: none); INVALID_ARGUMENT for anything else.  The
    canary may come as a mapping (HTTP's JSON) or a JSON string (gRPC's string parameter)."""
    for key in parameters:
        if key not in LOAD_PARAMETERS:
            raise invalid(f"load parameter {key!r} is not supported (supported: "
                          f"{', '.join(LOAD_PARAMETERS)})")
    value = parameters.get("canary")
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as error:
            raise invalid(f"load parameter canary: not JSON ({error})") from None
    try:
        validate(value, _SCHEMA, "canary", "load parameters")
    except SettingsError as error:
        raise invalid(str(error)) from None
    return CanaryLimits(**value, p99_floor_ms=p99_floor_ms)


def _ms(ns: float) -> str:
    return f"{ns / 1e6:.3g}"


def robust_p99_ns(window: Window) -> int:
    """The p99, except that below 100 calls (where a p99 is the largest call) the largest is
    left out: one scheduler hiccup must not decide a canary either way."""
    n = window.count
    return window.percentile_ns(99.0 if n >= 100 or n < 2 else 100.0 * (n - 1.5) / n)


def verdict(new: Window, old: Window | None, limits: CanaryLimits) -> str | None:
    """Why the new version fails against the old one's figures; None when it passes."""
    calls = new.count + new.errors
    if calls == 0:
        return "the new version completed no call during the canary"
    if new.error_rate > limits.max_error_rate:
        return (f"error rate {new.error_rate:.1%} ({new.errors} of {calls} calls) above "
                f"{limits.max_error_rate:.1%}")
    if limits.max_p99_ms is not None and new.count and \
            robust_p99_ns(new) > limits.max_p99_ms * 1e6:
        return f"p99 {_ms(robust_p99_ns(new))} ms above {limits.max_p99_ms:g} ms"
    if old is None or old.count == 0 or new.count == 0:
        return None
    p99, before = robust_p99_ns(new), robust_p99_ns(old)
    if p99 > limits.max_p99_ratio * before and p99 - before > limits.p99_floor_ms * 1e6:
        return f"p99 {_ms(p99)} ms above {limits.max_p99_ratio:g}x the {_ms(before)} ms before"
    return None


@dataclass
class _ProbeLoad:
    """Synthetic calls to one version, measured on their own."""

    version: Version
    request: InferRequest
    stats: LatencyStats

    def send(self, infer: Infer) -> None:
        start = time.perf_counter_ns()
        self.stats.call_started(start)
        try:
            ok = all_finite([t.array for t in infer(self.request).outputs])
        except ServeError:
            ok = False
        self.stats.record(time.perf_counter_ns() - start, ok)


def _probe_load(version: Version) -> _ProbeLoad:
    request = InferRequest(version.model, str(version.number), synthetic(version.inputs),
                           id="canary-probe")
    return _ProbeLoad(version, request, LatencyStats())


def watch(infer: Infer, new: Version, old: Version, limits: CanaryLimits,
          clock: Callable[[], float], sleep: Callable[[float], Any]) -> str | None:
    """Watch ``new`` (already serving unversioned requests) for ``limits.canary_s``; the
    reason it fails, None when it passes."""
    old_before = old.stats.window()
    new_start = new.stats.window()
    probes = (_probe_load(new), _probe_load(old))
    sent = 0
    deadline = clock() + limits.canary_s
    interval = limits.canary_s / PROBE_PAIRS
    while clock() < deadline:
        window = new.stats.window().since(new_start)
        if window.count + window.errors - sent < LIVE_CALLS:
            for probe in probes:
                probe.send(infer)
            sent += 1
        left = deadline - clock()
        if left > 0:
            sleep(min(interval, left))
    window = new.stats.window().since(new_start)
    if window.count + window.errors - sent >= LIVE_CALLS:
        reference = old_before if old_before.count >= LIVE_CALLS else (
            probes[1].stats.window())
        return verdict(window, reference, limits)
    return verdict(probes[0].stats.window(), probes[1].stats.window(), limits)


def trial(slot: Slot, old: Served, new: Served, limits: CanaryLimits, infer: Infer,
          clock: Callable[[], float], sleep: Callable[[float], Any],
          stopping: threading.Event) -> None:
    """Serve ``new``'s default beside ``old`` and judge it; on failure ``old`` serves
    again (one assignment) and FAILED_PRECONDITION names the reason."""
    candidate = new.versions[new.default]
    beside = Served({**old.versions, **new.versions}, new.default, new.settings)
    candidate.canary = True
    slot.served = beside
    try:
        reason = watch(infer, candidate, old.versions[old.default], limits, clock, sleep)
    finally:
        candidate.canary = False
    if reason is None and stopping.is_set():
        reason = "the server stopped during the canary"
    if reason is None:
        logger.info("model %s version %d passed its canary", slot.name, candidate.number)
        return
    swap(slot, old)
    message = (f"model {slot.name} version {candidate.number}: canary failed: {reason}; "
               f"version {old.default} serves again")
    slot.failed = {candidate.number: f"canary failed: {reason}"}
    logger.warning("%s", message)
    raise ServeError("FAILED_PRECONDITION", message)
