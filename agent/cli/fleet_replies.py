"""What ``fleet send`` shows a person: one row per node, then what each reply carries.

The table's message is cut at a word boundary to keep the table narrow; the whole message
follows under the node, with the result: a node's status (``get-status``) laid out as
``edge-agent status`` lays out its own, any other result as indented ``key: value`` lines.
``--json`` is for programs, never needed to read a reply.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import yaml

from agent.cli.common import render_table
from agent.terminal import status_line, status_notes

if TYPE_CHECKING:
    from agent.control.collect import Outcome

MESSAGE_WIDTH = 80  # the table's message column
TEXT_WIDTH = 100  # a whole message, wrapped under its node


def shorten(text: str, width: int = MESSAGE_WIDTH) -> str:
    """``text`` on one line in at most ``width`` characters, cut after the last whole word
    that fits, with an ellipsis (a first word longer than the width is cut inside)."""
    flat = " ".join(text.split())
    if len(flat) <= width:
        return flat
    space = flat.rfind(" ", 0, width)
    kept = flat[:space] if space > 0 else flat[:width - 1]
    return kept.rstrip(" ,;:") + "…"


def table(outcomes: Iterable[Outcome]) -> str:
    rows: list[tuple[str, ...]] = [("NODE", "STATUS", "CODE", "MS", "MESSAGE")]
    rows += [(o.node, o.status, o.code, "" if o.ms is None else f"{o.ms:.0f}",
              shorten(o.message)) for o in outcomes]
    return render_table(rows)


def _profile_line(tuning: dict[str, Any]) -> str:
    facts = ["applied" if tuning.get("applied") else "not applied"]
    if tuning.get("applied"):
        facts += [f"{tuning.get('planned_changes')} changes", f"drift {tuning.get('drift')}"]
    if tuning.get("error"):
        facts.append(f"error: {tuning['error']}")
    return f"profile: {tuning.get('profile') or 'none'} ({', '.join(facts)})"


def _model_lines(inference: dict[str, Any]) -> list[str]:
    lines = []
    for model in inference.get("models") or []:
        runs_on = sorted({" ".join(str(b.get(k)) for k in ("backend", "device", "precision"))
                          for b in model.get("backends") or []})
        lines.append(f"model: {model['name']} version {model['version']}"
                     + (f" on {', '.join(runs_on)}" if runs_on else ""))
    if not lines:
        lines.append(f"model: {inference.get('model')}: {inference.get('error', 'not served')}")
    plane = inference.get("data_plane") or {}
    if plane:
        lines.append(f"data plane: {plane.get('state')}" + "".join(
            f", {name} {plane[name]}" for name in ("http", "grpc") if plane.get(name)))
    return lines


def status_lines(status: dict[str, Any]) -> list[str]:
    """A node's ``status/1`` (get-status's result): its link, outbox, inference and hottest
    zone on one line, how long it has run, its profile, its models and data plane, then its
    jobs, problems and warnings."""
    metrics = (status.get("last_sample") or {}).get("metrics") or {}
    lines = [status_line(status), f"up {status.get('uptime_s')} s, pid {status.get('pid')}"]
    if metrics.get("tuning"):
        lines.append(_profile_line(metrics["tuning"]))
    if metrics.get("inference"):
        lines += _model_lines(metrics["inference"])
    return lines + status_notes(status)


def result_lines(result: Any) -> list[str]:
    """A command's result to be read: a status as its own layout, anything else as YAML's
    block layout (keys in the node's order)."""
    if isinstance(result, dict) and result.get("schema") == "status/1":
        return status_lines(result)
    if not isinstance(result, dict | list):
        return [str(result)]
    return yaml.safe_dump(result, sort_keys=False, default_flow_style=False,
                          allow_unicode=True, width=TEXT_WIDTH).splitlines()


def details(outcomes: Iterable[Outcome]) -> str:
    """Under each node that has more to say than its row: its whole message where the table
    cut it, then its result; empty when no node has."""
    blocks = []
    for outcome in outcomes:
        lines = []
        if shorten(outcome.message) != outcome.message:
            lines += textwrap.wrap(f"message: {outcome.message}", TEXT_WIDTH,
                                   subsequent_indent="  ", break_long_words=False,
                                   break_on_hyphens=False)  # names and paths stay whole
        if outcome.result is not None:
            lines += result_lines(outcome.result)
        if lines:
            blocks.append("\n".join([f"{outcome.node}:", *("  " + line for line in lines)]))
    return "\n\n".join(blocks)
