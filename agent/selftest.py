"""``selftest``: what a running agent can check about itself, honestly pass, fail or n/a."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agent.service import Service


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
    tuning = service.tuning
    if tuning is None or not tuning.applied:
        checks.append(_check("tuning", "n/a", "no profile applied"))
    else:
        tuning.verify()
        checks.append(_check("tuning", "pass" if tuning.drift == 0 else "fail",
                             f"{tuning.profile}: {tuning.drift} setting(s) drifted"))
    link = service.link
    if link is not None:
        connected = link.status.state == "connected"
        checks.append(_check("mqtt", "pass" if connected else "fail",
                             f"{link.status.state} to {link.status.broker}"))
    return {"checks": checks}
