"""The data plane's "still building engines" file, which the supervisor watches
(agent/service/building.py): light, so the control plane need not import the server."""

from __future__ import annotations

import json
import os
from pathlib import Path

BUILDING_FILE = "building.json"  # beside the ready file


def write_building(path: Path, seconds: float) -> None:
    """A compiling build is still going (``seconds`` so far), written atomically."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps({"pid": os.getpid(), "seconds": round(seconds, 1)}))
    partial.replace(path)
