"""systemctl for fixture roots: ``set-property --runtime`` as systemd does it, in drop-ins.

Below ``--root DIR`` (and in the tests) there is no systemd to ask.  This model answers the
same argv as :class:`~agent.tuning.units.Units` sends, the way systemctl does: a runtime
property becomes ``/run/systemd/system.control/<unit>.d/50-<Name>.conf`` below the root, a
bad value is refused with systemctl's words and changes nothing, and ``show`` prints the
kernel-facing form (``MemoryMax=3221225472``, ``CPUQuotaPerSecUSec=800ms``, ``[not set]``).
Every argv is kept in ``calls``.
"""

from __future__ import annotations

import errno
import re
from pathlib import Path

from agent.kernel.fsroot import Root
from agent.kernel.parsers import format_cpulist, parse_cpulist
from agent.tuning.units import BY_NAME, SLICE, UnitError, Units, check_owned, dropin_path

DEFAULTS = {"MemoryMax": "infinity", "MemoryHigh": "infinity", "CPUQuotaPerSecUSec":
            "infinity", "CPUWeight": "[not set]", "AllowedCPUs": "", "AllowedMemoryNodes": "",
            "MemoryCurrent": "[not set]"}
_BYTES = re.compile(r"^(\d+)([KMGT]?)$")
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_SECTION = {".slice": "Slice", ".scope": "Scope", ".service": "Service"}


def _span(usec: int) -> str:
    """A time span as systemctl show prints CPUQuotaPerSecUSec."""
    if usec >= 1_000_000:
        seconds, rest = divmod(usec, 1_000_000)
        return f"{seconds}s" if rest == 0 else f"{usec / 1e6:.3f}s"
    return f"{usec // 1000}ms" if usec % 1000 == 0 else f"{usec}us"


def shown_value(name: str, value: str) -> str:
    """What ``systemctl show`` prints after ``set-property NAME=VALUE``; ValueError where
    systemd refuses the assignment."""
    if name in ("MemoryMax", "MemoryHigh"):
        if value == "infinity":
            return value
        match = _BYTES.match(value)
        if match is None:
            raise ValueError(f"Failed to parse {name} value {value}")
        return str(int(match.group(1)) * _UNITS[match.group(2)])
    if name == "CPUQuota":
        if value == "":
            return "infinity"
        match = re.fullmatch(r"(\d+(?:\.\d{1,2})?)%", value)
        if match is None or float(match.group(1)) <= 0:
            raise ValueError(f"CPU quota '{value}' invalid.")
        return _span(round(float(match.group(1)) * 10_000))
    if name == "CPUWeight":
        if value == "":
            return "[not set]"
        if not value.isdigit() or not 1 <= int(value) <= 10000:
            raise ValueError(f"Failed to parse {name} value {value}")
        return value
    if name in ("AllowedCPUs", "AllowedMemoryNodes"):
        try:
            return format_cpulist(parse_cpulist(value.replace(" ", ",")))
        except ValueError:
            raise ValueError(f"Failed to parse {name} value {value}") from None
    raise ValueError(f"Unknown assignment: {name}={value}")


class DropInUnits(Units):
    """The fixture root's systemd: nothing is spawned through it."""

    spawns = False

    def __init__(self, root: Root) -> None:
        self.root = root
        self.calls: list[list[str]] = []

    def _dropin(self, unit: str, name: str) -> Path:
        return Path(self.root.host_path(dropin_path(unit, name)))

    def remove_dropin(self, unit: str, name: str) -> None:
        dropin = self._dropin(unit, name)
        if dropin.exists():
            dropin.unlink()
            if not any(dropin.parent.iterdir()):
                dropin.parent.rmdir()
            self.run(["systemctl", "daemon-reload"])

    def _shown(self, unit: str, shown: str) -> str:
        name = next((p.name for p in BY_NAME.values() if p.shown == shown), shown)
        dropin = self._dropin(unit, name)
        if dropin.exists():
            for line in dropin.read_text().splitlines():
                if line.startswith(f"{name}="):
                    return shown_value(name, line.partition("=")[2])
        return DEFAULTS.get(shown, "")

    def run(self, argv: list[str]) -> str:
        self.calls.append(list(argv))
        if argv[:2] == ["systemctl", "show"] and argv[2].startswith("--property="):
            unit = argv[-1]
            names = argv[2].removeprefix("--property=").split(",")
            return "".join(f"{n}={self._shown(unit, n)}\n" for n in names)
        if argv[:4] == ["systemctl", "set-property", "--runtime", "--"] and len(argv) == 6:
            unit, (name, _, value) = argv[4], argv[5].partition("=")
            check_owned(unit)
            try:
                shown_value(name, value)
            except ValueError as error:
                raise UnitError(errno.EINVAL, f"{' '.join(argv)}: {error}") from None
            dropin = self._dropin(unit, name)
            dropin.parent.mkdir(parents=True, exist_ok=True)
            section = _SECTION.get(unit[unit.rfind("."):], "Slice")
            dropin.write_text("# This is a drop-in unit file extension, created via "
                              "\"systemctl set-property\"\n# or an equivalent operation. Do "
                              f"not edit.\n[{section}]\n{name}={value}\n")
            return ""
        if argv == ["systemctl", "daemon-reload"]:
            return ""
        raise UnitError(errno.EINVAL, f"{' '.join(argv)}: not modelled for a fixture root")


__all__ = ["SLICE", "DropInUnits", "shown_value"]
