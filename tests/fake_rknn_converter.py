"""Stands in for the converter venv's python: ``fake_rknn_converter.py -I WORKER``.

It runs the real worker (agent/modelbuild/rknn_worker.py) with the fake toolkit in
tests/fake_rknn_toolkit, so the agent side is tested against the worker's real protocol.
``FAKE_RKNN_MODE`` garbage or silent replaces the worker: a non-JSON line, or a progress line
and no result.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

if sys.argv[1:2] != ["-I"] or len(sys.argv) != 3:
    sys.exit(f"fake converter: unexpected argv {sys.argv[1:]}")
mode = os.environ.get("FAKE_RKNN_MODE", "")
if mode == "garbage":
    print("this is not json")
    sys.exit(0)
if mode == "silent":
    print(json.dumps({"progress": "starting"}))
    sys.exit(0)
sys.path.insert(0, str(Path(__file__).parent / "fake_rknn_toolkit"))
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
