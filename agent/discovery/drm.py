"""GPUs found by the DRM driver bound to a ``/sys/class/drm/cardN`` device, and where each
driver keeps its clock and load (docs/kernel-facts/discovery.md has the sources and units).

devfreq, PCI class and NVML miss a GPU whose clock belongs to the firmware (the Pi 5's V3D:
no devfreq, a platform device); every GPU driver registers a DRM card, so the card's
``device/driver`` finds it on any board.  Display-only DRM drivers (vc4 on the Pi 4/5,
rockchip-drm, ast, simpledrm, bochs) are not GPUs: only the drivers below count.

Clock files, all read-only facts here (tuning writes none of them):

- i915: on the card, ``gt_act_freq_mhz`` (what the hardware runs), ``gt_cur_freq_mhz``
  (requested), ``gt_min/max_freq_mhz`` (the limits), ``gt_RPn/RP0_freq_mhz`` (the hardware
  range), MHz (drivers/gpu/drm/i915/gt/intel_gt_sysfs_pm.c).
- xe: on the device, ``tile0/gt0/freq0/{act,cur,min,max,rpn,rp0}_freq``, MHz
  (drivers/gpu/drm/xe/xe_gt_freq.c).
- amdgpu: on the device, ``pp_dpm_sclk`` (``N: <MHz>Mhz`` per level, ``*`` on the current
  one) and ``gpu_busy_percent`` (Documentation/gpu/amdgpu/thermal.rst).
- panfrost, panthor, lima, msm: devfreq (gpu.py reads it for any node such a driver is bound to).
- v3d, etnaviv, nouveau, powervr: no clock file (v3d's clock is the firmware's;
  v3d_sysfs.c's ``gpu_stats`` counts busy nanoseconds per queue).
"""

from __future__ import annotations

import re
from typing import NamedTuple

from agent.kernel.reader import SysReader

DRM = "/sys/class/drm"
GPU_DRIVERS = {"i915": "intel", "xe": "intel", "amdgpu": "amd", "radeon": "amd",
               "nouveau": "nvidia", "nvidia": "nvidia", "panfrost": "arm", "panthor": "arm",
               "lima": "arm", "v3d": "broadcom", "vc4": "broadcom", "msm": "qualcomm",
               "etnaviv": "vivante", "powervr": "imagination", "asahi": "apple"}
# vc4 renders only on BCM2835-7 (Pi 0-3); from the Pi 4 on it is the display and V3D renders
DISPLAY_ONLY_COMPATIBLES = {"brcm,bcm2711-vc5", "brcm,bcm2712-vc6"}
MHZ = 1_000_000
_CARD = re.compile(r"card\d+")
_SCLK_LEVEL = re.compile(r"^\s*\d+:\s*(\d+)\s*Mhz\s*(\*?)\s*$", re.IGNORECASE)


class DrmCard(NamedTuple):
    card: str  # "card1"
    device: str  # resolved sysfs device directory
    driver: str
    vendor: str


class DrmClock(NamedTuple):
    """What a driver's own files say, in Hz; None where it has no such file."""
    min_hz: int | None = None
    max_hz: int | None = None
    limit_min_hz: int | None = None
    limit_max_hz: int | None = None
    cur_hz: int | None = None
    available_hz: list[int] | None = None


class DrmFiles(NamedTuple):
    """Where telemetry samples one GPU: a clock file in MHz (or amdgpu's level table), a
    busy-percent file or V3D's busy-time counters; None where the driver has none."""
    freq_mhz: str | None = None
    sclk_table: str | None = None
    busy_pct: str | None = None
    gpu_stats: str | None = None


GpuStats = tuple[int, dict[str, int]]  # (timestamp ns, busy ns per queue)


def gpu_cards(reader: SysReader) -> list[DrmCard]:
    """One entry per GPU device that has a DRM card, by the driver bound to the device."""
    found: dict[str, DrmCard] = {}
    for name in sorted(reader.listdir(DRM), key=lambda n: (len(n), n)):
        if not _CARD.fullmatch(name):
            continue  # connectors (card1-HDMI-A-1), render nodes, version
        device = reader.realpath(f"{DRM}/{name}/device")
        driver = reader.driver(device) if device else None
        if device is None or driver not in GPU_DRIVERS or device in found:
            continue
        compatible = set(reader.dt_strings(f"{device}/of_node/compatible") or [])
        if compatible & DISPLAY_ONLY_COMPATIBLES:
            continue
        found[device] = DrmCard(name, device, driver, GPU_DRIVERS[driver])
    return list(found.values())


class MhzFiles(NamedTuple):
    """One driver's MHz files, relative to the directory that holds them."""
    rpn: str
    rp0: str
    min: str
    max: str
    act: str
    cur: str


I915_MHZ = MhzFiles("gt_RPn_freq_mhz", "gt_RP0_freq_mhz", "gt_min_freq_mhz", "gt_max_freq_mhz",
                    "gt_act_freq_mhz", "gt_cur_freq_mhz")  # on the card
XE_MHZ = MhzFiles("rpn_freq", "rp0_freq", "min_freq", "max_freq", "act_freq", "cur_freq")


def _mhz_files(card: DrmCard) -> tuple[str, MhzFiles] | None:
    """Where i915 (the card) and xe (the device's first GT) keep their MHz files."""
    if card.driver == "i915":
        return f"{DRM}/{card.card}", I915_MHZ
    if card.driver == "xe":
        return f"{card.device}/tile0/gt0/freq0", XE_MHZ
    return None


def files(reader: SysReader, card: DrmCard) -> DrmFiles:
    """The clock and load files ``card``'s driver offers, if they exist here."""
    mhz = _mhz_files(card)
    if mhz is not None:
        directory, names = mhz
        found = [f"{directory}/{n}" for n in (names.act, names.cur)
                 if reader.exists(f"{directory}/{n}")]
        return DrmFiles(freq_mhz=found[0] if found else None)
    if card.driver == "amdgpu":
        sclk, busy = f"{card.device}/pp_dpm_sclk", f"{card.device}/gpu_busy_percent"
        return DrmFiles(sclk_table=sclk if reader.exists(sclk) else None,
                        busy_pct=busy if reader.exists(busy) else None)
    stats = f"{card.device}/gpu_stats"
    if card.driver == "v3d" and reader.exists(stats):
        return DrmFiles(gpu_stats=stats)
    return DrmFiles()


def parse_gpu_stats(text: str) -> GpuStats:
    """V3D ``gpu_stats``: a ``queue timestamp jobs runtime`` header, then one line per queue
    (v3d_sysfs.c ``"%s\t%llu\t%llu\t%llu\n"``, the same local_clock() timestamp on all)."""
    lines = text.splitlines()
    if not lines or lines[0].split() != ["queue", "timestamp", "jobs", "runtime"]:
        raise ValueError(f"not a v3d gpu_stats table: {text[:40]!r}")
    timestamp, busy = 0, {}
    for line in lines[1:]:
        fields = line.split()
        if len(fields) != 4 or not all(f.isdigit() for f in fields[1:]):
            raise ValueError(f"not a gpu_stats queue line: {line!r}")
        timestamp, busy[fields[0]] = int(fields[1]), int(fields[3])
    if not busy:
        raise ValueError("gpu_stats lists no queue")
    return timestamp, busy


def busy_between(before: GpuStats, after: GpuStats) -> float | None:
    """Percent of the time between two readings the busiest queue ran (the queues overlap:
    bin and render run together, so a sum would exceed 100 %); None without a forward
    interval or with a counter that went back (a driver reload)."""
    elapsed = after[0] - before[0]
    deltas = [after[1][q] - before[1][q] for q in after[1] if q in before[1]]
    if elapsed <= 0 or not deltas or min(deltas) < 0:
        return None
    return round(min(100.0, max(deltas) * 100 / elapsed), 1)


def parse_sclk(text: str) -> tuple[list[int], int | None]:
    """amdgpu ``pp_dpm_sclk`` -> (level MHz in order, the starred one's MHz)."""
    levels, current = [], None
    for line in text.splitlines():
        match = _SCLK_LEVEL.match(line)
        if match is None:
            raise ValueError(f"not a pp_dpm_sclk level: {line!r}")
        levels.append(int(match.group(1)))
        if match.group(2):
            current = int(match.group(1))
    return levels, current


def _hz(reader: SysReader, path: str) -> int | None:
    mhz = reader.integer(path) if reader.exists(path) else None
    return mhz * MHZ if mhz is not None else None


def clock(reader: SysReader, card: DrmCard) -> DrmClock:
    """The hardware range, the limits and the current clock from the driver's own files:
    the clock the hardware runs (``act``) where the driver shows it, else the request."""
    mhz = _mhz_files(card)
    if mhz is not None:
        directory, names = mhz
        act = _hz(reader, f"{directory}/{names.act}")
        return DrmClock(min_hz=_hz(reader, f"{directory}/{names.rpn}"),
                        max_hz=_hz(reader, f"{directory}/{names.rp0}"),
                        limit_min_hz=_hz(reader, f"{directory}/{names.min}"),
                        limit_max_hz=_hz(reader, f"{directory}/{names.max}"),
                        cur_hz=act if act is not None else _hz(reader, f"{directory}/{names.cur}"))
    table = files(reader, card).sclk_table
    parsed = reader.parsed(table, parse_sclk) if table else None
    if parsed is None or not parsed[0]:
        return DrmClock()
    levels, current = parsed
    return DrmClock(min_hz=min(levels) * MHZ, max_hz=max(levels) * MHZ,
                    available_hz=sorted(level * MHZ for level in levels),
                    cur_hz=current * MHZ if current is not None else None)
