"""``edge-agent overlay ...``: build, validate, install, remove and list DVFS overlays.

Wires the overlay parts together for a person or a script: a source (a YAML table, a
``dts-overlays/`` entry, a profile's ``overlay.dvfs``, a ``.dtbo``/``.dts`` file) becomes a
checked ``.dtbo``, which the installer registers with the board's boot loader.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.cli.common import (
    UsageError,
    non_negative_float,
    open_root,
    print_json,
    render_table,
)

if TYPE_CHECKING:
    from agent.kernel.fsroot import Root
    from agent.overlays import installer
    from agent.overlays.bootfs import BootFiles
    from agent.overlays.build import Built
    from agent.overlays.stock import Limits

JSON_FIELDS = {"build": ": {name, out, format, bytes, warnings, limits, tables}",
               "install": ": {name, layout, config, dtbo, backup, changed, reboot_needed, "
               "warnings, result}",
               "remove": ": as install's"}


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    overlay = commands.add_parser("overlay", help="build, validate, install and remove "
                                  "device-tree overlays for OPP tables (DVFS)")
    actions = overlay.add_subparsers(dest="action", required=True, metavar="ACTION")
    for action, text in (("build", "compile an overlay (.dtbo) from a table, entry or profile"),
                         ("validate", "check a table or overlay against the SoC's limits"),
                         ("install", "register an overlay with the boot loader (no reboot)"),
                         ("remove", "unregister an overlay edge-agent installed"),
                         ("confirm", "after a good boot: stop U-Boot's try-once boot count"),
                         ("list", "the overlays the boot configuration applies")):
        sub = actions.add_parser(action, help=text)
        if action in ("build", "validate", "install"):
            sub.add_argument("name", nargs="?", help="a dts-overlays/ entry, or a .dtbo/.dts "
                             "file")
            sub.add_argument("--profile", metavar="NAME", help="the entry named by a "
                             "profile's overlay.dvfs")
            sub.add_argument("--allow-undervolt", metavar="MV", type=non_negative_float,
                             help="allow voltages up to MV millivolts below the SoC's stock "
                             "table (default: 50 mV)")
            sub.add_argument("--allow-overclock", action="store_true", help="allow "
                             "frequencies above the SoC's stock maximum")
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
        if action == "install":
            sub.add_argument("--no-fallback", action="store_true", help="install an "
                             "undervolting overlay without a try-once boot (a board that "
                             "does not boot then needs the console)")
        if action == "remove":
            sub.add_argument("name", help="the overlay's name")
        if action in ("install", "remove", "list", "confirm"):
            sub.add_argument("--root", default="/", metavar="DIR",
                             help="the board's files below DIR (/boot, /proc/device-tree)")
        sub.add_argument("--json", action="store_true", help="machine-readable output"
                         + JSON_FIELDS.get(action, ""))
        sub.set_defaults(handler=run)


def _profile_overlay(name: str, root: Root) -> str:
    from agent.tuning.profiles import ProfileStore

    profile = ProfileStore(root).load(name)
    entry = profile.settings.get("overlay", {}).get("dvfs")
    if not entry:
        raise UsageError(f"profile {name} ({profile.file}) has no overlay.dvfs")
    return str(entry)


def _limits(args: argparse.Namespace) -> Limits:
    from agent.overlays.stock import Limits

    return Limits.from_flags(args.allow_undervolt, args.allow_overclock)


def _source(args: argparse.Namespace, root: Root) -> Built:
    """The one source the command names, compiled and checked within the flags' limits."""
    from agent.overlays import build
    from agent.overlays.table import load_table

    limits = _limits(args)
    given = [s for s in (args.name, getattr(args, "table", None), args.profile) if s]
    if len(given) != 1:
        raise UsageError("name one source: an overlay NAME (or a .dtbo/.dts file), "
                         + ("--table FILE, " if hasattr(args, "table") else "")
                         + "or --profile NAME")
    if getattr(args, "table", None):
        table = load_table(args.table, args.soc, args.flavour, args.target, limits)
        return build.from_table(table, Path(args.table).stem)
    name = args.name or _profile_overlay(args.profile, root)
    path = Path(name)
    if path.suffix not in (".dtbo", ".dts"):
        return build.from_entry(name, limits)
    if not path.is_file():
        raise UsageError(f"{name}: no such file")
    return build.from_file(path, limits)


def _summary(built: Built) -> list[str]:
    from agent.overlays.socs import MHZ

    lines = [f"  checked against the stock table: {built.limits.describe()}"] \
        if built.overlay.tables else []
    for table in built.overlay.tables:
        live = [o.hz for o in table.opps if not o.disabled]
        off = [o.hz // MHZ for o in table.opps if o.disabled]
        span = f"{min(live) // MHZ}-{max(live) // MHZ} MHz" if live else "none enabled"
        lines.append(f"  {table.soc.name} {table.flavour} {table.target.name} "
                     f"(&{table.target.label}): {len(live)} point(s) {span}"
                     + (f", switched off: {', '.join(map(str, off))} MHz" if off else ""))
    tables = {t.target.label for t in built.overlay.tables}
    lines += [f"  {f.name} -> {'&' + f.label if f.label else f.path}"
              for f in built.overlay.fragments if f.label not in tables]
    return lines


def _warn(messages: list[str]) -> None:
    for message in messages:
        print(f"warning: {message}", file=sys.stderr)


def _tables(built: Built) -> list[dict[str, Any]]:
    return [{"soc": t.soc.name, "flavour": t.flavour, "target": t.target.name,
             "label": t.target.label,
             "opps": [{"hz": o.hz, "microvolt": o.microvolt, "opp-suspend": o.suspend,
                       "turbo-mode": o.turbo, "disabled": o.disabled, "bins": dict(o.bins)}
                      for o in t.opps]}
            for t in built.overlay.tables]


def _build(args: argparse.Namespace) -> int:
    built = _source(args, open_root("/"))
    if not args.json:
        _warn(built.warnings)
    if args.dts and built.source is None:
        raise UsageError(f"{built.name} is a compiled .dtbo: there is no source to print")
    data = built.source.encode() if args.dts and built.source is not None else built.dtbo
    out = args.out if args.dts else args.out or f"{built.name}.dtbo"
    if out is not None:
        Path(out).write_bytes(data)
    if args.json:
        print_json({"name": built.name, "out": out, "format": "dts" if args.dts else "dtbo",
                    "bytes": len(data), **({"source": built.source} if out is None else {}),
                    "warnings": built.warnings, "limits": built.limits.as_json(),
                    "tables": _tables(built)})
    elif out is None:
        print(built.source, end="")
    else:
        print("\n".join([f"wrote {out}", *_summary(built)]))
    return 0


def _validate(args: argparse.Namespace) -> int:
    built = _source(args, open_root("/"))
    if args.json:
        print_json({"name": built.name, "ok": True, "warnings": built.warnings,
                    "limits": built.limits.as_json(),
                    "compatible": built.overlay.compatibles, "labels": built.overlay.labels,
                    "tables": _tables(built)})
        return 0
    _warn(built.warnings)
    print("\n".join([f"{built.name}: valid, compiles with dtc -@", *_summary(built)]))
    return 0


def _files(root: Root, name: str) -> tuple[BootFiles, list[str]]:
    """The files an install or remove of ``name`` may touch: the .dtbo, the boot config,
    its backup."""
    from agent.overlays.bootfs import BootFiles
    from agent.overlays.layouts import detect

    boot = BootFiles(root)
    layout = detect(root, boot)
    return boot, [layout.dtbo_path(name), layout.config, layout.backup_path(name)]


def _changed(boot: BootFiles, before: dict[str, bytes | None]) -> list[dict[str, str]]:
    """What happened to each file, read back from the disk rather than assumed."""
    changes = []
    for path, old in before.items():
        new = boot.read(path)
        if new != old:
            changes.append({"path": path, "action": "created" if old is None else
                            "removed" if new is None else "updated"})
    return changes


def _report(outcome: installer.Outcome, changes: list[dict[str, str]],
            backup: str) -> dict[str, Any]:
    return {"name": outcome.name, "layout": outcome.layout, "config": outcome.config,
            "dtbo": outcome.dtbo, "backup": backup, "changed": changes,
            "reboot_needed": bool(changes), "warnings": outcome.warnings,
            "result": outcome.result}


def _install(args: argparse.Namespace) -> int:
    from agent.overlays import installer

    root = open_root(args.root)
    built = _source(args, root)
    boot, paths = _files(root, built.name)
    before = {path: boot.read(path) for path in paths}
    outcome = installer.install(root, built, fallback=not args.no_fallback)
    if args.json:
        print_json(_report(outcome, _changed(boot, before), paths[2]))
        return 0
    _warn(outcome.warnings)
    print(f"{outcome.name}: {outcome.dtbo}, registered in {outcome.config} ({outcome.layout})"
          f"\n{outcome.result}")
    return 0


def _remove(args: argparse.Namespace) -> int:
    from agent.overlays import build, installer

    root = open_root(args.root)
    name = build.check_name(args.name)
    boot, paths = _files(root, name)
    before = {path: boot.read(path) for path in paths}
    outcome = installer.remove(root, name)
    if args.json:
        print_json(_report(outcome, _changed(boot, before), paths[2]))
        return 0
    print(f"{outcome.name}: removed from {outcome.config} ({outcome.layout})\n"
          f"{outcome.result}")
    return 0


def _confirm(args: argparse.Namespace) -> int:
    from agent.overlays.tryonce import TryOnce

    TryOnce(open_root(args.root)).disarm()
    if args.json:
        print_json({"confirmed": True})
    else:
        print("U-Boot's try-once boot count stopped (upgrade_available=0, bootcount=0): the "
              "installed tree is the one it boots")
    return 0


def _list(args: argparse.Namespace) -> int:
    from agent.overlays import installer

    layout, items = installer.listed(open_root(args.root))
    if args.json:
        print_json({"layout": layout.kind, "config": layout.config, "overlays": items})
        return 0
    rows = [(f"{'*' if item['edge_agent'] else ' '} {item['name']}",
             f"{item['path']}{'' if item['present'] is not False else '  (missing)'}")
            for item in items]
    print("\n".join([f"{layout.kind}: {layout.config}",
                     *([render_table(rows, indent="  "), "(* = installed by edge-agent)"] if rows
                       else ["  no overlays"])]))
    return 0


ACTIONS = {"build": _build, "validate": _validate, "install": _install, "remove": _remove,
           "list": _list, "confirm": _confirm}


def run(args: argparse.Namespace) -> int:
    return ACTIONS[args.action](args)
