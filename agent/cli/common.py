"""What every command shares: the usage error (exit 2), ``--root`` and argparse types."""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agent.kernel.fsroot import Root


class UsageError(Exception):
    """A one-line error for the person at the terminal; exit status 2."""


def open_root(directory: str) -> Root:
    """The filesystem layer for ``--root``; a missing directory is a usage error."""
    from agent.kernel.fsroot import Root
    from agent.validation import missing_directory

    problem = missing_directory(directory)
    if problem is not None:
        raise UsageError(f"--root {problem}")
    return Root(directory)


def _finite(text: str, above_zero: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and (value > 0 if above_zero else value >= 0)):
        raise argparse.ArgumentTypeError(
            f"{text}: expected a number {'above 0' if above_zero else '0 or above'}")
    return value


def positive_float(text: str) -> float:
    """An argparse type for durations and rates: a finite number above 0 (argparse names
    the flag: ``argument --seconds: -5: expected a number above 0``, exit 2)."""
    return _finite(text, above_zero=True)


def non_negative_float(text: str) -> float:
    """An argparse type for a wait that may be none at all (``--settle 0``)."""
    return _finite(text, above_zero=False)
