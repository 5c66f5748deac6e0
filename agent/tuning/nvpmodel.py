"""nvpmodel: the Jetson power mode is the base policy a profile tunes within.

The live config (``/etc/nvpmodel.conf``) and the active mode (``/var/lib/nvpmodel/status``)
are parsed, never embedded: values drift between releases (an older AGX Orin conf caps
MODE_15W's GPU at 420750000 Hz, a newer one at 408000000).  The
agent only warns when a profile asks beyond the mode's caps; nvpmodel rewrites the limits at
boot and on ``nvpmodel -m`` anyway.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from agent.kernel.fsroot import Root

CONF = "/etc/nvpmodel.conf"
STATUS = "/var/lib/nvpmodel/status"
_BLOCK = re.compile(r"^<\s*(\w+)\s+(.*?)\s*>$")


@dataclass
class PowerMode:
    id: int
    name: str
    values: dict[tuple[str, str], int] = field(default_factory=dict)  # (param, arg) -> value


@dataclass
class NvpmodelConf:
    clock_paths: dict[tuple[str, str], list[str]]  # (param, MAX_FREQ) -> sysfs paths
    modes: dict[int, PowerMode]
    default: int | None
    # FILE parameters: (param, arg) -> paths, e.g. (TPC_POWER_GATING, TPC_PG_MASK) and, on
    # older confs, (EMC, MAX_FREQ) -> /sys/kernel/nvpmodel_emc_cap/emc_iso_cap
    file_paths: dict[tuple[str, str], list[str]] = field(default_factory=dict)

    def find(self, wanted: int | str) -> PowerMode | None:
        """A mode by id (``2``, ``"2"``) or by name, case-insensitively (``maxn``)."""
        if isinstance(wanted, int) or str(wanted).isdigit():
            return self.modes.get(int(wanted))
        return next((m for m in self.modes.values() if m.name.lower() == str(wanted).lower()),
                    None)

    def allowed(self) -> str:
        return ", ".join(f"{m.id} ({m.name})" for m in self.modes.values())


def _attributes(text: str) -> dict[str, str]:
    return dict(pair.split("=", 1) for pair in text.split() if "=" in pair)


def parse_conf(text: str) -> NvpmodelConf:
    """Parse an nvpmodel.conf: PARAM blocks (name -> paths) and POWER_MODEL blocks."""
    clock_paths: dict[tuple[str, str], list[str]] = {}
    file_paths: dict[tuple[str, str], list[str]] = {}
    modes: dict[int, PowerMode] = {}
    default = None
    param: str | None = None
    paths = clock_paths
    mode: PowerMode | None = None
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        block = _BLOCK.match(line)
        if block:
            kind, attributes = block.group(1), _attributes(block.group(2))
            param = attributes.get("NAME") if kind == "PARAM" else None
            paths = clock_paths if attributes.get("TYPE") == "CLOCK" else file_paths
            mode = None
            if kind == "POWER_MODEL":
                mode = PowerMode(int(attributes["ID"]), attributes.get("NAME", ""))
                modes[mode.id] = mode
            elif kind == "PM_CONFIG" and "DEFAULT" in attributes:
                default = int(attributes["DEFAULT"])
            continue
        words = line.split()
        if param and len(words) == 2:  # "MAX_FREQ_KNEXT /path": an alternative path
            arg = words[0].removesuffix("_KNEXT")
            paths.setdefault((param, arg), []).append(words[1])
        elif mode and len(words) == 3 and re.fullmatch(r"-?\d+", words[2]):
            mode.values[(words[0], words[1])] = int(words[2])
    return NvpmodelConf(clock_paths, modes, default, file_paths)


def load_conf(root: Root) -> NvpmodelConf | None:
    """The live conf; None where there is none (not a Jetson, or a container)."""
    try:
        return parse_conf(root.read_text(CONF))
    except OSError:
        return None


def active_mode_id(root: Root, conf: NvpmodelConf) -> int | None:
    """The mode nvpmodel last set (``pmode:NNNN``), else the conf's default (first boot)."""
    try:
        match = re.search(r"pmode:(\d+)", root.read_text(STATUS))
    except OSError:
        match = None
    return int(match.group(1)) if match else conf.default


def engine_caps(mode: PowerMode) -> dict[str, int | None]:
    """The EMC, DLA and PVA caps of a mode in Hz ({param: Hz}, None: no cap).  Values of 0
    or below mean "no cap" (-1; older confs write EMC 0 in MAXN)."""
    return {param: (value if value > 0 else None)
            for (param, arg), value in sorted(mode.values.items())
            if arg == "MAX_FREQ" and param.startswith(("EMC", "DLA", "PVA"))}


def active_caps(root: Root, mode_id: int | None = None) -> tuple[str, dict[str, int]] | None:
    """(mode name, {resolved max-frequency path: cap}) of the active mode, or None.

    ``mode_id`` names the mode instead: the one a profile switches to, whose caps then
    hold for everything planned after the switch."""
    conf = load_conf(root)
    if conf is None or not root.exists(STATUS):
        return None
    if mode_id is None:
        mode_id = active_mode_id(root, conf)
    mode = conf.modes.get(mode_id) if mode_id is not None else None
    if mode is None:
        return None
    caps: dict[str, int] = {}
    for (param, arg), value in mode.values.items():
        if arg != "MAX_FREQ" or value < 0:  # -1: no cap
            continue
        for path in conf.clock_paths.get((param, "MAX_FREQ"), []):
            if root.exists(path):
                caps[root.realpath(path)] = value
    return mode.name, caps
