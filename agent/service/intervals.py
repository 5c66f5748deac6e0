"""Telemetry's inference figures per interval: each sample carries the calls since the one
before, so a dashboard sees a slowdown when it happens instead of diluted into every call
since the data plane started.

The data plane reports each version's window since it was built (``edge_agent.window``);
this remembers the last one per (model, version) and reports ``now.since(before)``.  A window
that cannot follow the one remembered, because the data plane is another process, the
statistics were reset (the generation changed) or the version was built afresh (its first
call differs), starts a new run: its interval is all of it.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Iterable, Mapping
from typing import Any

from agent.inference.stats import Window

logger = logging.getLogger(__name__)

Key = tuple[str, str]  # (model, version)


def key(entry: Mapping[str, Any]) -> Key:
    """A statistics entry's (model, version)."""
    return str(entry.get("name")), str(entry.get("version"))


def _follows(before: Window, now: Window) -> bool:
    """Whether ``now`` is a later copy of the same counters as ``before``."""
    return (before.generation == now.generation
            and before.first_start_ns in (None, now.first_start_ns))


def _figures(interval: Window, total: Window) -> dict[str, Any]:
    """The contract's figures of the interval, with the totals since start beside them."""
    return {**interval.snapshot(), "count_total": total.count, "errors_total": total.errors}


class Intervals:
    """The windows of the last sample, per (model, version), of one data-plane process."""

    def __init__(self) -> None:
        self._process: Hashable = None
        self._last: dict[Key, Window] = {}

    def advance(self, process: Hashable,
                entries: Iterable[Mapping[str, Any]]) -> dict[Key, dict[str, Any]]:
        """Each entry's figures since the previous call; ``process`` names the data plane the
        entries came from (its pid).  An entry without a readable window is left out."""
        if process != self._process:
            self._process, self._last = process, {}
        found, windows = {}, {}
        for entry in entries:
            which = key(entry)
            try:
                now = Window.from_dict(entry["edge_agent"]["window"])
            except (KeyError, TypeError, ValueError) as error:
                logger.debug("telemetry: %s version %s has no window: %r", *which, error)
                continue
            before = self._last.get(which)
            interval = now.since(before) if before is not None and _follows(before, now) \
                else now
            found[which], windows[which] = _figures(interval, now), now
        self._last = windows  # a version no longer served is forgotten
        return found
