"""Armbian's own boot services that rewrite what a plan tunes: found through the root (unit
files, their .wants links, their config files) and named in the plan's warnings.

What each one overwrites (armbian/build packages/bsp/common):
- armbian-hardware-optimize.service runs /usr/lib/armbian/armbian-hardware-optimization at
  boot, its work in the background: every non-zram disk's I/O scheduler (none on flash,
  bfq on rotating disks); when /etc/default/cpufrequtils names ondemand, every policy's
  governor (ondemand, with io_is_busy/up_threshold tunables on rockchip-rk3588); IRQ
  affinity for the BOARDFAMILY values in IRQ_FAMILIES; rk3399's dmc governor.
- cpufrequtils (Debian's /etc/init.d/cpufrequtils reading Armbian's /etc/default/
  cpufrequtils): GOVERNOR, MIN_SPEED and MAX_SPEED on every CPU at boot, unless ENABLE=false.
- armbian-zram-config.service: vm.page-cluster = 0 when it sets up zram swap.
"""

from __future__ import annotations

import re

from agent.kernel.fsroot import Root
from agent.tuning.plan import Change

OPTIMIZE = "armbian-hardware-optimize.service"
ZRAM = "armbian-zram-config.service"
CPUFREQUTILS = "/etc/default/cpufrequtils"
# armbian-hardware-optimization's IRQ-distribution cases (rk3588 has none)
IRQ_FAMILIES = ("cubox", "udoo", "meson-g12b", "mvebu", "odroidc1", "odroidc2", "meson64",
                "odroidxu4", "rockchip", "rk322x", "rockchip64", "rk3399", "s500", "s5p6818",
                "sun6i", "sun7i", "sun8i", "sun50i", "sunxi64")
UNIT_DIRS = ("/etc/systemd/system", "/lib/systemd/system", "/usr/lib/systemd/system")


def _enabled(root: Root, unit: str) -> bool:
    """Installed, linked from a .wants directory, and not masked (a link to /dev/null)."""
    try:
        if root.readlink(f"/etc/systemd/system/{unit}") == "/dev/null":
            return False
    except OSError:
        pass
    installed = any(root.exists(f"{d}/{unit}") for d in UNIT_DIRS)
    return installed and bool(root.glob(f"/etc/systemd/system/*.wants/{unit}"))


def _settings(root: Root, path: str) -> dict[str, str]:
    """KEY=value lines of a shell-style config file (quotes stripped); {} when absent."""
    try:
        text = root.read_text(path)
    except OSError:
        return {}
    pairs = re.findall(r"^\s*([A-Z_]+)=\"?([^\"\n#]*)\"?", text, re.MULTILINE)
    return {k: v.strip() for k, v in pairs}


def _touches(changes: list[Change], *suffixes: str) -> list[str]:
    return sorted({c.key for c in changes if c.path.endswith(suffixes)})


def warnings(root: Root, changes: list[Change]) -> list[str]:
    found: list[str] = []
    cpufreq = _settings(root, CPUFREQUTILS)
    sysv = root.exists("/etc/init.d/cpufrequtils") or _enabled(root, "cpufrequtils.service")
    limits = _touches(changes, "/scaling_governor", "/scaling_min_freq", "/scaling_max_freq")
    if cpufreq and sysv and cpufreq.get("ENABLE", "true") != "false" and limits:
        shown = ", ".join(f"{k}={cpufreq[k]}" for k in ("GOVERNOR", "MIN_SPEED", "MAX_SPEED")
                          if cpufreq.get(k))
        found.append(f"cpufrequtils ({CPUFREQUTILS}: {shown}) sets every CPU's governor and "
                     f"limits at boot, overwriting {', '.join(limits)}; set ENABLE=false there "
                     "or run 'systemctl disable cpufrequtils'")
    if _enabled(root, OPTIMIZE):
        family = _settings(root, "/etc/armbian-release").get("BOARDFAMILY", "")
        overwritten = _touches(changes, "/queue/scheduler")
        if "ondemand" in cpufreq.get("GOVERNOR", ""):
            overwritten += _touches(changes, "/scaling_governor")
        if family in IRQ_FAMILIES:  # the script's case labels are exact names
            overwritten += _touches(changes, "/smp_affinity", "/smp_affinity_list")
        if family == "rk3399":
            overwritten += [c.key for c in changes if c.path.endswith("/dmc/governor")]
        if overwritten:
            found.append(f"{OPTIMIZE} (Armbian, BOARDFAMILY={family or 'unknown'}) rewrites "
                         f"{', '.join(sorted(set(overwritten)))} at boot, in the background, "
                         "possibly after this plan is applied; verify reports it as drift. "
                         f"'systemctl disable {OPTIMIZE}' stops it")
    page_cluster = _touches(changes, "/proc/sys/vm/page-cluster")
    if _enabled(root, ZRAM) and page_cluster:
        found.append(f"{ZRAM} (Armbian) sets vm.page-cluster=0 at boot, overwriting "
                     f"{', '.join(page_cluster)}")
    return found
