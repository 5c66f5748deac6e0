"""Dynamic batching's arithmetic: which queued requests may share a run, where to cut a
batch, and how their tensors are joined along the batch dimension and split back.

Kept apart from the queue so the rules are plain functions of sizes and shapes.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate, pairwise

import numpy as np

from agent.serving.core import Tensor
from agent.serving.errors import ServeError

Signature = tuple[tuple[str, str, tuple[int, ...]], ...]


def signature(inputs: Sequence[Tensor]) -> Signature:
    """What must agree for requests to be joined: every input's name, type and non-batch
    dimensions."""
    return tuple(sorted((t.name, t.array.dtype.str, tuple(t.array.shape[1:])) for t in inputs))


def cut(rows: Sequence[int], preferred: Sequence[int], can_grow: bool, waited: bool) -> int:
    """How many of the candidate requests (their batch rows, in queue order) to run now; 0:
    wait for more.  Triton's rule: the largest preferred size the prefix reaches; without
    one, everything there once the batch cannot grow or the queue delay has passed."""
    sums = list(accumulate(rows))
    best = max((n for n, total in enumerate(sums, 1) if total in preferred), default=0)
    if best and sums[best - 1] == max(preferred):
        return best  # nothing larger is preferred: waiting cannot improve it
    if can_grow and not waited:
        return 0
    return best or len(rows)


def combine(inputs: Sequence[Sequence[Tensor]]) -> dict[str, np.ndarray]:
    """The feeds of one run: each input's requests stacked along dimension 0 (a lone
    request's arrays as they are)."""
    if len(inputs) == 1:
        return {t.name: t.array for t in inputs[0]}
    names = [t.name for t in inputs[0]]
    by_name = [{t.name: t.array for t in request} for request in inputs]
    return {name: np.concatenate([feeds[name] for feeds in by_name]) for name in names}


def split(names: Sequence[str], arrays: Sequence[np.ndarray], rows: Sequence[int]
          ) -> list[dict[str, np.ndarray]]:
    """Each request's share of a run's outputs, by its batch rows; INTERNAL when an output
    does not carry the batch dimension (a model that does not batch as it claims)."""
    total = sum(rows)
    if len(rows) == 1:
        return [dict(zip(names, arrays, strict=True))]
    for name, array in zip(names, arrays, strict=True):
        if array.ndim == 0 or array.shape[0] != total:
            raise ServeError("INTERNAL", f"output {name} has shape {list(array.shape)} for a "
                             f"batch of {total}: it cannot be split per request")
    edges = [0, *accumulate(rows)]
    return [{name: array[start:end] for name, array in zip(names, arrays, strict=True)}
            for start, end in pairwise(edges)]
