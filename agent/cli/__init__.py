"""The ``edge-agent`` command line: the top-level parser and its command groups.

Each group module owns its parser (``register``) and its handlers, and imports its subsystem
only when a handler runs, so building this parser (``--help`` too) loads no onnxruntime,
paho-mqtt or YAML.  A new group (``serve``, ``model``) is one more module in GROUPS.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from agent import __version__
from agent.cli import config, discover, fleet, infer, model, overlay, profile, serve, service
from agent.cli.common import exit_status, tell

GROUPS = (discover, profile, infer, service, serve, config, fleet, overlay, model)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edge-agent",
                                     description="Edge node agent and device manager.")
    parser.add_argument("--version", action="version", version=f"edge-agent {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in GROUPS:
        group.register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; an error it raises ends as EXIT_STATUS says (agent.cli.common)."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except (Exception, KeyboardInterrupt) as error:
        status = exit_status(error)
        if status is None:
            raise
        tell(args, error)
        return status


if __name__ == "__main__":
    raise SystemExit(main())
