"""Turn a source (a YAML table, a ``dts-overlays/`` entry, a ``.dtbo`` file) into a checked
overlay: compiled with ``dtc -@`` and read back through :func:`check.inspect`, so what is
installed is exactly what was validated.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from agent.overlays.check import Overlay, inspect
from agent.overlays.dtc import compile_dts
from agent.overlays.dts import render
from agent.overlays.errors import OverlayError
from agent.overlays.stock import DEFAULT_LIMITS, Limits
from agent.overlays.table import OppTable

NAME = re.compile(r"^[a-z0-9][a-z0-9_-]*$")  # the boot loaders take it as a file name


@dataclass(frozen=True)
class Built:
    name: str
    source: str | None     # overlay source, when built from one
    dtbo: bytes
    overlay: Overlay
    warnings: list[str]
    limits: Limits = DEFAULT_LIMITS   # what the tables were checked within


def overlay_dirs() -> list[Path]:
    """Shipped overlays: $EDGE_AGENT_OVERLAYS, the checkout's dts-overlays/, the venv's copy."""
    dirs = [Path(p) for p in os.environ.get("EDGE_AGENT_OVERLAYS", "").split(":") if p]
    dirs += [Path(__file__).resolve().parents[2] / "dts-overlays",
             Path(sys.prefix) / "dts-overlays"]
    return [d for d in dirs if d.is_dir()]


def entries() -> dict[str, Path]:
    """name -> source file; an earlier directory wins over a later one."""
    found: dict[str, Path] = {}
    for directory in reversed(overlay_dirs()):
        found.update({path.stem: path for path in sorted(directory.glob("*.dts"))})
    return found


def check_name(name: str, what: str = "overlay name") -> str:
    if not NAME.match(name):
        raise OverlayError(what, "", f"{name!r} is not allowed: expected lower-case letters, "
                           "digits, - and _ (it becomes a file name in /boot)")
    return name


def _compiled(name: str, source: str, file: str, notes: list[str], limits: Limits) -> Built:
    dtbo, dtc_warnings = compile_dts(source, file)
    overlay = inspect(dtbo, file, limits)
    return Built(name=name, source=source, dtbo=dtbo, overlay=overlay,
                 warnings=[*notes, *dtc_warnings, *overlay.warnings], limits=overlay.limits)


def from_table(table: OppTable, name: str) -> Built:
    """Render, compile and read back a validated table, under the limits it was checked with."""
    return _compiled(check_name(name), render(table), table.source, list(table.warnings),
                     table.limits)


def from_entry(name: str, limits: Limits = DEFAULT_LIMITS) -> Built:
    """Compile a ``dts-overlays/`` entry by name."""
    available = entries()
    if name not in available:
        raise OverlayError("dts-overlays", "", f"no overlay named {name!r} (available: "
                           f"{', '.join(sorted(available)) or 'none'})")
    path = available[name]
    return _compiled(check_name(name), path.read_text(encoding="utf-8"), str(path), [], limits)


def from_file(path: Path, limits: Limits = DEFAULT_LIMITS) -> Built:
    """A ``.dtbo`` built elsewhere (``overlay build --out``), or overlay source (``.dts``)."""
    name = check_name(path.stem, str(path))
    if path.suffix == ".dts":
        return _compiled(name, path.read_text(encoding="utf-8"), str(path), [], limits)
    dtbo = path.read_bytes()
    overlay = inspect(dtbo, str(path), limits)
    return Built(name=name, source=None, dtbo=dtbo, overlay=overlay,
                 warnings=list(overlay.warnings), limits=overlay.limits)
