"""The live status line of ``edge-agent run``: it fits the terminal and log lines never land
on it."""

from __future__ import annotations

import fcntl
import io
import logging
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

from agent_process import write_config
from mqtt_helpers import free_port

from agent.terminal import TerminalLine, fit, status_line

CLEAR = "\r\033[K"


def _status(state: str = "connected", error: str | None = None) -> dict[str, object]:
    return {"link": {"state": state, "session": 1234, "acked": 123456, "last_error": error},
            "outbox": {"depth": 65432},
            "last_sample": {"metrics": {
                "inference": {"throughput_per_s": 2699.4,
                              "latency_ms": {"p99": 12.123}},
                "thermal": [{"type": "cpu-thermal", "temp_c": 47.25}]}}}


def test_a_connected_line_with_large_counters_fits_80_columns() -> None:
    line = status_line(_status())
    assert len(line) < 80, line
    assert line.startswith("connected s1234 | sent 123456 | outbox 65432 | 2699/s p99 12.1 ms")


def test_a_long_buffering_reason_is_cut_to_the_width() -> None:
    line = status_line(_status("connecting", "cannot reach the broker localhost:1883: "
                                             "[Errno 111] Connection refused"))
    assert "buffering: cannot reach" in line and len(line) > 80
    cut = fit(line, 80)
    assert len(cut) == 79 and cut.endswith("…") and line.startswith(cut[:-1])
    assert fit("short", 80) == "short"


def test_a_log_record_clears_the_line_and_redraws_it_after() -> None:
    screen = io.StringIO()
    line = TerminalLine(screen)
    logger = logging.getLogger("test.terminal")
    logger.propagate = False
    handler = line.handler(screen)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger.addHandler(handler)
    try:
        line.show("connected s1 | sent 3 | outbox 0")
        logger.warning("broker gone")
        line.close()
    finally:
        logger.removeHandler(handler)
    assert screen.getvalue() == (CLEAR + "connected s1 | sent 3 | outbox 0" + CLEAR
                                 + "WARNING broker gone\n" + "connected s1 | sent 3 | outbox 0"
                                 + "\n")


def test_run_in_an_80_column_terminal_keeps_lines_apart(tmp_path: Path) -> None:
    """A real ``edge-agent run`` on a pseudo-terminal of 80 columns, with no broker (so the
    line carries the long buffering reason and the link logs warnings)."""
    config = write_config(tmp_path, free_port())
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    agent = subprocess.Popen([sys.executable, "-m", "agent", "run", "--config", str(config),
                              "--seconds", "4"], stdin=follower, stdout=follower,
                             stderr=follower, close_fds=True)
    os.close(follower)
    chunks = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            data = os.read(leader, 65536)
        except OSError:  # EIO: the agent closed its side
            break
        if not data:
            break
        chunks.append(data)
    os.close(leader)
    assert agent.wait(30) == 0
    screen = b"".join(chunks).decode(errors="replace").replace("\r\n", "\n")
    drawn = [part for row in screen.split("\n") for part in row.split(CLEAR) if part]
    status_lines = [part for part in drawn if re.match(r"^(connecting|disconnected) \|", part)]
    assert len(status_lines) >= 2, screen
    assert all(len(part) <= 79 for part in status_lines), status_lines
    logs = [part for part in drawn if re.search(r"(INFO|WARNING) agent\.", part)]
    assert logs, screen
    assert all(re.match(r"^(INFO|WARNING) agent\.", part) for part in logs), logs
