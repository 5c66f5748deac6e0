"""Placeholder for the integrator's request module: only the names the rknn converter uses.

Replaced at merge by the full module (Gate, Preprocess, BuildRequest); keep these names.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

Feed = dict[str, "np.ndarray"]  # input name -> array with the batch dimension
Progress = Callable[[str], None]  # one short step name or sentence


class BuildError(Exception):
    """Anything a user caused; the message names the file or flag and the allowed values."""
