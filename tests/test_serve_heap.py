"""The serve process's startup heap out of the cyclic collector's reach once its models load
(kernel.process.freeze_long_lived): a full collection then walks only what serving
allocates since, not every imported module (26-46 ms pauses holding the GIL before it, each
a missed 1-s window of bench/qos.py's latency-critical model)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from agent.config import from_dict

# A data plane of its own process (the freeze is process-wide: not the test run's heap),
# started with the demo, and its collector's figures once the first load round is over.
PLANE = r"""
import asyncio, gc, json, sys
from pathlib import Path
from agent.inference.demo_model import DEMO_MODEL_PATH
from agent.serving.server import DataPlane, ServerSettings

async def main() -> None:
    plane = DataPlane(ServerSettings(
        http="127.0.0.1:0", grpc="127.0.0.1:0", repository=Path(sys.argv[1]),
        builtins={"demo": DEMO_MODEL_PATH}, pins={}, token_files=[],
        max_request_bytes=1 << 20, providers=["CPUExecutionProvider"], threads=(1, 1),
        cache_dir=None, freeze_heap=True))
    before = gc.get_freeze_count()
    await plane.start()
    for _ in range(1200):
        if plane.registry.wait_loaded(0) and gc.get_freeze_count():
            break
        await asyncio.sleep(0.05)
    print(json.dumps({"before": before, "frozen": gc.get_freeze_count(),
                      "tracked": len(gc.get_objects()),
                      "serving": [m.name for m in plane.registry.index(ready_only=True)]}))
    await plane.stop()

asyncio.run(main())
"""


def test_once_the_models_load_the_startup_heap_is_frozen(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", PLANE, str(tmp_path)], capture_output=True,
                          text=True, timeout=120, check=True, cwd=Path(__file__).parents[1])
    figures = json.loads(done.stdout.splitlines()[-1])
    assert figures["serving"] == ["demo"]
    assert figures["before"] == 0, "frozen before the models loaded"
    # the imports and the loaded model: tens of thousands of objects a full collection no
    # longer walks, against the few the collector still tracks
    assert figures["frozen"] > 10_000
    assert figures["tracked"] < figures["frozen"] // 100


def test_edge_agent_serve_asks_for_the_freeze(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """``edge-agent serve`` (service.serve) builds its data plane with the freeze on."""
    from agent.service.serve import serve

    built: list[Any] = []
    monkeypatch.setattr("agent.serving.server.serve", lambda settings: built.append(
        settings) or 0)
    config = from_dict({"state_dir": str(tmp_path)}, "agent.yaml")
    assert serve(config, tmp_path) == 0
    assert built and built[0].freeze_heap is True
