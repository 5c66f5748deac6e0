"""``edge-agent run`` (the main job) and ``edge-agent status`` (its state, without a broker)."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sqlite3
import sys
import threading
import time
from pathlib import Path
from typing import Any

from agent.cli.common import (
    DEFAULT_STATE_DIR,
    UsageError,
    add_state_dir,
    open_root,
    positive_float,
    resolve_state_dir,
)
from agent.config import (
    Config,
    ConfigError,
    check_root,
    from_dict,
    load_config,
    profile_problem,
)
from agent.stopping import SIGINT_EXIT, StopSignals
from agent.terminal import TerminalLine, status_line


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``run`` (the main job), ``status`` and ``selftest``."""
    for name, handler, text in (
            ("run", run, "the main job: discover, tune, infer and report over MQTT until "
             "SIGTERM"),
            ("status", status, "what the running agent last wrote to its state directory"),
            ("selftest", selftest, "check discovery, profile, inference and MQTT on this "
             "device; pass/fail/n/a per check")):
        sub = commands.add_parser(name, help=text)
        sub.add_argument("--config", metavar="FILE",
                         help="agent.yaml (default: /etc/edge-agent/agent.yaml if present, "
                         "else built-in defaults)")
        sub.add_argument("--root", metavar="DIR", help="override the config's root")
        add_state_dir(sub, "the agent's state; overrides the config's state_dir")
        if name == "run":
            sub.add_argument("--seconds", type=positive_float, metavar="N",
                             help="stop after N seconds, as on SIGTERM (default: run until "
                             "stopped)")
        else:
            sub.add_argument("--json", action="store_true")
        if name == "selftest":
            sub.add_argument("--seconds", type=positive_float, default=5.0,
                             help="how long the probe may take to connect and infer")
        sub.set_defaults(handler=handler)


logger = logging.getLogger(__name__)


def _config(args: argparse.Namespace) -> Config:
    """The config with the command line's overrides and the state directory by the one rule
    (agent.cli.common), its root checked; any error in it is a UsageError (exit 2) naming
    the file and key, or the flag."""
    if args.root:
        open_root(args.root)
    try:
        config = load_config(args.config)
        overrides: dict[str, Any] = {"root": args.root} if args.root else {}
        given = args.state_dir or (None if config.state_dir == DEFAULT_STATE_DIR
                                   else config.state_dir)
        chosen = resolve_state_dir(given, args.root or config.root)
        if chosen != config.state_dir:
            overrides["state_dir"] = chosen
        if overrides:
            config = from_dict({**config.raw, **overrides}, config.source)
        check_root(config)
    except ConfigError as error:
        raise UsageError(str(error)) from None
    return config


STATUS_EVERY_S = 5.0
LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"


class Runner:
    """The main job's life: start, serve, reload on SIGHUP, stop on SIGTERM/SIGINT.

    systemd hears READY=1 once the service started, STATUS= as it runs, WATCHDOG=1 only while
    it is healthy, RELOADING=1 then READY=1 around a reload and STOPPING=1 on the way out.
    A reload builds the whole service again from the new file; a file that does not load
    leaves the running service as it is and reports a ``config_rejected`` event.
    """

    def __init__(self, args: argparse.Namespace, config: Config, service: Any,
                 notifier: Any, terminal: TerminalLine | None, signals: StopSignals) -> None:
        self.args, self.config, self.service = args, config, service
        self.notifier, self.terminal, self.signals = notifier, terminal, signals
        self.stop = signals.event  # SIGTERM, SIGINT, or a reload that cannot go on
        self.reload = threading.Event()
        self.watchdog: Any = None
        signal.signal(signal.SIGHUP, lambda number, frame: self.reload.set())

    @property
    def exit_status(self) -> int:
        """0 for a run that ended by itself or on SIGTERM, 130 for Ctrl-C (SIGINT)."""
        return SIGINT_EXIT if self.signals.received == signal.SIGINT else 0

    def start_watchdog(self) -> None:
        from agent.service.systemd import Watchdog, watchdog_interval_s

        interval = watchdog_interval_s()
        if interval is not None:
            self.watchdog = Watchdog(self.notifier, lambda: self.service.health_problem(),
                                     interval)
            self.watchdog.start()

    def serve(self, seconds: float | None) -> None:
        deadline = None if seconds is None else time.monotonic() + seconds
        last_status = 0.0
        while not self.stop.is_set():
            if self.reload.is_set():
                self.reload.clear()
                self._reload()
            line = status_line(self.service.tick())
            if time.monotonic() - last_status >= STATUS_EVERY_S:
                self.notifier.notify(STATUS=line[:200])
                last_status = time.monotonic()
            if self.terminal is not None:
                self.terminal.show(line)
            if deadline is not None and time.monotonic() >= deadline:
                break
            self.stop.wait(1.0 if deadline is None else
                           max(0.0, min(1.0, deadline - time.monotonic())))
        if self.terminal is not None:
            self.terminal.close()

    def _reload(self) -> None:
        from agent.service.node import Service, ServiceError

        self.notifier.notify(RELOADING=1, STATUS="reloading the configuration")
        try:
            config = _config(self.args)
        except UsageError as error:
            logger.error("reload: %s; the running configuration stays", error)
            self.service.event("config_rejected", error=str(error))
            self.notifier.notify(READY=1, STATUS=f"configuration rejected: {error}"[:200])
            return
        self.service.stop(rollback=False)  # the new service plans its profile as a switch
        try:
            replacement = Service(config, notifier=self.notifier)
            replacement.start()
        except ServiceError as error:  # the state directory went away: nothing to run
            logger.error("reload: %s", error)
            self.stop.set()
            return
        self.service, self.config = replacement, config
        self.service.event("config_reloaded", source=config.source)
        self.notifier.notify(READY=1, STATUS="running (configuration reloaded)")

    def shut_down(self) -> None:
        self.notifier.notify(STOPPING=1, STATUS="stopping")
        if self.watchdog is not None:
            self.watchdog.stop()
        self.service.stop()


def run(args: argparse.Namespace) -> int:
    from agent.service.node import Service, ServiceError
    from agent.service.systemd import Notifier

    terminal = TerminalLine(sys.stdout) if sys.stdout.isatty() else None
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, handlers=None if terminal
                        is None else [terminal.handler(sys.stderr)])
    notifier = Notifier()
    config = _config(args)
    unknown_profile = profile_problem(config)
    if unknown_profile is not None:  # the fleet must still reach the node to fix it
        logger.error("%s: the agent starts degraded", unknown_profile)
    try:
        service = Service(config, notifier=notifier)
    except ServiceError as error:
        print(f"edge-agent run: {error}", file=sys.stderr)
        return 1
    logger.info("node %s, fleet %s, broker %s:%d, state %s (config: %s)", config.node_id,
                config.fleet, config.mqtt.host, config.mqtt.port, service.state_dir,
                config.source)
    with StopSignals() as signals:
        runner = Runner(args, config, service, notifier, terminal, signals)
        notifier.notify(STATUS="starting: discovery, tuning, model")
        try:
            service.start()
        except ServiceError as error:
            print(f"edge-agent run: {error}", file=sys.stderr)
            return 1
        notifier.notify(READY=1, STATUS="running")
        runner.start_watchdog()
        try:
            runner.serve(args.seconds)
        finally:
            runner.shut_down()
    final = runner.service.final_status
    if final is not None:
        logger.info("stopped: %d records acknowledged by the broker, %d waiting in the "
                    "outbox", final["link"]["acked"], final["outbox"]["depth"])
    return runner.exit_status


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
    for warning in state.get("warnings") or []:
        print(f"warning: {warning}")
    return 0 if running else 1


def selftest(args: argparse.Namespace) -> int:
    """``edge-agent selftest``: pass, fail, warn or n/a per check; exit 1 when one fails.

    SIGINT or SIGTERM stops the probe agent cleanly; with no verdict, the exit status is
    128 + the signal (130, 143), never the 0 of a pass."""
    from agent.selftest import run_selftest

    logging.basicConfig(level=logging.WARNING, format=LOG_FORMAT)
    config = _config(args)
    with StopSignals() as stop:
        report = run_selftest(config, seconds=args.seconds, stop=stop.event)
    if report is None:
        print(f"edge-agent selftest: stopped by {stop.name}; the probe agent was stopped, "
              "no verdict", file=sys.stderr)
        return 128 + int(stop.received or signal.SIGINT)
    failed = any(check["status"] == "fail" for check in report["checks"])
    if args.json:
        print(json.dumps({**report, "ok": not failed}, indent=2))
    else:
        for check in report["checks"]:
            print(f"{check['status']:<5} {check['name']:<10} {check['detail']}")
        warned = sum(check["status"] == "warn" for check in report["checks"])
        print("selftest " + ("FAILED" if failed else "passed")
              + (f" with {warned} warning(s)" if warned else ""))
    return 1 if failed else 0
