"""How close a built model's answers are to the original's on the held-out inputs: top-1
agreement of the first output and cosine similarity of every float output."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

Outputs = Sequence[np.ndarray]  # one inference's outputs, in the model's output order


@dataclass(frozen=True)
class Agreement:
    top1: float | None  # None: the first output is not a class score (nothing to compare)
    cosine_mean: float
    cosine_min: float
    inputs: int

    def to_dict(self) -> dict[str, object]:
        return {"top1": None if self.top1 is None else round(self.top1, 4),
                "cosine_mean": round(self.cosine_mean, 6),
                "cosine_min": round(self.cosine_min, 6), "inputs": self.inputs}


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    norms = float(np.linalg.norm(a) * np.linalg.norm(b))
    if norms == 0.0:  # two zero outputs agree; one zero output does not
        return 1.0 if not a.any() and not b.any() else 0.0
    return float(np.dot(a, b) / norms)


def _classes(output: np.ndarray) -> np.ndarray | None:
    """Per batch row, the index of the highest score; None when the output is not scores
    over two or more classes."""
    if output.ndim < 2 or output.shape[-1] < 2 or not np.issubdtype(output.dtype, np.floating):
        return None
    return np.asarray(output.reshape(-1, output.shape[-1]).argmax(axis=-1))


def agreement(original: Sequence[Outputs], built: Sequence[Outputs]) -> Agreement:
    """Compare per held-out input; a shape change or a non-finite output counts as full
    disagreement for that input (a build that breaks an output must not pass on the rest)."""
    same = total = 0
    cosines: list[float] = []
    top1_known = True
    for want, have in zip(original, built, strict=True):
        scores = []
        for a, b in zip(want, have, strict=True):
            broken = a.shape != b.shape or (b.dtype.kind == "f" and not np.isfinite(b).all())
            if broken:
                scores.append(0.0)
            elif a.dtype.kind == "f":
                scores.append(_cosine(a, b))
            elif not np.array_equal(a, b):  # integer outputs (labels, indices) must match
                scores.append(0.0)
        cosines.append(min(scores, default=1.0))
        classes_a = _classes(want[0])
        classes_b = _classes(have[0]) if want[0].shape == have[0].shape else None
        if classes_a is None:
            top1_known = False
            continue
        total += classes_a.size
        if classes_b is not None:
            same += int((classes_a == classes_b).sum())
    return Agreement(top1=same / total if top1_known and total else None,
                     cosine_mean=float(np.mean(cosines)) if cosines else 0.0,
                     cosine_min=min(cosines, default=0.0), inputs=len(cosines))
