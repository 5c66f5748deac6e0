"""``edge-agent run`` (the main job) and ``edge-agent status`` (its state, without a broker)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sqlite3
import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO

from agent.cli import UsageError
from agent.config import Config, ConfigError, from_dict, load_config

logger = logging.getLogger(__name__)
USER_STATE_DIR = Path.home() / ".local" / "state" / "edge-agent"


def _config(args: argparse.Namespace) -> Config:
    config = load_config(args.config)
    overrides: dict[str, Any] = {}
    if args.root:
        overrides["root"] = args.root
    if args.state_dir:
        overrides["state_dir"] = args.state_dir
    elif not _writable(config.state_dir) and config.state_dir == "/var/lib/edge-agent":
        overrides["state_dir"] = str(USER_STATE_DIR)  # not root: a per-user default
    return from_dict({**config.raw, **overrides}, config.source) if overrides else config


def _writable(path: str) -> bool:
    directory = Path(path)
    while not directory.exists():
        directory = directory.parent
    return os.access(directory, os.W_OK)


def status_line(status: dict[str, Any]) -> str:
    """One compact line for a person watching ``edge-agent run`` in a terminal."""
    link, outbox = status["link"], status["outbox"]
    metrics = (status.get("last_sample") or {}).get("metrics") or {}
    parts = [f"link {link['state']}" + (f" (session {link['session']})"
                                       if link["state"] == "connected" else ""),
             f"sent {link['acked']}", f"outbox {outbox['depth']}"]
    inference = metrics.get("inference") or {}
    if "latency_ms" in inference:
        parts.append(f"inference {inference['throughput_per_s']:.0f}/s "
                     f"p99 {inference['latency_ms']['p99']:.2f} ms")
    temperatures = [z["temp_c"] for z in metrics.get("thermal") or []
                    if z.get("temp_c") is not None]
    if temperatures:
        parts.append(f"hottest {max(temperatures):.1f} °C")
    if link["state"] != "connected" and link.get("last_error"):
        parts.append(f"buffering: {link['last_error']}")
    return " | ".join(parts)


def _serve(service: Any, seconds: float | None, terminal: TextIO | None) -> None:
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda number, frame: stop.set())
    deadline = None if seconds is None else time.monotonic() + seconds
    while not stop.is_set():
        service.tick()
        if terminal is not None:
            terminal.write("\r\033[K" + status_line(service.status())[:200])
            terminal.flush()
        if deadline is not None and time.monotonic() >= deadline:
            break
        stop.wait(1.0 if deadline is None else max(0.0, min(1.0, deadline
                                                             - time.monotonic())))
    if terminal is not None:
        terminal.write("\n")


def run(args: argparse.Namespace) -> int:
    from agent.service import Service, ServiceError

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        config = _config(args)
        service = Service(config)
    except ConfigError as error:
        raise UsageError(str(error)) from None
    except ServiceError as error:
        print(f"edge-agent run: {error}", file=sys.stderr)
        return 1
    terminal = sys.stdout if sys.stdout.isatty() else None
    logger.info("node %s, fleet %s, broker %s:%d, state %s (config: %s)", config.node_id,
                config.fleet, config.mqtt.host, config.mqtt.port, service.state_dir,
                config.source)
    try:
        service.start()
    except ServiceError as error:
        print(f"edge-agent run: {error}", file=sys.stderr)
        return 1
    try:
        _serve(service, args.seconds, terminal)
    finally:
        service.stop()
    final = service.final_status
    if final is not None:
        logger.info("stopped: %d records acknowledged by the broker, %d waiting in the "
                    "outbox", final["link"]["acked"], final["outbox"]["depth"])
    return 0


def read_status(state_dir: Path) -> dict[str, Any]:
    """status.json as the agent last wrote it; the outbox depth is read from disk when no
    agent holds the outbox (a running one writes its depth every second)."""
    try:
        status: dict[str, Any] = json.loads((state_dir / "status.json").read_text())
    except FileNotFoundError:
        raise UsageError(f"{state_dir}/status.json: no status; has edge-agent run been "
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


def status(args: argparse.Namespace) -> int:
    config = _config(args)
    state = read_status(Path(config.state_dir))
    running = not state["stopped"] and state["age_s"] <= 5 + 3 * config.telemetry.interval_s
    if args.json:
        print(json.dumps({**state, "running": running}, indent=2))
        return 0 if running else 1
    print(("running" if running else "stopped" if state["stopped"] else
           f"not running (no update for {state['age_s']} s)")
          + f", node {state['node_id']}, pid {state['pid']}")
    print(status_line(state))
    for problem in state.get("problems") or []:
        print(f"problem: {problem}")
    return 0 if running else 1
