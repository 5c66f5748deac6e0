"""The running agent's reports: ``birth/1`` (retained on every connect) and ``status/1``
(``status.json``, which ``edge-agent status`` reads without a broker)."""

from __future__ import annotations

import json
import os
import platform
import sqlite3
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent import __version__
from agent.discovery.runtimes import ORT_DISTRIBUTIONS
from agent.telemetry.records import encode, stamp

if TYPE_CHECKING:  # `edge-agent status` reads the file without loading the agent's parts
    from agent.config import Config
    from agent.discovery.model import Topology
    from agent.service.inference import Inference
    from agent.service.tuning import Tuning


class NoStatus(Exception):
    """No agent has written a status into this state directory."""


def birth(config: Config, topology: Topology, tuning: Tuning, inference: Inference,
          session: int, broker: str | None = None) -> dict[str, Any]:
    """``broker``: the member of the broker list it is published on."""
    board = topology.board
    return stamp(
        "birth/1", session=session, node_id=config.node_id, fleet=config.fleet, broker=broker,
        groups=list(config.groups),
        versions={"agent": __version__, "python": platform.python_version(),
                  **_library_versions()},
        board={"family": board.family, "model": board.model, "soc": board.soc},
        profile={"name": tuning.profile, "applied": tuning.applied},
        model=None if not inference.supervisor.ready else {
            "name": inference.default, "path": inference.model_path,
            "providers": inference.providers},
        models=inference.served_models(),
        serve={"http": config.serve.http, "grpc": config.serve.grpc,
               **inference.supervisor.addresses} if inference.enabled else None,
        capabilities={"gpus": [g.name for g in topology.gpus],
                      "npus": [n.name for n in topology.npus],
                      "preempt_rt": topology.kernel.preempt_rt,
                      "cgroup_v2": topology.kernel.cgroup_v2,
                      "unused_accelerators": [accelerator.to_dict() for accelerator
                                              in inference.unused],
                      "providers_available": inference.available,
                      "runtimes": {name: found.version if found else None for name, found
                                   in vars(topology.runtimes).items()}},
        commands=list(config.control.allow) if config.control.enabled
        else [],
        telemetry={"interval_s": config.telemetry.interval_s,
                   "metrics": "all" if config.telemetry.metrics is None
                   else list(config.telemetry.metrics)})


def _library_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("paho-mqtt", *ORT_DISTRIBUTIONS):
        try:
            installed = version(name)
        except PackageNotFoundError:
            continue
        if name not in ORT_DISTRIBUTIONS:
            found[name] = installed
        elif "onnxruntime" not in found:  # which build: CPU, -gpu (Jetson, CUDA), -openvino
            found["onnxruntime"], found["onnxruntime_distribution"] = installed, name
    return found


def status(node_id: str, started: float, link: dict[str, Any], outbox: dict[str, Any],
           problems: list[str], warnings: list[str], last_sample: dict[str, Any] | None,
           stopped: bool = False, jobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """What ``edge-agent status`` reads back from ``status.json``; ``started`` is the
    agent's start on the monotonic clock; ``jobs``: the long commands running, by slot."""
    return {"schema": "status/1", "pid": os.getpid(), "stopped": stopped,
            "updated_ms": int(time.time() * 1000),
            "node_id": node_id, "uptime_s": round(time.monotonic() - started, 1),
            "link": link, "outbox": outbox, "problems": problems, "warnings": warnings,
            "last_sample": last_sample, "jobs": jobs or {}}


def write_status(state_dir: Path, status: dict[str, Any]) -> None:
    """Atomically, so ``edge-agent status`` never reads half a file."""
    target = state_dir / "status.json"
    temporary = target.with_suffix(".tmp")
    temporary.write_bytes(encode(status))
    os.replace(temporary, target)


def read_status(state_dir: Path) -> dict[str, Any]:
    """status.json as the agent last wrote it; the outbox depth is read from disk when no
    agent holds the outbox (a running one writes its depth every second)."""
    try:
        status: dict[str, Any] = json.loads((state_dir / "status.json").read_text())
    except FileNotFoundError:
        raise NoStatus(f"{state_dir}/status.json: no status; has edge-agent run been "
                       "started with this state directory?") from None
    status["age_s"] = round(time.time() - status["updated_ms"] / 1000, 1)
    outbox = state_dir / "outbox.sqlite"
    if outbox.exists():
        try:
            with sqlite3.connect(f"file:{outbox}?mode=ro", uri=True, timeout=0) as db:
                status["outbox"]["depth"] = db.execute(
                    "SELECT COUNT(*) FROM outbox").fetchone()[0]
        except sqlite3.OperationalError:  # locked: the agent is running
            pass
    return status
