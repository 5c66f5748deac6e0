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


def _data_plane_check(inference: Inference) -> dict[str, str]:
    """The data plane answers: ready, and one inference of the default model through its
    HTTP front end."""
    from agent.service.loaddriver import synthetic_feeds
    from agent.serving.errors import ServeError

    if not inference.supervisor.ready:
        return _check("inference", "fail", "; ".join(inference.problems())
                      or "the data plane is not ready")
    try:
        client = inference.supervisor.client()
        outputs = client.infer(inference.default,
                               synthetic_feeds(client.model_metadata(inference.default), {}))
    except ServeError as error:
        return _check("inference", "fail", f"{inference.default}: {error}")
    served = ", ".join(f"{m['name']} {'/'.join(m['versions'])}"
                       for m in inference.served_models())
    return _check("inference", "pass", f"{inference.default} answered {len(outputs)} "
                  f"output(s) on {', '.join(inference.providers)}; serving {served}")


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
    else:
        checks.append(_data_plane_check(inference))
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
