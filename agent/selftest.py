"""``selftest``: what a running agent can check about itself, honestly pass, fail, warn or n/a.

``warn`` is for what works but not as well as the board allows (an accelerator left unused);
only ``fail`` fails the selftest."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agent.service.node import Service


def _check(name: str, status: str, detail: str) -> dict[str, str]:
    return {"name": name, "status": status, "detail": detail}


def run_checks(service: Service) -> dict[str, Any]:
    checks = []
    topology = service.topology
    if topology is None:
        checks.append(_check("discovery", "fail", "discovery has not run"))
    else:
        board = topology.board
        checks.append(_check("discovery", "pass", f"{board.family} {board.model or ''} "
                             f"{len(topology.cpu.online)} CPUs online".strip()))
    inference = service.inference
    if inference is None or not service.config.inference.enabled:
        checks.append(_check("inference", "n/a", "inference is disabled in the config"))
    elif inference.loop is None:
        checks.append(_check("inference", "fail", inference.error or "not running"))
    else:
        stats = inference.loop.active.stats.snapshot()
        ok = stats["count"] > 0 and stats["errors"] == 0
        checks.append(_check("inference", "pass" if ok else "fail",
                             f"{inference.loop.active.name} on {', '.join(inference.providers)}"
                             f": {stats['count']} calls, {stats['errors']} errors"))
    if inference is not None:  # works, on the CPU, but the board has better: not a failure
        for accelerator in inference.unused:
            checks.append(_check("accelerator", "warn",
                                 f"{accelerator.device} is not used: {accelerator.reason}"))
    tuning = service.tuning
    if tuning is not None and tuning.error:
        checks.append(_check("profile", "fail", tuning.error))
    elif tuning is not None and tuning.profile:
        checks.append(_check("profile", "pass", f"{tuning.profile} plans cleanly: "
                             f"{tuning.changes} change(s)"))
    if tuning is None or not tuning.applied:
        checks.append(_check("tuning", "n/a", "no profile applied"))
    else:
        tuning.verify()
        checks.append(_check("tuning", "pass" if tuning.drift == 0 else "fail",
                             f"{tuning.profile}: {tuning.drift} setting(s) drifted"))
    link = service.link
    if link is not None:
        connected = link.status.state == "connected"
        detail = (f"connected to {link.status.broker}" if connected else
                  link.status.last_error or f"{link.status.state}: {link.status.broker}")
        checks.append(_check("mqtt", "pass" if connected else "fail", detail))
    return {"checks": checks}


def run_selftest(config: Any, seconds: float = 3.0,
                 stop: threading.Event | None = None) -> dict[str, Any] | None:
    """Start the agent beside any running one (its own state directory and MQTT client id,
    nothing applied), let it work for ``seconds``, check it, stop it.  None when ``stop`` is
    set first: the probe is stopped (its threads joined) and there is no verdict."""
    import dataclasses
    import tempfile
    import time

    from agent.service.node import Service

    with tempfile.TemporaryDirectory(prefix="edge-agent-selftest-") as scratch:
        probe = dataclasses.replace(
            config, node_id=f"{config.node_id}-selftest"[:64], state_dir=scratch,
            tuning=dataclasses.replace(config.tuning, apply=False),
            control=dataclasses.replace(config.control, enabled=False),
            prometheus=dataclasses.replace(config.prometheus, listen=None),
            home_assistant=dataclasses.replace(config.home_assistant, enabled=False))
        stop = stop or threading.Event()
        service = Service(probe)
        try:
            service.start()
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline and not (
                    service.link is not None and service.link.status.state == "connected"
                    and service.inference is not None and service.inference.loop is not None
                    and service.inference.loop.completions > 10):
                if stop.wait(0.1):
                    return None
            return None if stop.is_set() else run_checks(service)
        finally:
            service.stop(flush_s=0, rollback=False)
