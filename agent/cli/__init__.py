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
from agent.cli.common import UsageError, non_negative_float, open_root, positive_float


def _discover(args: argparse.Namespace) -> int:
    from agent.discovery import discover
    from agent.discovery.summary import render_summary

    topology = discover(open_root(args.root))
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
    _add_profile_commands(commands)
    _add_infer_command(commands)
    _add_service_commands(commands)
    _add_config_commands(commands)
    _add_fleet_commands(commands)
    _add_overlay_commands(commands)
    return parser


def _profile(args: argparse.Namespace) -> int:
    from agent.cli import profile as profile_cli

    return profile_cli.run(args)


def _add_profile_commands(
        commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The profile subcommands; agent.cli.profile (tuning engine, YAML) loads only when used."""
    profile = commands.add_parser("profile", help="list, plan, apply, verify and roll back "
                                  "tuning profiles")
    actions = profile.add_subparsers(dest="action", required=True, metavar="ACTION")
    for action, text in (("list", "profiles, marking those that match this device"),
                         ("show", "a profile's merged settings"),
                         ("plan", "what applying a profile would change (nothing is written)"),
                         ("apply", "apply a profile through the crash-safe journal"),
                         ("verify", "check every applied setting still holds (exit 0 if so)"),
                         ("rollback", "restore every original value and clear the journal"),
                         ("status", "what is applied, from the journal")):
        sub = actions.add_parser(action, help=text)
        if action in ("show", "plan", "apply"):
            sub.add_argument("name", help="profile name, or auto for the best match")
        if action in ("plan", "apply"):
            sub.add_argument("--force", action="store_true",
                             help="apply even if the profile's match excludes this device")
        if action == "apply":
            sub.add_argument("--dry-run", action="store_true",
                             help="show what would be written, write nothing (same as plan)")
        if action == "rollback":
            sub.add_argument("--after-failure", action="store_true",
                             help="for the unit's ExecStopPost: roll back only when the "
                             "service did not stop cleanly (systemd's SERVICE_RESULT)")
        sub.add_argument("--root", default="/", metavar="DIR",
                         help="operate on sysfs/procfs below DIR instead of /")
        sub.add_argument("--state-dir", metavar="DIR",
                         help="journal location (default /var/lib/edge-agent, below --root "
                         "when one is given)")
        sub.add_argument("--json", action="store_true", help="machine-readable output")
        sub.set_defaults(handler=_profile)


def _infer(args: argparse.Namespace) -> int:
    from agent.cli import infer as infer_cli

    return infer_cli.run(args)


def _add_infer_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``infer``; onnxruntime loads only when it runs."""
    from agent.inference.demo_model import DEMO_MODEL_PATH  # a path: imports nothing heavy

    infer = commands.add_parser("infer", help="run a model in the inference loop for a while "
                                "and print latency statistics")
    infer.add_argument("--model", default=str(DEMO_MODEL_PATH),
                       help="ONNX model (default: the bundled demo CNN)")
    infer.add_argument("--seconds", type=positive_float, default=5.0)
    infer.add_argument("--rate", type=positive_float, default=None, metavar="HZ",
                       help="fixed call rate with deadline-miss counting (default: free-running)")
    infer.add_argument("--providers", metavar="P1,P2",
                       help="execution providers in order (default: chosen from the hardware)")
    infer.add_argument("--sha256", help="refuse the model unless its sha256 matches")
    infer.add_argument("--root", default="/", metavar="DIR",
                       help="discover the hardware below DIR instead of /")
    infer.add_argument("--state-dir", default="/var/lib/edge-agent", metavar="DIR",
                       help="where the optimised-model cache lives")
    infer.add_argument("--json", action="store_true", help="print the statistics contract")
    infer.add_argument("--swap-to", metavar="M2", help="hot-swap to this model during the run")
    infer.add_argument("--after", type=float, metavar="S",
                       help="seconds into the run for --swap-to (default: a third of it)")
    infer.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                       help="a live status line on stderr (default: when it is a terminal)")
    infer.set_defaults(handler=_infer)


def _run(args: argparse.Namespace) -> int:
    from agent.cli import service as run_cli

    return run_cli.run(args)


def _status(args: argparse.Namespace) -> int:
    from agent.cli import service as run_cli

    return run_cli.status(args)


def _selftest(args: argparse.Namespace) -> int:
    from agent.cli import service as run_cli

    return run_cli.selftest(args)


def _add_service_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``run`` (the main job), ``status`` and ``selftest``."""
    for name, handler, text in (
            ("run", _run, "the main job: discover, tune, infer and report over MQTT until "
             "SIGTERM"),
            ("status", _status, "what the running agent last wrote to its state directory"),
            ("selftest", _selftest, "check discovery, profile, inference and MQTT on this "
             "device; pass/fail/n/a per check")):
        sub = commands.add_parser(name, help=text)
        sub.add_argument("--config", metavar="FILE",
                         help="agent.yaml (default: /etc/edge-agent/agent.yaml if present, "
                         "else built-in defaults)")
        sub.add_argument("--root", metavar="DIR", help="override the config's root")
        sub.add_argument("--state-dir", metavar="DIR", help="override the config's state_dir")
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


def _config_check(args: argparse.Namespace) -> int:
    from agent.cli import config as config_cli

    return config_cli.run(args)


def _add_config_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``config check``: the checks ``run`` makes before it starts, without starting."""
    config = commands.add_parser("config", help="check an agent.yaml as run would read it")
    actions = config.add_subparsers(dest="action", required=True, metavar="ACTION")
    check = actions.add_parser("check", help="schema, values, root and tuning profile; "
                               "exit 0 if fine, 2 with each problem")
    check.add_argument("--config", metavar="FILE",
                       help="agent.yaml (default: /etc/edge-agent/agent.yaml if present, "
                       "else built-in defaults)")
    check.add_argument("--json", action="store_true", help="machine-readable output")
    check.set_defaults(handler=_config_check)


def _fleet(args: argparse.Namespace) -> int:
    from agent.cli import fleet as fleet_cli

    return fleet_cli.main_entry(args)


def _add_fleet_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``fleet``; paho and cryptography load only when it runs."""
    fleet = commands.add_parser("fleet", help="operator side: keys, signed commands, desired "
                                "state, a live table of nodes")
    actions = fleet.add_subparsers(dest="fleet_action", required=True)
    key = actions.add_parser("keygen", help="create an Ed25519 operator key")
    key.add_argument("--out", default="operator.key")
    key.add_argument("--force", action="store_true")
    key.add_argument("--json", action="store_true",
                     help="print {path, key_id, public_key, trusted_key}")
    for name, text in (("send", "sign a command, send it, print each node's outcome"),
                       ("desired", "set (retained) the profile/model a node or group should "
                        "run"),
                       ("watch", "a live table of nodes from their retained topics (redrawn "
                        "on a terminal; into a pipe, one table per refresh)")):
        sub = actions.add_parser(name, help=text)
        sub.add_argument("--config", metavar="FILE", help="take broker, TLS and fleet from an "
                         "agent.yaml")
        sub.add_argument("--broker", metavar="HOST:PORT")
        sub.add_argument("--fleet")
        if name in ("send", "desired"):
            sub.add_argument("target", help="a node id, group:NAME, or all")
            sub.add_argument("--key", required=True, help="the operator's private key (PEM)")
        if name == "send":
            # not dest "command": that names the top-level command in error messages
            sub.add_argument("fleet_command", metavar="command",
                             help="ping, get-status, apply-profile, ... (README)")
            sub.add_argument("--arg", action="append", metavar="K=V",
                             help="an argument; repeat; values are JSON when they parse")
            sub.add_argument("--args-json", metavar="JSON")
            sub.add_argument("--timeout", type=positive_float, default=15.0)
            sub.add_argument("--ttl", type=positive_float, default=60.0, help="seconds it is valid")
            sub.add_argument("--json", action="store_true")
        if name == "desired":
            sub.add_argument("--profile", help="a profile name, or none to roll back")
            sub.add_argument("--model")
            sub.add_argument("--sha256")
            sub.add_argument("--clear", action="store_true", help="remove the desired state")
            sub.add_argument("--ttl", type=positive_float, default=365 * 86400.0)
            sub.add_argument("--json", action="store_true",
                             help="print {topic, target, cleared, id, issued_at, expires_at, "
                             "args}")
        if name == "watch":
            sub.add_argument("--once", action="store_true", help="print one table and exit")
            sub.add_argument("--settle", type=non_negative_float, default=2.0,
                             help="with --once: seconds to collect before printing")
            sub.add_argument("--seconds", type=positive_float, help="stop after N seconds")
            sub.add_argument("--json", action="store_true",
                             help="one JSON object per line and refresh: {ts, fleet, nodes}")
    fleet.set_defaults(handler=_fleet)


def _overlay(args: argparse.Namespace) -> int:
    from agent.cli import overlay as overlay_cli

    return overlay_cli.run(args)


def _add_overlay_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``overlay``; YAML and the overlay tools load only when it runs."""
    overlay = commands.add_parser("overlay", help="build, validate, install and remove "
                                  "device-tree overlays for OPP tables (DVFS)")
    actions = overlay.add_subparsers(dest="action", required=True, metavar="ACTION")
    for action, text in (("build", "compile an overlay (.dtbo) from a table, entry or profile"),
                         ("validate", "check a table or overlay against the SoC's limits"),
                         ("install", "register an overlay with the boot loader (no reboot)"),
                         ("remove", "unregister an overlay edge-agent installed"),
                         ("list", "the overlays the boot configuration applies")):
        sub = actions.add_parser(action, help=text)
        if action in ("build", "validate", "install"):
            sub.add_argument("name", nargs="?", help="a dts-overlays/ entry, or a .dtbo/.dts "
                             "file")
            sub.add_argument("--profile", metavar="NAME", help="the entry named by a "
                             "profile's overlay.dvfs")
        if action in ("build", "validate"):
            sub.add_argument("--table", metavar="FILE.yaml", help="an OPP table to generate "
                             "the overlay from")
            sub.add_argument("--soc", help="with --table: rk3588 (or soc: in the table)")
            sub.add_argument("--flavour", help="with --table: vendor or mainline kernel")
            sub.add_argument("--target", help="with --table: cpu-little, cpu-big0, cpu-big1, "
                             "gpu or npu")
        if action == "build":
            sub.add_argument("--out", metavar="FILE", help="output (default: NAME.dtbo, or "
                             "stdout with --dts)")
            sub.add_argument("--dts", action="store_true", help="write the overlay source "
                             "instead of the compiled .dtbo")
        if action == "remove":
            sub.add_argument("name", help="the overlay's name")
        if action in ("install", "remove", "list"):
            sub.add_argument("--root", default="/", metavar="DIR",
                             help="the board's files below DIR (/boot, /proc/device-tree)")
        sub.add_argument("--json", action="store_true", help="machine-readable output"
                         + {"build": ": {name, out, format, bytes, warnings, tables}",
                            "install": ": {name, layout, config, dtbo, backup, changed, "
                            "reboot_needed, warnings, result}",
                            "remove": ": as install's"}.get(action, ""))
        sub.set_defaults(handler=_overlay)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except UsageError as error:
        print(f"edge-agent {args.command}: {error}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `edge-agent discover --json | head`
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:  # Ctrl-C in a command without its own stop path: no traceback
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
