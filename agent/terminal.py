"""The one status line ``edge-agent run`` keeps up to date in a terminal, and log lines that
do not get printed onto it.

The line is cut to the terminal's width (a wrapped line cannot be redrawn with ``\\r``), and
a log record first clears the line, then is printed, then the line is drawn again below it.
"""

from __future__ import annotations

import logging
import shutil
import threading
from typing import Any, TextIO

from agent.kernel.parsers import format_cpulist
from agent.telemetry.records import hottest_c

_CLEAR = "\r\033[K"


def status_line(status: dict[str, Any]) -> str:
    """One compact line for a person watching ``edge-agent run``: link and session, records
    acknowledged, outbox depth, inference rate and p99, hottest zone, why it buffers."""
    link, outbox = status["link"], status["outbox"]
    metrics = (status.get("last_sample") or {}).get("metrics") or {}
    state = link["state"]
    parts = [f"{state} s{link['session']}" if state == "connected" else state,
             f"sent {link['acked']}", f"outbox {outbox['depth']}"]
    inference = metrics.get("inference") or {}
    if "latency_ms" in inference:
        parts.append(f"{inference['throughput_per_s']:.0f}/s "
                     f"p99 {inference['latency_ms']['p99']:.1f} ms")
    hottest = hottest_c(metrics)
    if hottest is not None:
        parts.append(f"{hottest:.0f} °C")
    if state != "connected" and link.get("last_error"):
        parts.append(f"buffering: {link['last_error']}")
    return " | ".join(parts)


def status_notes(status: dict[str, Any]) -> list[str]:
    """The lines under the status line, one per running job, problem and warning: what
    ``edge-agent status`` prints and ``fleet send NODE get-status`` shows per node."""
    lines = [f"job: {job['command']} {job['id']} ({slot}), {job['running_s']} s"
             + (f": {job['step']}" if job["step"] else "")
             for slot, job in sorted((status.get("jobs") or {}).items())]
    lines += [f"problem: {problem}" for problem in status.get("problems") or []]
    lines += [f"warning: {warning}" for warning in status.get("warnings") or []]
    qos = ((status.get("last_sample") or {}).get("metrics") or {}).get("qos") or {}
    last = qos.get("last_action")
    if isinstance(last, dict):
        lines.append(qos_line(last, int(qos.get("actions") or 0)))
    return lines


def qos_line(action: dict[str, Any], count: int) -> str:
    """The QoS controller's last move, as ``edge-agent status`` prints it."""
    done = ("applied" if action.get("applied") else "advised" if action.get("mode") ==
            "advise" else f"not applied: {action.get('error', '')}")
    lever = action.get("lever")
    return (f"qos: {action.get('model')} {lever} {_value(lever, action.get('before'))} -> "
            f"{_value(lever, action.get('after'))} ({done}; {action.get('why')}; {count} "
            f"move{'' if count == 1 else 's'} so far)")


def _value(lever: Any, value: Any) -> str:
    """A lever's value as an operator reads it: none (no cap, no placement), CPUs as a
    cpulist (1-3), batch sizes as a list (4, 8), a switch (realtime) as on or off."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list | tuple):
        if lever == "cpus":
            return format_cpulist([int(cpu) for cpu in value])
        return ", ".join(map(str, value))
    return str(value)


def fit(line: str, columns: int) -> str:
    """``line`` cut to fit ``columns`` (one column is kept free: a line that fills the last
    column makes some terminals wrap), with an ellipsis where it was cut."""
    width = max(columns - 1, 1)
    return line if len(line) <= width else line[:max(width - 1, 0)] + "…"


class TerminalLine:
    """The live line on a terminal; ``handler()`` is the logging handler that keeps log
    records off it."""

    def __init__(self, terminal: TextIO) -> None:
        self.terminal = terminal
        self.lock = threading.Lock()
        self.shown = ""

    def show(self, line: str) -> None:
        with self.lock:
            self.shown = fit(line, shutil.get_terminal_size().columns)
            self.terminal.write(_CLEAR + self.shown)
            self.terminal.flush()

    def close(self) -> None:
        """Leave the last line on screen and end it."""
        with self.lock:
            if self.shown:
                self.terminal.write("\n")
                self.terminal.flush()
            self.shown = ""

    def handler(self, stream: TextIO) -> logging.Handler:
        return _AroundLine(self, stream)


class _AroundLine(logging.StreamHandler):  # type: ignore[type-arg]
    """A stream handler that clears the live line before a record and redraws it after."""

    def __init__(self, line: TerminalLine, stream: TextIO) -> None:
        super().__init__(stream)
        self.line = line

    def emit(self, record: logging.LogRecord) -> None:
        with self.line.lock:
            if self.line.shown:
                self.line.terminal.write(_CLEAR)
                self.line.terminal.flush()
            super().emit(record)
            if self.line.shown:
                self.line.terminal.write(self.line.shown)
                self.line.terminal.flush()
