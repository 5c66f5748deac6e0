"""OPP tables: read from YAML, checked against the SoC facts before anything is compiled.

A table lists operating points for one OPP table of one SoC and kernel flavour::

    soc: rk3588              # or --soc; both given must agree
    flavour: mainline        # or --flavour: vendor BSP kernels and mainline differ
    target: cpu-big0         # or --target
    allow_undervolt_mv: 25   # any voltage below stock needs this (or --allow-undervolt MV)
    opps:
      - {hz: 408000000, microvolt: 675000}                 # one value: target = min = max
      - {hz: 2208000000, microvolt: [975000, 975000, 1000000], turbo-mode: true}
      - {hz: 2400000000, disabled: true}                   # switch a stock point off
      - {hz: 1800000000, microvolt: 837500, bins: {L6: 862500}}  # vendor: one bin's own

Every voltage is also held to the SoC's stock table (``stock``): none below stock unless an
undervolt is allowed with its amount, no frequency above the stock maximum unless the
command's flag allows it.  On vendor
kernels each per-bin voltage (``opp-microvolt-L<n>``) not given keeps its stock spread.

An overlay merges into the stock table: listed points are added or replaced, unlisted ones
stay.  Every error names the file, the entry (``opps[2].microvolt``), the value and what is
allowed, so a table can be fixed without reading this code.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from agent import yamlfile
from agent.overlays.errors import OverlayError
from agent.overlays.socs import FLAVOURS, MHZ, SOCS, OppTarget, Soc
from agent.overlays.stock import DEFAULT_LIMITS, Limits, Triple, check_floor, rescaled_bins
from agent.validation import Check, choice, integer, text, validate

FLAG = choice(True, False)


def _microvolt(value: Any) -> str | None:
    def is_uv(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v > 0
    ok = is_uv(value) or (isinstance(value, list) and len(value) == 3 and all(map(is_uv, value)))
    return None if ok else "a voltage in µV, or a [target, min, max] triple in µV"


def _bins(value: Any) -> str | None:
    ok = isinstance(value, dict) and all(isinstance(k, str) and _microvolt(v) is None
                                         for k, v in value.items())
    return None if ok else "a mapping of bin (L0..L7) to a voltage in µV or a triple"


ENTRY: dict[str, Check] = {"hz": integer(1), "microvolt": _microvolt, "opp-suspend": FLAG,
                           "turbo-mode": FLAG, "disabled": FLAG, "bins": _bins}
def _millivolts(value: Any) -> str | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1000
    return None if ok else "the undervolt allowed below stock, in mV (0..1000)"


DOCUMENT: dict[str, Any] = {
    "description": text(), "soc": text(), "flavour": text(), "target": text(),
    "allow_undervolt_mv": _millivolts,
    "opps": lambda v: None if isinstance(v, list) else "a list of operating points"}


@dataclass(frozen=True)
class Opp:
    hz: int
    microvolt: tuple[int, int, int] | None  # (target, min, max); None when disabled
    suspend: bool = False
    turbo: bool = False
    disabled: bool = False
    bins: tuple[tuple[str, Triple], ...] = ()  # vendor opp-microvolt-L<n>, by bin


@dataclass(frozen=True)
class OppTable:
    soc: Soc
    flavour: str
    target: OppTarget
    opps: tuple[Opp, ...]      # by rising frequency
    source: str                # the file it came from, for the generated header
    description: str = ""
    warnings: tuple[str, ...] = ()
    limits: Limits = DEFAULT_LIMITS


def resolve_target(file: str, soc_name: str, flavour: str,
                   target_name: str) -> tuple[Soc, OppTarget]:
    """The SoC and OPP table named, refused when this SoC/flavour has no such table."""
    soc = SOCS.get(soc_name)
    if soc is None:
        raise OverlayError(file, "soc", f"{soc_name!r} is not allowed: expected one of "
                           f"{', '.join(SOCS)}")
    if flavour not in FLAVOURS:
        raise OverlayError(file, "flavour", f"{flavour!r} is not allowed: expected one of "
                           f"{', '.join(FLAVOURS)} (the vendor BSP kernel or mainline)")
    if not soc.targets:
        raise OverlayError(file, "soc", f"{soc.name} has no OPP tables to overlay: {soc.note}")
    target = soc.targets.get(target_name)
    if target is None:
        raise OverlayError(file, "target", f"{target_name!r} is not allowed: expected one of "
                           f"{', '.join(soc.targets)} for {soc.name}")
    if flavour not in target.paths:
        raise OverlayError(file, "target", f"{target_name!r} is not allowed: {soc.name} "
                           f"{flavour} kernels have no {target_name} OPP table (it exists on: "
                           f"{', '.join(target.paths)})")
    return soc, target


def _hz(value: int) -> str:
    return f"{value} Hz ({value / MHZ:g} MHz)"


def _triple(file: str, key: str, raw: Any, target: OppTarget, where: str) -> Triple:
    """A voltage or triple as (target, min, max), each within the rail, in order."""
    triple = (raw, raw, raw) if isinstance(raw, int) else (raw[0], raw[1], raw[2])
    for index, value in enumerate(triple if isinstance(raw, list) else triple[:1]):
        if not target.min_uv <= value <= target.max_uv:
            cell = f"{key}[{index}]" if isinstance(raw, list) else key
            raise OverlayError(file, cell, f"{value} is not allowed: expected µV "
                               f"{target.min_uv}..{target.max_uv} (the {where} rail)")
    if not triple[1] <= triple[0] <= triple[2]:
        raise OverlayError(file, key, f"{list(triple)} is not allowed: expected [target, min, "
                           "max] with min <= target <= max")
    return triple


def _check_hz(file: str, name: str, hz: int, target: OppTarget, where: str,
              limits: Limits) -> str | None:
    """Refuse a frequency outside the stock range; above it, only with --allow-overclock."""
    if target.min_hz <= hz <= target.max_hz:
        return None
    if hz > target.max_hz and limits.allow_overclock:
        return (f"{name}: {_hz(hz)} is above the {where} maximum {_hz(target.max_hz)}: "
                "an overclock, allowed by --allow-overclock; its voltage is measured from "
                "the top stock point")
    raise OverlayError(file, f"{name}.hz", f"{hz} is not allowed: expected a frequency "
                       f"{target.min_hz}..{target.max_hz} Hz for {where}"
                       + (" (above it needs --allow-overclock)" if hz > target.max_hz else ""))


def _given_bins(file: str, name: str, entry: dict[str, Any], soc: Soc, flavour: str,
                target: OppTarget, where: str) -> dict[str, Triple]:
    allowed = soc.voltage_bins.get(flavour, ())
    bins: dict[str, Triple] = {}
    for bin_, raw in entry.get("bins", {}).items():
        if bin_ not in allowed:
            raise OverlayError(file, f"{name}.bins.{bin_}", "is not allowed: "
                               + (f"expected one of {', '.join(allowed)}" if allowed else
                                  f"{flavour} kernels have no per-bin voltages"))
        bins[bin_] = _triple(file, f"{name}.bins.{bin_}", raw, target, where)
    return bins


def _floors(points: list[tuple[Opp, str]], file: str, flavour: str, target: OppTarget,
            limits: Limits) -> list[str]:
    """Each voltage (the min cell: the lowest the regulator may set) against its stock."""
    notes = []
    for opp, name in points:
        if opp.microvolt is None:
            continue
        cells: list[tuple[str, int, str | None]] = [
            (f"{name}.microvolt", opp.microvolt[1], None),
            *((f"{name}.bins.{b}", t[1], b) for b, t in opp.bins)]
        for key, value, bin_ in cells:
            note = check_floor(file, key, opp.hz, value, target, flavour, limits, bin_)
            if note:
                notes.append(note)
    return notes


def check_points(entries: list[tuple[str, Any]], file: str, soc: Soc, flavour: str,
                 target: OppTarget, limits: Limits = DEFAULT_LIMITS
                 ) -> tuple[tuple[Opp, ...], tuple[str, ...]]:
    """Validate entries ``(name, {hz, microvolt, bins, ...})``; returns points and warnings."""
    if not entries:
        raise OverlayError(file, "opps", "no operating points: list at least one")
    by_hz: dict[int, str] = {}
    suspend: str | None = None
    points: list[tuple[Opp, str]] = []
    notes: list[str] = []
    where = f"{soc.name} {target.name}"
    bin_names = soc.voltage_bins.get(flavour, ())
    for name, entry in entries:
        validate(entry, ENTRY, name, file, OverlayError)
        if "hz" not in entry:
            raise OverlayError(file, name, "missing hz (the frequency in Hz)")
        hz = entry["hz"]
        notes += filter(None, [_check_hz(file, name, hz, target, where, limits)])
        if hz in by_hz:
            raise OverlayError(file, f"{name}.hz", f"{hz} is not allowed: {by_hz[hz]} has the "
                               "same frequency (each frequency once)")
        by_hz[hz] = name
        disabled = bool(entry.get("disabled"))
        if disabled:
            for key in ("microvolt", "opp-suspend", "turbo-mode", "bins"):
                if entry.get(key):
                    raise OverlayError(file, f"{name}.{key}", "a disabled operating point "
                                       "takes only hz")
            points.append((Opp(hz, None, disabled=True), name))
            continue
        if "microvolt" not in entry:
            raise OverlayError(file, name, "missing microvolt (µV, or a [target, min, max] "
                               "triple)")
        triple = _triple(file, f"{name}.microvolt", entry["microvolt"], target, where)
        given = _given_bins(file, name, entry, soc, flavour, target, where)
        rescaled = rescaled_bins(target, flavour, hz, triple,
                                 tuple(b for b in bin_names if b not in given))
        bins = tuple(sorted({**rescaled, **given}.items()))
        if entry.get("opp-suspend"):
            if suspend is not None:
                raise OverlayError(file, f"{name}.opp-suspend", f"{suspend} is already the "
                                   "suspend point (one per table)")
            suspend = name
        points.append((Opp(hz, triple, bool(entry.get("opp-suspend")),
                           bool(entry.get("turbo-mode")), bins=bins), name))
    points.sort(key=lambda point: point[0].hz)
    lower: tuple[int, int, str] | None = None  # hz, target µV, entry of the point below
    for opp, name in points:
        if opp.microvolt is None:
            continue
        if lower is not None and opp.microvolt[0] < lower[1]:
            raise OverlayError(file, f"{name}.microvolt", f"{opp.microvolt[0]} is not allowed: "
                               f"below the {lower[1]} µV of {lower[2]} at {_hz(lower[0])} "
                               "(voltage must not fall as frequency rises)")
        lower = (opp.hz, opp.microvolt[0], name)
    notes += _floors(points, file, flavour, target, limits)
    gate = target.gated_above_hz.get(flavour)
    notes += [
        f"{name}: {_hz(opp.hz)} is bin-gated by opp-supported-hw in the {flavour} {where} "
        "table: on a chip outside the bin it silently does not appear; check "
        "scaling_available_frequencies after the reboot"
        for opp, name in points if gate is not None and opp.hz > gate and not opp.disabled]
    return tuple(opp for opp, _ in points), tuple(notes)


def _pick(file: str, key: str, flag: str | None, document: dict[str, Any]) -> str:
    from_file = document.get(key)
    if flag and from_file and flag != from_file:
        raise OverlayError(file, key, f"the table says {from_file!r} but --{key} says {flag!r}")
    chosen = flag or from_file
    if not chosen:
        raise OverlayError(file, key, f"not given: say --{key} or {key}: in the table")
    return str(chosen)


def load_table(path: str | Path, soc: str | None = None, flavour: str | None = None,
               target: str | None = None, limits: Limits = DEFAULT_LIMITS) -> OppTable:
    """Read and validate a YAML OPP table; command-line values fill what the file leaves out."""
    file = str(path)
    try:
        document = yamlfile.load(Path(path).read_text(encoding="utf-8"))
    except OSError as error:
        raise OverlayError(file, "", f"cannot read: {error.strerror or error}") from None
    except yamlfile.DuplicateKeyError as error:
        raise OverlayError(file, error.path, error.message) from None
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        mark = getattr(error, "problem_mark", None)
        raise OverlayError(file, f"line {mark.line + 1}" if mark else "YAML",
                           f"not a valid YAML table: {error}") from None
    if not isinstance(document, dict):
        raise OverlayError(file, "", "a table is a YAML mapping with opps: [...] (and "
                           "optionally soc, flavour, target, description)")
    validate(document, DOCUMENT, "", file, OverlayError)
    if "allow_undervolt_mv" in document:
        amount = document["allow_undervolt_mv"]
        limits = limits.declared(round(amount * 1000),
                                 f"allow_undervolt_mv: {amount:g} in {file}")
    chosen_flavour = _pick(file, "flavour", flavour, document)
    the_soc, the_target = resolve_target(file, _pick(file, "soc", soc, document),
                                         chosen_flavour, _pick(file, "target", target, document))
    entries = [(f"opps[{i}]", entry) for i, entry in enumerate(document.get("opps", []))]
    opps, warnings = check_points(entries, file, the_soc, chosen_flavour, the_target, limits)
    return OppTable(soc=the_soc, flavour=chosen_flavour, target=the_target, opps=opps,
                    source=file, description=str(document.get("description", "")),
                    warnings=warnings, limits=limits)
