"""Frequency floors as the kernel keeps them, for fixture roots (docs/kernel-facts/
ineffective.md, "Frequency floors").

``scaling_min_freq`` (drivers/cpufreq/cpufreq.c ``store_scaling_min_freq``) and devfreq's
``min_freq`` (drivers/devfreq/devfreq.c ``min_freq_store``) do not set a limit: they update
the user's frequency QoS request, and the file shows the effective floor, never below the
hardware's lowest frequency.  Writing 0 puts the request back to its default (no floor), so
the file then reads the hardware minimum again.  Below a fixture root a written value reads
back as that effective floor: at least ``cpuinfo_min_freq`` (cpufreq) or the lowest of
``available_frequencies`` (devfreq).
"""

from __future__ import annotations

import errno
import re
from pathlib import Path

_CPUFREQ_MIN = re.compile(r"/cpufreq/policy\d+/scaling_min_freq$")
_DEVFREQ_MIN = re.compile(r"/devfreq/[^/]+/min_freq$")


def handles(logical: str) -> bool:
    return bool(_CPUFREQ_MIN.search(logical) or _DEVFREQ_MIN.search(logical))


def _lowest(directory: Path, logical: str) -> int:
    if _CPUFREQ_MIN.search(logical):
        return int((directory / "cpuinfo_min_freq").read_text())
    try:
        return min(int(f) for f in (directory / "available_frequencies").read_text().split())
    except (OSError, ValueError):
        return 0


def write(target: Path, logical: str, value: str) -> None:
    """Write a floor to the fixture file ``target`` as the kernel shows it afterwards."""
    text = value.strip()
    if not text.isdigit():  # kstrtoul / sscanf("%u"): EINVAL
        raise OSError(errno.EINVAL, f"{logical}: {value!r} is not an unsigned integer")
    floor = max(int(text), _lowest(target.parent, logical))
    with open(target, "r+b") as handle:
        handle.write(f"{floor}\n".encode())
        handle.truncate()
