"""Inspect a compiled overlay: its targets, the labels it needs, and its OPP tables validated.

Hand-written overlays (``dts-overlays/*.dts``) and generated ones are held to the same SoC
facts: every fragment that targets a known OPP table, by label or by path, is read back into
operating points and checked like a YAML table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agent.overlays.errors import OverlayError
from agent.overlays.fdt import FdtError, Node, parse
from agent.overlays.socs import OppTarget, Soc, soc_for_compatible
from agent.overlays.stock import DEFAULT_LIMITS, PROPERTY, Limits
from agent.overlays.table import OppTable, check_points

BIN_PREFIX = "opp-microvolt-"


@dataclass(frozen=True)
class Fragment:
    name: str
    label: str | None     # the &label it targets (from __fixups__)
    path: str | None      # or its target-path
    body: Node            # the __overlay__ node


@dataclass(frozen=True)
class Overlay:
    compatibles: list[str]
    fragments: list[Fragment]
    labels: list[str]     # every label it references; the base needs them in __symbols__
    soc: Soc | None
    tables: list[OppTable]
    warnings: list[str]
    limits: Limits = DEFAULT_LIMITS  # what the tables were checked within


def _fixups(root: Node) -> dict[str, str]:
    """fragment path -> the label its ``target`` refers to."""
    fixups = root.children.get("__fixups__", Node("__fixups__"))
    targets: dict[str, str] = {}
    for label in fixups.props:
        for use in fixups.strings(label):  # "/fragment@0:target:0"
            path, prop, _ = use.rsplit(":", 2)
            if prop == "target":
                targets[path] = label
    return targets


def _cell_counts(soc: Soc, flavour: str) -> set[int]:
    supplies = soc.supplies.get(flavour, 1)
    return {supplies, 3 * supplies}  # one value or one triple per supply


def _voltage(node: Node, prop: str, key: str, file: str, soc: Soc,
             flavour: str) -> int | list[int] | None:
    """The first supply's voltage or triple of ``prop``, as a YAML table would spell it."""
    volts = node.cells(prop)
    if not volts:
        return None
    if len(volts) not in _cell_counts(soc, flavour):
        raise OverlayError(file, f"{key}.{prop}", f"{len(volts)} cells is not allowed: "
                           f"{flavour} kernels take "
                           f"{' or '.join(map(str, sorted(_cell_counts(soc, flavour))))}")
    return volts[0] if len(volts) < 3 else volts[:3]


def _entries(body: Node, file: str, soc: Soc, flavour: str,
             label: str) -> list[tuple[str, dict[str, Any]]]:
    entries = []
    for name, node in body.children.items():
        key = f"&{label}/{name}"
        hz_cells = node.cells("opp-hz")
        if len(hz_cells) not in (1, 2):
            raise OverlayError(file, f"{key}.opp-hz", "missing or not a 32/64-bit frequency")
        entry: dict[str, Any] = {"hz": hz_cells[0] << 32 | hz_cells[1] if len(hz_cells) == 2
                                 else hz_cells[0]}
        if node.string("status") == "disabled":
            entry["disabled"] = True
        volts = _voltage(node, "opp-microvolt", key, file, soc, flavour)
        if volts is not None:
            entry["microvolt"] = volts
        bins = {prop[len(BIN_PREFIX):]: _voltage(node, prop, key, file, soc, flavour)
                for prop in node.props if prop.startswith(BIN_PREFIX)}
        if bins:
            entry["bins"] = bins
        for flag in ("opp-suspend", "turbo-mode"):
            if flag in node.props:
                entry[flag] = True
        entries.append((key, entry))
    return entries


def _opp_target(fragment: Fragment, soc: Soc) -> tuple[OppTarget, str | None] | None:
    """The OPP table a fragment changes, with the flavour when its path tells it."""
    for target in soc.targets.values():
        if fragment.label == target.label:
            return target, None
        for flavour, path in target.paths.items():
            if fragment.path == path:
                return target, flavour
    return None


def _flavour(body: Node, soc: Soc, target: OppTarget) -> str:
    """Vendor when only vendor kernels have the table or the voltages carry two supplies."""
    if "mainline" not in target.paths:
        return "vendor"
    counts = {len(n.cells("opp-microvolt")) for n in body.children.values()} - {0}
    vendor_only = _cell_counts(soc, "vendor") - _cell_counts(soc, "mainline")
    return "vendor" if counts & vendor_only else "mainline"


def inspect(blob: bytes, file: str, limits: Limits = DEFAULT_LIMITS) -> Overlay:
    """Read a ``.dtbo`` and validate every OPP fragment, against the stock table within
    ``limits``; raises :class:`OverlayError`."""
    try:
        root = parse(blob)
    except FdtError as error:
        raise OverlayError(file, "", str(error)) from None
    targets = _fixups(root)
    fragments = [Fragment(name, targets.get(f"/{name}"), node.string("target-path"),
                          node.children["__overlay__"])
                 for name, node in root.children.items() if "__overlay__" in node.children]
    if not fragments:
        raise OverlayError(file, "", "not an overlay: no fragment with __overlay__ (the "
                           "source needs /plugin/)")
    declared = root.cells(PROPERTY)
    if declared:
        limits = limits.declared(declared[0], f"{PROPERTY} = <{declared[0]}> in {file}")
    compatibles = root.strings("compatible")
    soc = soc_for_compatible(compatibles)
    warnings = [] if soc else [f"{file}: no compatible naming a known SoC "
                               f"({', '.join(compatibles) or 'none'}): its OPP values are not "
                               "checked and an install cannot check the board"]
    tables: list[OppTable] = []
    if soc is not None:
        for fragment in fragments:
            found = _opp_target(fragment, soc)
            if found is not None:
                tables.append(_table(fragment, soc, *found, file, limits))
    warnings += [note for table in tables for note in table.warnings]
    fixups = root.children.get("__fixups__", Node("__fixups__"))
    return Overlay(compatibles=compatibles, fragments=fragments, labels=sorted(fixups.props),
                   soc=soc, tables=tables, warnings=warnings, limits=limits)


def _table(fragment: Fragment, soc: Soc, target: OppTarget, flavour: str | None,
           file: str, limits: Limits) -> OppTable:
    """A fragment that changes an OPP table, read back and checked like a YAML table."""
    flavour = flavour or _flavour(fragment.body, soc, target)
    entries = _entries(fragment.body, file, soc, flavour, target.label)
    opps, notes = check_points(entries, file, soc, flavour, target, limits)
    return OppTable(soc=soc, flavour=flavour, target=target, opps=opps, source=file,
                    warnings=notes, limits=limits)
