"""The settings ``model tune`` searches: the model's version (the backend/precision variants
``model build`` made, with ``--variants``) x instance count x threads per instance x
max_batch_size x max_queue_delay_us (x the rungs of the device's latency knobs, when a
ladder is given: agent.modeltune.knobs), as a grid of candidates and the config.yaml keys of
one.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agent.serving.settings import THREADS_PER_CPU

# Searched in this order by coordinate descent under an open loop (a closed loop's order,
# with the batch first and no delay, is search.CLOSED): the variant first (a quantized build
# changes every other optimum), threads next (the largest effect on one request's latency),
# then instances, then the batching pair, and the latency knobs last (each move is a
# journaled change of the device).  A version of 0 is the one the model serves (no variant
# searched), as a max_batch_size of 0 is a fixed batch; knobs rung 0 is the profile's own.
DIMENSIONS = ("version", "threads", "count", "max_batch_size", "max_queue_delay_us", "knobs")
UNSEARCHED = {"version": (0,), "knobs": (0,)}  # the value of a dimension a space leaves out
# --space's names for the dimensions
SPACE_KEYS = {"threads": "threads", "count": "count", "batch": "max_batch_size",
              "delay_us": "max_queue_delay_us"}
LIMITS = {"threads": (1, 1024), "count": (1, 64), "max_batch_size": (1, 1 << 16),
          "max_queue_delay_us": (0, 10_000_000)}
MAX_VALUES = 16  # per dimension: a grid is their product, and each point costs seconds
DELAYS_US = (0, 500, 2000)
BATCHES = (1, 4, 8)


class SpaceError(ValueError):
    """A --space the search cannot use (the CLI's one-line usage error)."""


@dataclass(frozen=True, order=True)
class Candidate:
    """One point of the grid; max_batch_size 0 for a model whose batch is fixed."""

    threads: int
    count: int
    max_batch_size: int
    max_queue_delay_us: int
    version: int = 0  # a variant's version, pinned; 0: the version the model serves
    knobs: int = 0  # the latency knobs' rung (device-wide, no config.yaml key)

    def settings(self, device: str | None = None, precision: str | None = None
                 ) -> dict[str, Any]:
        """The config.yaml keys this candidate sets (``device``: the instances' own, kept;
        ``precision``: the one its variant is served with, None: the config's own)."""
        instance: dict[str, Any] = {"count": self.count, "threads": self.threads}
        if device is not None:
            instance["device"] = device
        keys: dict[str, Any] = {"max_batch_size": self.max_batch_size, "instances": [instance]}
        if self.max_batch_size > 0:
            keys["dynamic_batching"] = {"max_queue_delay_us": self.max_queue_delay_us}
        if self.version:
            keys["version_policy"] = {"specific": [self.version]}
        if precision is not None:
            keys["precision"] = precision
        return keys

    def label(self) -> str:
        version = f"version {self.version}, " if self.version else ""
        knobs = f", knobs rung {self.knobs}" if self.knobs else ""
        return (f"{version}{self.count} x {self.threads} threads, batch "
                f"{self.max_batch_size}, delay {self.max_queue_delay_us} us{knobs}")


Space = Mapping[str, Sequence[int]]


def default_space(cpus: int, batching: bool) -> dict[str, tuple[int, ...]]:
    """Powers of two up to the inference CPUs for threads, one to two instances (four from
    eight CPUs), and batching only where the model's first dimension is dynamic."""
    threads = tuple(sorted({min(cpus, 1 << i) for i in range(cpus.bit_length() + 1)}))
    counts = (1, 2, 4) if cpus >= 8 else (1, 2)
    return {"threads": threads, "count": counts,
            "max_batch_size": BATCHES if batching else (0,),
            "max_queue_delay_us": DELAYS_US if batching else (0,)}


def parse_space(items: Sequence[str], base: Mapping[str, tuple[int, ...]],
                batching: bool) -> dict[str, tuple[int, ...]]:
    """``base`` with the dimensions --space names replaced (``batch=1,4``, ``delay_us=0``)."""
    space = dict(base)
    allowed = ", ".join(SPACE_KEYS)
    for item in items:
        key, _, listed = item.partition("=")
        dimension = SPACE_KEYS.get(key.strip())
        if dimension is None:
            raise SpaceError(f"--space {item!r}: expected KEY=N,N,... with KEY one of {allowed}")
        low, high = LIMITS[dimension]
        try:
            values = tuple(sorted({int(v) for v in listed.split(",")}))
        except ValueError:
            values = ()
        if not values or len(values) > MAX_VALUES or not all(low <= v <= high for v in values):
            raise SpaceError(f"--space {item!r}: expected 1 to {MAX_VALUES} integers "
                             f"{low}..{high}, comma-separated")
        if dimension in ("max_batch_size", "max_queue_delay_us") and not batching and (
                values != (0,)):
            raise SpaceError(f"--space {item!r}: the model's first dimension is fixed, so it "
                             "does not batch (only 0)")
        space[dimension] = values
    return space


def valid(candidate: Candidate, cpus: int) -> bool:
    """Within settings.check_threads' rule; a queue delay only where a batch can form."""
    if candidate.count * candidate.threads > THREADS_PER_CPU * cpus:
        return False
    return candidate.max_batch_size > 1 or candidate.max_queue_delay_us == 0


def values(space: Space, dimension: str) -> Sequence[int]:
    """The values ``space`` gives ``dimension`` (UNSEARCHED's for one it leaves out)."""
    return space[dimension] if dimension in space else UNSEARCHED[dimension]


def grid(space: Space, cpus: int) -> list[Candidate]:
    """Every valid point of ``space``; one delay of 0 stands for a batch of 1."""
    points = (dict(zip(DIMENSIONS, p, strict=True))
              for p in itertools.product(*(values(space, d) for d in DIMENSIONS)))
    found = {Candidate(**{**p, "max_queue_delay_us": p["max_queue_delay_us"]
                          if p["max_batch_size"] > 1 else 0}) for p in points}
    return sorted(c for c in found if valid(c, cpus))


def with_candidate(config: Mapping[str, Any], candidate: Candidate,
                   device: str | None, precision: str | None = None) -> dict[str, Any]:
    """``config`` (a config.yaml's mapping) with the candidate's keys set and every other
    key kept: dynamic_batching's queue and priorities stay, preferred sizes above the new
    max_batch_size go (settings refuses them), and a fixed batch drops dynamic_batching.
    A variant's version replaces the version policy (the data plane serves that one only),
    and its ``precision`` (None: the config's own) the precision."""
    updated = {k: v for k, v in config.items() if k not in ("instances", "dynamic_batching")}
    keys = candidate.settings(device, precision)
    for key in ("max_batch_size", "instances", "version_policy", "precision"):
        if key in keys:
            updated[key] = keys[key]
    if "dynamic_batching" in keys:
        batching = dict(config.get("dynamic_batching") or {})
        batching.update(keys["dynamic_batching"])
        preferred = [n for n in batching.pop("preferred_batch_size", [])
                     if n <= candidate.max_batch_size]
        if preferred:
            batching["preferred_batch_size"] = preferred
        updated["dynamic_batching"] = batching
    return updated
