"""``selftest``: what a running agent can check about itself, honestly pass, fail, warn or n/a.

``warn`` is for what works but not as well as the board allows (an accelerator left unused);
only ``fail`` fails the selftest."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agent.discovery.model import Topology
    from agent.link.settings import LinkStatus
    from agent.service.inference import Inference
    from agent.service.tuning import Tuning


@dataclass(frozen=True)
class Subject:
    """The parts of one agent the checks look at (None: not built, or not configured)."""

    topology: Topology | None
    inference: Inference | None
    inference_enabled: bool
    tuning: Tuning | None
    link: LinkStatus | None


def _check(name: str, status: str, detail: str) -> dict[str, str]:
    return {"name": name, "status": status, "detail": detail}


def run_checks(subject: Subject) -> dict[str, Any]:
    checks = []
    topology = subject.topology
    if topology is None:
        checks.append(_check("discovery", "fail", "discovery has not run"))
    else:
        board = topology.board
        checks.append(_check("discovery", "pass", f"{board.family} {board.model or ''} "
                             f"{len(topology.cpu.online)} CPUs online".strip()))
    inference = subject.inference
    if inference is None or not subject.inference_enabled:
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
    tuning = subject.tuning
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
    link = subject.link
    if link is not None:
        connected = link.state == "connected"
        detail = (f"connected to {link.broker}" if connected else
                  link.last_error or f"{link.state}: {link.broker}")
        checks.append(_check("mqtt", "pass" if connected else "fail", detail))
    return {"checks": checks}
