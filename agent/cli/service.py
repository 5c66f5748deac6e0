"""``edge-agent run`` (the main job) and ``edge-agent status`` (its state, without a broker)."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.cli.common import (
    DEFAULT_STATE_DIR,
    UsageError,
    add_config_file,
    add_state_dir,
    open_root,
    positive_float,
    resolve_state_dir,
)
from agent.stopping import StopSignals
from agent.terminal import TerminalLine, status_line, status_notes

if TYPE_CHECKING:
    from agent.config import Config


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``run`` (the main job), ``status`` and ``selftest``."""
    for name, handler, text in (
            ("run", run, "the main job: discover, tune, infer and report over MQTT until "
             "SIGTERM"),
            ("status", status, "what the running agent last wrote to its state directory"),
            ("selftest", selftest, "check discovery, profile, inference and MQTT on this "
             "device; pass/fail/n/a per check")):
        sub = commands.add_parser(name, help=text)
        add_config_file(sub)
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


def command_config(args: argparse.Namespace) -> Config:
    """The config with the command line's overrides and the state directory by the one rule
    (agent.cli.common), its root checked; any error in it is a UsageError (exit 2) naming
    the file and key, or the flag."""
    from agent.config import ConfigError, check_root, from_dict, load_config

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


def _reload_config(args: argparse.Namespace) -> Config:
    """``command_config`` for a reload by SIGHUP: what it rejects, the running service survives."""
    from agent.service.lifecycle import ConfigRejected

    try:
        return command_config(args)
    except UsageError as error:
        raise ConfigRejected(str(error)) from None


LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"


def run(args: argparse.Namespace) -> int:
    from agent.config import profile_problem
    from agent.service.lifecycle import Runner
    from agent.service.local_broker import local_broker
    from agent.service.node import Service
    from agent.service.systemd import Notifier

    terminal = TerminalLine(sys.stdout) if sys.stdout.isatty() else None
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, handlers=None if terminal
                        is None else [terminal.handler(sys.stderr)])
    notifier = Notifier()
    config = command_config(args)
    unknown_profile = profile_problem(config)
    if unknown_profile is not None:  # the fleet must still reach the node to fix it
        logger.error("%s: the agent starts degraded", unknown_profile)
    m = config.mqtt  # a broker list is a cluster's: never one of run's own
    with StopSignals() as signals, local_broker(m.local_broker if m.brokers is None else False,
                                                m.host, m.port):
        service = Service(config, notifier=notifier)  # ServiceError: exit 1 (cli.common)
        logger.info("node %s, fleet %s, broker %s, state %s (config: %s)", config.node_id,
                    config.fleet, " or ".join(m.members), service.state_dir, config.source)
        if config.node_id_warning:  # the status lists it too
            logger.warning("%s", config.node_id_warning)
        runner = Runner(service, lambda: _reload_config(args), notifier, terminal, signals)
        runner.run(args.seconds)
    final = runner.service.final_status
    if final is not None:
        logger.info("stopped: %d records acknowledged by the broker, %d waiting in the "
                    "outbox", final["link"]["acked"], final["outbox"]["depth"])
    return runner.exit_status


def status(args: argparse.Namespace) -> int:
    from agent.service.reports import NoStatus, read_status

    config = command_config(args)
    try:
        state = read_status(Path(config.state_dir))
    except NoStatus as error:
        raise UsageError(str(error)) from None
    running = not state["stopped"] and state["age_s"] <= 5 + 3 * config.telemetry.interval_s
    if args.json:
        print(json.dumps({**state, "running": running}, indent=2))
        return 0 if running else 1
    print(("running" if running else "stopped" if state["stopped"] else
           f"not running (no update for {state['age_s']} s)")
          + f", node {state['node_id']}, pid {state['pid']}")
    print(status_line(state))
    for line in status_notes(state):
        print(line)
    return 0 if running else 1


def selftest(args: argparse.Namespace) -> int:
    """``edge-agent selftest``: pass, fail, warn or n/a per check; exit 1 when one fails.

    SIGINT or SIGTERM stops the probe agent cleanly; with no verdict, the exit status is
    128 + the signal (130, 143), never the 0 of a pass."""
    from agent.service.probe import run_selftest

    logging.basicConfig(level=logging.WARNING, format=LOG_FORMAT)
    config = command_config(args)
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
