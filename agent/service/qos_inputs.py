"""What the QoS controller reads each window, in its own terms: each model's window figures
and levers from the data plane's statistics, and its objective from its config.yaml.

A model's figures are those of the version that serves requests naming none (its newest);
the levers apply to every version of it alike.  The statistics come from the data plane, a
process of our own, but are still read defensively: an entry that does not parse is left
out of the window, never allowed to end the controller's thread.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from agent.control.qos import DELAY, PREFERRED, THREADS, Figures, Levers, Objective
from agent.control.qos_model import Value
from agent.service.intervals import Intervals
from agent.serving.repository import CONFIG_FILE
from agent.serving.settings import ModelSettingsError, read_settings

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Served:
    """One model in a window: its figures, its levers as served and as configured, and
    config.yaml's preferred sizes (what a preferred step keeps of them)."""

    figures: Figures
    levers: Levers
    configured: Levers
    preferred: tuple[int, ...]
    rebuild_failed: bool = False  # the last rebuild of its threads failed


def levers_of(view: Mapping[str, Any]) -> Levers:
    """The controller's levers from the data plane's (levers.view): the preferred batch is
    the largest preferred size, max_batch_size when none is set (a batch is cut there);
    threads as the sessions serving now were built with, CPUs as their threads run on,
    whether they are lifted (None: not a lever for the model)."""
    sizes = [int(size) for size in view["preferred_batch_size"]]
    batch = int(view["max_batch_size"])
    rate, cpus = view.get("admit_rps"), view.get("cpus")
    return Levers(int(view["max_queue_delay_us"]) if batch else 0,
                  max(sizes) if sizes else batch, None if rate is None else float(rate),
                  int(view.get("threads") or 0),
                  None if cpus is None else tuple(int(cpu) for cpu in cpus),
                  realtime=None if view.get("realtime") is None else bool(view["realtime"]))


def served_levers(ours: Mapping[str, Any]) -> tuple[Levers, Levers]:
    """A version's levers as served and as configured, from its statistics' ``edge_agent``:
    a rebuild under way (threads) marks them ``rebuilding``; without a configured
    thread count (the runtime chose it) threads are no lever: nothing to give them back to."""
    served, configured = levers_of(ours["levers"]), levers_of(ours["configured"])
    rebuild = ours.get("rebuild") or {}
    served = replace(served, rebuilding=rebuild.get("state") == "rebuilding")
    if not configured.threads:
        served = replace(served, threads=0)
    return served, configured


def lever_request(served: Served, lever: str, after: Value) -> dict[str, Any]:
    """The data plane's request for one action: a preferred step keeps config.yaml's sizes
    up to the new largest one (and config.yaml's list once back at its value)."""
    if isinstance(after, tuple):  # the CPUs a model is confined to
        return {lever: list(after)}
    if lever == DELAY:
        return {DELAY: int(after or 0)}
    if lever == PREFERRED:
        largest = int(after or 1)
        if largest >= served.configured.preferred_batch_size:
            return {PREFERRED: list(served.preferred)}
        return {PREFERRED: [s for s in served.preferred if s <= largest] or [largest]}
    if lever == THREADS:
        return {THREADS: int(after or 1)}
    return {lever: after}


class Windows:
    """Each model's figures since the previous ``advance`` of one data-plane process."""

    def __init__(self) -> None:
        self._latency = Intervals()
        self._queue = Intervals()
        self._refused: dict[str, int] = {}
        self._at: float | None = None

    def advance(self, process: Hashable, entries: Iterable[Mapping[str, Any]],
                now_s: float | None = None) -> dict[str, Served]:
        now_s = time.monotonic() if now_s is None else now_s
        elapsed = None if self._at is None else max(now_s - self._at, 1e-3)
        self._at = now_s
        newest: dict[str, Mapping[str, Any]] = {}
        for entry in entries:
            name, version = str(entry.get("name")), str(entry.get("version"))
            if version.isdigit() and (name not in newest or int(version) > int(
                    str(newest[name].get("version")))):
                newest[name] = entry
        chosen = list(newest.values())
        latency = self._latency.advance(process, chosen)
        queue = self._queue.advance(process, [
            {"name": e.get("name"), "version": e.get("version"),
             "edge_agent": {"window": (e.get("edge_agent") or {}).get("queue", {}).get(
                 "window")}} for e in chosen])
        served, refused = {}, {}
        for entry in chosen:
            which = (str(entry["name"]), str(entry["version"]))
            try:
                ours = entry["edge_agent"]
                queued = ours["queue"]
                refused[which[0]] = int(queued["full"] + queued["shed"] + queued["expired"]
                                        + ours["levers"]["not_admitted"])
                count = int(latency[which]["count"])
                served[which[0]] = Served(
                    Figures(p99_ms=float(latency[which]["latency_ms"]["p99"]),
                            queue_ms=float(queue.get(which, {}).get("latency_ms", {})
                                           .get("p99", 0.0)),
                            rate_rps=round(count / elapsed, 3) if elapsed else 0.0,
                            rejections=max(0, refused[which[0]]
                                           - self._refused.get(which[0], refused[which[0]])),
                            count=count if elapsed else 0),
                    *served_levers(ours),
                    tuple(int(s) for s in ours["configured"]["preferred_batch_size"]),
                    (ours.get("rebuild") or {}).get("state") == "failed")
            except (KeyError, TypeError, ValueError) as error:
                logger.debug("qos: model %s version %s has no usable figures: %r", *which,
                             error)
        self._refused = refused
        return served


class Objectives:
    """Each model's config.yaml ``qos``, read again only when the file changed."""

    def __init__(self, repository: Path) -> None:
        self.repository = repository
        self._read: dict[str, tuple[tuple[int, ...], Objective | None]] = {}

    def __call__(self, models: Iterable[str]) -> dict[str, Objective]:
        found = {}
        for model in models:
            objective = self._objective(model)
            if objective is not None:
                found[model] = objective
        return found

    def _objective(self, model: str) -> Objective | None:
        path = self.repository / model / CONFIG_FILE
        try:
            info = os.stat(path)
        except OSError:
            return None  # a built-in, or a model without a config.yaml: no objective
        signature = (info.st_ino, info.st_mtime_ns, info.st_size)
        known = self._read.get(model)
        if known is not None and known[0] == signature:
            return known[1]
        try:
            qos = read_settings(path).qos
        except ModelSettingsError as error:  # the data plane refuses it too, and says so
            logger.warning("qos: %s", error)
            qos = None
        objective = None if qos is None else Objective(qos.service_class, qos.p99_ms,
                                                       qos.min_rps)
        self._read[model] = (signature, objective)
        return objective
