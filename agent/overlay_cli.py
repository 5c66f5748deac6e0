"""``edge-agent overlay ...``: build, validate, install, remove and list DVFS overlays.

Wires the overlay parts together for a person or a script: a source (a YAML table, a
``dts-overlays/`` entry, a profile's ``overlay.dvfs``, a ``.dtbo``/``.dts`` file) becomes a
checked ``.dtbo``, which the installer registers with the board's boot loader.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from agent.cli import UsageError, open_root
from agent.fsroot import Root, RootError
from agent.overlays import build, installer
from agent.overlays.build import Built
from agent.overlays.dtc import DtcMissing
from agent.overlays.errors import InstallRefused, OverlayError
from agent.overlays.socs import MHZ
from agent.overlays.table import load_table
from agent.tuning.errors import ProfileError
from agent.tuning.profiles import ProfileStore


def _profile_overlay(name: str, root: Root) -> str:
    profile = ProfileStore(root).load(name)
    entry = profile.settings.get("overlay", {}).get("dvfs")
    if not entry:
        raise UsageError(f"profile {name} ({profile.file}) has no overlay.dvfs")
    return str(entry)


def _source(args: argparse.Namespace, root: Root) -> Built:
    """The one source the command names, compiled and checked."""
    given = [s for s in (args.name, getattr(args, "table", None), args.profile) if s]
    if len(given) != 1:
        raise UsageError("name one source: an overlay NAME (or a .dtbo/.dts file), "
                         + ("--table FILE, " if hasattr(args, "table") else "")
                         + "or --profile NAME")
    if getattr(args, "table", None):
        table = load_table(args.table, args.soc, args.flavour, args.target)
        return build.from_table(table, Path(args.table).stem)
    name = args.name or _profile_overlay(args.profile, root)
    path = Path(name)
    if path.suffix not in (".dtbo", ".dts"):
        return build.from_entry(name)
    if not path.is_file():
        raise UsageError(f"{name}: no such file")
    return build.from_file(path)


def _summary(built: Built) -> list[str]:
    lines = []
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


def _build(args: argparse.Namespace) -> int:
    built = _source(args, Root("/"))
    _warn(built.warnings)
    if args.dts:
        if built.source is None:
            raise UsageError(f"{built.name} is a compiled .dtbo: there is no source to print")
        if args.out is None:
            print(built.source, end="")
            return 0
        Path(args.out).write_text(built.source, encoding="utf-8")
    else:
        Path(args.out or f"{built.name}.dtbo").write_bytes(built.dtbo)
    print("\n".join([f"wrote {args.out or built.name + '.dtbo'}", *_summary(built)]))
    return 0


def _validate(args: argparse.Namespace) -> int:
    built = _source(args, Root("/"))
    if args.json:
        print(json.dumps({"name": built.name, "ok": True, "warnings": built.warnings,
                          "compatible": built.overlay.compatibles,
                          "labels": built.overlay.labels,
                          "tables": [{"soc": t.soc.name, "flavour": t.flavour,
                                      "target": t.target.name, "label": t.target.label,
                                      "opps": [{"hz": o.hz, "microvolt": o.microvolt,
                                                "opp-suspend": o.suspend,
                                                "turbo-mode": o.turbo, "disabled": o.disabled}
                                               for o in t.opps]}
                                     for t in built.overlay.tables]}, indent=2))
        return 0
    _warn(built.warnings)
    print("\n".join([f"{built.name}: valid, compiles with dtc -@", *_summary(built)]))
    return 0


def _install(args: argparse.Namespace) -> int:
    root = open_root(args.root)
    outcome = installer.install(root, _source(args, root))
    _warn(outcome.warnings)
    print(f"{outcome.name}: {outcome.dtbo}, registered in {outcome.config} ({outcome.layout})"
          f"\n{outcome.result}")
    return 0


def _remove(args: argparse.Namespace) -> int:
    outcome = installer.remove(open_root(args.root), build.check_name(args.name))
    print(f"{outcome.name}: removed from {outcome.config} ({outcome.layout})\n"
          f"{outcome.result}")
    return 0


def _list(args: argparse.Namespace) -> int:
    layout, items = installer.listed(open_root(args.root))
    if args.json:
        print(json.dumps({"layout": layout.kind, "config": layout.config, "overlays": items},
                         indent=2))
        return 0
    lines = [f"{layout.kind}: {layout.config}"]
    lines += [f"  {'*' if item['edge_agent'] else ' '} {item['name']:<36} {item['path']}"
              + ("" if item["present"] is not False else "  (missing)") for item in items]
    print("\n".join([*lines, "(* = installed by edge-agent)" if items else "  no overlays"]))
    return 0


ACTIONS = {"build": _build, "validate": _validate, "install": _install, "remove": _remove,
           "list": _list}


def run(args: argparse.Namespace) -> int:
    try:
        return ACTIONS[args.action](args)
    except (OverlayError, ProfileError) as error:
        print(f"edge-agent overlay {args.action}: {error}", file=sys.stderr)
        return 2
    except (InstallRefused, DtcMissing, RootError, OSError) as error:
        print(f"edge-agent overlay {args.action}: {error}", file=sys.stderr)
        return 1
