"""``edge-agent discover``: the hardware topology of this device, or of a fixture tree."""

from __future__ import annotations

import argparse

from agent.cli.common import open_root, print_json


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    discover = commands.add_parser(
        "discover", help="show the hardware topology of this device (or of a fixture tree)")
    discover.add_argument("--root", default="/", metavar="DIR",
                          help="read sysfs/procfs below DIR instead of / (default: /)")
    discover.add_argument("--json", action="store_true",
                          help="print the topology/1 JSON contract instead of a summary")
    discover.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from agent.discovery import discover
    from agent.discovery.summary import render_summary

    topology = discover(open_root(args.root))
    if args.json:
        print_json(topology.to_dict())
    else:
        print(render_summary(topology))
    return 0
