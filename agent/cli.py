"""The ``edge-agent`` command line.

Subcommands import their subsystem lazily so that ``edge-agent discover`` never pays for
onnxruntime or paho-mqtt.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from agent import __version__


def _discover(args: argparse.Namespace) -> int:
    from agent.discovery import discover
    from agent.discovery.summary import render_summary
    from agent.fsroot import Root

    try:
        root = Root(args.root)
    except FileNotFoundError:
        print(f"edge-agent discover: --root {args.root}: no such directory", file=sys.stderr)
        return 2
    topology = discover(root)
    if args.json:
        print(json.dumps(topology.to_dict(), indent=2))
    else:
        print(render_summary(topology))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edge-agent",
                                     description="Edge node agent and device manager.")
    parser.add_argument("--version", action="version", version=f"edge-agent {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    discover = commands.add_parser(
        "discover", help="show the hardware topology of this device (or of a fixture tree)")
    discover.add_argument("--root", default="/", metavar="DIR",
                          help="read sysfs/procfs below DIR instead of / (default: /)")
    discover.add_argument("--json", action="store_true",
                          help="print the topology/1 JSON contract instead of a summary")
    discover.set_defaults(handler=_discover)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except BrokenPipeError:  # `edge-agent discover --json | head`
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
