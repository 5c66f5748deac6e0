"""Board identification: device-tree compatible (never ``model``, whose strings differ
between vendor and mainline trees), /etc/nv_tegra_release, DMI.
"""

from __future__ import annotations

import re

from agent.discovery.model import Board
from agent.kernel import parsers
from agent.kernel.reader import SysReader

# /proc/device-tree links to the sysfs copy; containers may have only one of them.
DT_BASES = ("/proc/device-tree", "/sys/firmware/devicetree/base")
DMI = "/sys/class/dmi/id"

JETSON_SOCS = {"tegra210": "Jetson Nano", "tegra194": "Jetson Xavier",
               "tegra234": "Jetson Orin", "tegra264": "Jetson Thor"}

JETSON_MODULES = {
    "p3701-0000": "Jetson AGX Orin", "p3701-0004": "Jetson AGX Orin 32GB",
    "p3701-0005": "Jetson AGX Orin 64GB", "p3701-0002": "IGX Orin",
    "p3767-0000": "Jetson Orin NX 16GB", "p3767-0001": "Jetson Orin NX 8GB",
    "p3767-0003": "Jetson Orin Nano 8GB", "p3767-0004": "Jetson Orin Nano 4GB",
    "p3767-0005": "Jetson Orin Nano (devkit)", "p2888": "Jetson AGX Xavier",
    "p3668": "Jetson Xavier NX", "p3448": "Jetson Nano", "p3834-0008": "Jetson AGX Thor devkit",
}

# L4T release -> JetPack, facts of the release history:
# https://developer.nvidia.com/embedded/jetpack-archive
L4T_TO_JETPACK = {
    "35.1.0": "5.0.2", "35.2.1": "5.1", "35.3.1": "5.1.1", "35.4.1": "5.1.2", "35.5.0": "5.1.3",
    "35.6.0": "5.1.4", "35.6.4": "5.1.6", "36.3.0": "6.0", "36.4.0": "6.1", "36.4.3": "6.2",
    "36.4.4": "6.2.1", "36.4.7": "6.2.1", "36.5.0": "6.2.2", "38.4.0": "7.1", "39.0.0": "7.2 EA",
    "39.2.0": "7.2 GA",
}

_ROCKCHIP_SOC = re.compile(r"^rockchip,(rk\d{4}s?)$")
_JETSON_MODULE = re.compile(r"^nvidia,(p\d{4}-\d{4})$")


def jetpack_for(l4t: str) -> str | None:
    if l4t in L4T_TO_JETPACK:
        return L4T_TO_JETPACK[l4t]
    return "7.0" if l4t.startswith("38.2.") else None


def _jetson_module_name(module: str) -> str | None:
    return JETSON_MODULES.get(module) or JETSON_MODULES.get(module.split("-")[0])


def _arch(cpuinfo: list[dict[str, str]], has_dt: bool) -> str | None:
    first = cpuinfo[0] if cpuinfo else {}
    if "vendor_id" in first or "flags" in first:
        return "x86_64" if " lm " in f" {first.get('flags', '')} " else "x86"
    if first.get("CPU architecture") == "8":
        return "aarch64"
    return "aarch64" if has_dt else None


def discover_board(reader: SysReader, cpuinfo: list[dict[str, str]]) -> Board:
    """Identify family, model and SoC; match on ``compatible``, never on ``model``."""
    dt_base = next((base for base in DT_BASES if reader.exists(base)), DT_BASES[0])
    compatible = reader.dt_strings(f"{dt_base}/compatible") or []
    model_strings = reader.dt_strings(f"{dt_base}/model")
    model = model_strings[0] if model_strings else None
    arch = _arch(cpuinfo, bool(compatible))

    for entry in compatible:
        vendor, _, soc = entry.partition(",")
        if vendor == "nvidia" and soc in JETSON_SOCS:
            return _jetson_board(reader, compatible, model, soc, arch)
        rockchip = _ROCKCHIP_SOC.match(entry)
        if rockchip:
            return Board(family="rockchip", model=model, soc=rockchip.group(1),
                         compatible=compatible, arch=arch, vendor=compatible[0].split(",")[0])

    if not compatible and arch in ("x86_64", "x86"):
        return _x86_board(reader, cpuinfo, arch)
    generic_soc = compatible[-1].split(",")[-1] if compatible else None
    return Board(family="generic", model=model, soc=generic_soc, compatible=compatible, arch=arch)


def _jetson_board(reader: SysReader, compatible: list[str], model: str | None, soc: str,
                  arch: str | None) -> Board:
    module = next((m.group(1) for m in map(_JETSON_MODULE.match, compatible) if m), None)
    l4t = None
    if reader.exists("/etc/nv_tegra_release"):
        l4t = reader.parsed("/etc/nv_tegra_release", parsers.parse_nv_tegra_release)
    return Board(family="jetson", model=model, soc=soc, compatible=compatible, arch=arch,
                 vendor="nvidia", module=module,
                 module_name=(_jetson_module_name(module) if module else None)
                 or JETSON_SOCS[soc],
                 l4t=l4t, jetpack=jetpack_for(l4t) if l4t else None)


def _x86_board(reader: SysReader, cpuinfo: list[dict[str, str]], arch: str) -> Board:
    vendor = reader.text(f"{DMI}/sys_vendor")
    product = reader.text(f"{DMI}/product_name")
    board_name = reader.text(f"{DMI}/board_name")
    parts = [p for p in (vendor, product) if p and p.lower() not in _DMI_PLACEHOLDERS]
    if board_name and board_name.lower() not in _DMI_PLACEHOLDERS and board_name != product:
        parts.append(f"({board_name})")
    first = cpuinfo[0] if cpuinfo else {}
    return Board(family="x86", model=" ".join(parts) or None, soc=first.get("model name"),
                 arch=arch, vendor=vendor,
                 virtual="hypervisor" in first.get("flags", "").split() if first else None)


# Firmware fills unset DMI fields with these.
_DMI_PLACEHOLDERS = {"to be filled by o.e.m.", "default string", "system product name",
                     "not applicable", "none", ""}
