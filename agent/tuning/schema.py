"""Profile schema: every key, its type and allowed values, checked before planning.

Validation only looks at the YAML; values the hardware does not offer are checked at plan
time (see ``values``).  Errors name the file, the key path and what is allowed.
"""

from __future__ import annotations

import re
from typing import Any

from agent.tuning.errors import ProfileError
from agent.tuning.values import is_cpu_selector, is_size
from agent.validation import choice, integer, number, text, validate

THP_ENABLED = ("always", "madvise", "never")
THP_DEFRAG = ("always", "defer", "defer+madvise", "madvise", "never")
RT_POLICIES = ("other", "fifo", "rr", "batch", "idle")
# vm.* (one file below /proc/sys/vm) plus the names in tuners/sysctl.ALLOWED, each with its
# documented values there
SYSCTL_KEY = re.compile(r"^(vm\.[a-z_-]+|kernel\.(timer_migration|nmi_watchdog|numa_balancing)"
                        r"|net\.core\.(busy_poll|busy_read))$")
# "performance|schedutil": the first governor the policy or devfreq node offers wins
GOVERNORS = re.compile(r"^[a-z0-9_]+(\|[a-z0-9_]+)*$")
# energy_performance_preference names (Documentation/admin-guide/pm/intel_pstate.rst,
# amd-pstate.rst); raw 0-255 values are left out on purpose
EPP = ("default", "performance", "balance_performance", "balance_power", "power")
ASPM_POLICIES = ("default", "performance", "powersave", "powersupersave")
BLOCK_PATTERN = re.compile(r"^[A-Za-z0-9*?\[\]_-]+$")  # a device-name glob, never a path
IRQ_PATTERN = re.compile(r"^[A-Za-z0-9*?\[\]_.:-]+$")
CGROUP_PATH = re.compile(r"^(?!(.*/)?\.\.?(/|$))[A-Za-z0-9_.@-]+(/[A-Za-z0-9_.@-]+)*$")
PROFILE_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]*$")
# kernel arguments (agent.tuning.tuners.cmdline documents each)
CMDLINE_NAMES = ("isolcpus", "nohz_full", "rcu_nocbs", "irqaffinity", "nvme.poll_queues",
                 "transparent_hugepage")
UNIT_NAME = re.compile(r"^[A-Za-z0-9:_.@-]{1,240}\.service$")


def _frequency(value: Any) -> str | None:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return None
    if value in ("min", "max") or (isinstance(value, str) and re.fullmatch(r"~\d+", value)):
        return None
    return "a frequency (integer), min, max, or ~N for the nearest offered step"


def _cpus(value: Any) -> str | None:
    return None if is_cpu_selector(value) else (
        "cluster:big, cluster:mid, cluster:little, all, housekeeping, or a CPU list such as "
        "cpus:4-7")


def _housekeeping(value: Any) -> str | None:
    if value == "housekeeping":
        return "a CPU set other than housekeeping itself, e.g. cluster:little or cpus:0"
    return _cpus(value)


def _optional_key(value: Any) -> str | None:
    """A section or key path whose knobs a kernel may lack (``thp``, ``sysctl.vm.foo``)."""
    ok = isinstance(value, str) and value.split(".", 1)[0] in SCHEMA and value.split(
        ".", 1)[0] not in ("name", "description", "include", "match", "optional")
    return None if ok else ("a section or key path of this profile, such as thp or "
                            "thp.enabled")


def _size(value: Any) -> str | None:
    return None if is_size(value) else "bytes, a size with K/M/G, a percentage such as 90%, or max"


def _cpu_max(value: Any) -> str | None:
    ok = value == "max" or (isinstance(value, str) and re.fullmatch(r"(max|\d+) \d+", value))
    return None if ok else "max, or '<quota_us> <period_us>' such as '50000 100000'"


def _cmdline(value: Any) -> str | None:
    """A value that is one kernel-argument token: no spaces, quotes, $ or newlines."""
    ok = (isinstance(value, int) and not isinstance(value, bool) and value >= 0) or (
        isinstance(value, str) and re.fullmatch(r"[A-Za-z0-9_.,:+-]{1,200}", value))
    return None if ok else ("a CPU selector (isolcpus may lead with flags: managed_irq,"
                            "domain,cluster:big), a number, or a word such as madvise; no "
                            "spaces, quotes or $")


def _memlock(value: Any) -> str | None:
    return None if value == "infinity" or (is_size(value) and "%" not in str(value)) else \
        "bytes, a size with K/M/G, or infinity"


def _string_list(value: Any) -> str | None:
    ok = isinstance(value, str) or (isinstance(value, list) and value and all(
        isinstance(v, str) for v in value))
    return None if ok else "a string or a list of strings"


def _nr_requests(value: Any) -> str | None:
    ok = value == "max" or (isinstance(value, int) and not isinstance(value, bool)
                            and value >= 1)
    return None if ok else "an integer 1.., or max for the largest the device accepts"


def _power_mode(value: Any) -> str | None:
    ok = (isinstance(value, int) and not isinstance(value, bool) and value >= 0) or (
        isinstance(value, str) and bool(re.fullmatch(r"[A-Za-z0-9_.-]+", value)))
    return None if ok else ("a power mode id (0, 1, ...) or name (MAXN, 15W, ...) of "
                            "/etc/nvpmodel.conf")


def _emc_rate(value: Any) -> str | None:
    ok = value == "max" or (isinstance(value, int) and not isinstance(value, bool)
                            and value > 0)
    return None if ok else "max, or an EMC rate in Hz such as 2133000000"


def _fan_pwm(value: Any) -> str | None:
    ok = value == "max" or (isinstance(value, int) and not isinstance(value, bool)
                            and 0 <= value <= 255)
    return None if ok else "max, or a PWM duty 0..255"


def _railgate(value: Any) -> str | None:
    return None if value == "off" or value is False else (
        "off (YAML also reads a bare off as false)")


GOVERNOR = text(GOVERNORS, "a governor name, or fallbacks such as performance|schedutil")
DEVFREQ = {"governor": GOVERNOR, "min_hz": _frequency, "max_hz": _frequency}
RT_THREAD = {"policy": choice(*RT_POLICIES), "priority": integer(0, 99), "cpus": _cpus}
THREAD_SELECTOR = {"comm": text(re.compile(r"^[^/]{1,64}$"), "a thread-name pattern such as "
                                 "irq/*-nvme*"), "pid": integer(1), **RT_THREAD}

# key -> Check, or a nested dict for a mapping with fixed keys, or ("map", key_check, value)
SCHEMA: dict[str, Any] = {
    "name": text(PROFILE_NAME, "a lower-case name: letters, digits, - and _"),
    "description": text(),
    "include": ("list", text(PROFILE_NAME, "a profile name")),
    "match": {"family": _string_list, "soc": _string_list, "model": text()},
    "cgroup": {"path": text(CGROUP_PATH, "a relative cgroup path without '..', e.g. "
                             "edge-agent.slice/inference"),
               "memory_max": _size, "memory_high": _size, "cpu_max": _cpu_max,
               "cpu_weight": integer(1, 10000),
               "cpus": _cpus, "mems": text(re.compile(r"^\d+(-\d+)?(,\d+(-\d+)?)*$"),
                                            "a NUMA node list such as 0 or 0-1")},
    "thp": {"enabled": choice(*THP_ENABLED), "defrag": choice(*THP_DEFRAG),
            "khugepaged_defrag": choice(0, 1, True, False),
            "dynamic": {"disable_above_psi_some_avg10": number(0, 100),
                        "restore_below_psi_some_avg10": number(0, 100),
                        "hold_s": number(0, 86400)}},
    "optional": ("list", _optional_key),
    "rt": {"inference": RT_THREAD, "threads": ("list", THREAD_SELECTOR),
           "housekeeping_cpus": _housekeeping,
           "sched_rt_runtime_us": integer(-1, 1_000_000),
           "unthrottled_reason": text(what="a sentence: why RT throttling may be off"),
           "workqueue_cpus": _cpus, "kthreads": _cpus,
           "default_irq_affinity": _cpus,
           "irq_affinity": ("map", text(IRQ_PATTERN, "an IRQ action-name pattern such as "
                                         "nvme*"), _cpus)},
    "block": ("map", text(BLOCK_PATTERN, "a device-name pattern such as nvme*"),
              {"scheduler": text(), "nr_requests": _nr_requests, "read_ahead_kb": integer(0),
               "io_poll": choice(0, 1), "io_poll_delay": integer(-1),
               "rq_affinity": choice(0, 1, 2),
               # Documentation/ABI/stable/sysfs-block: -1 resets to the default, 0 disables
               "wbt_lat_usec": integer(-1), "nomerges": choice(0, 1, 2),
               "add_random": choice(0, 1), "max_sectors_kb": integer(4)}),
    # kstrtos32; S32_MAX itself reads back as "any" (drivers/base/power/sysfs.c)
    "nvme": {"default_ps_max_latency_us": integer(0, 2**31 - 2)},
    "dvfs": {"cpu": ("map", _cpus, {"governor": GOVERNOR, "min_khz": _frequency,
                                    "max_khz": _frequency, "epp": choice(*EPP)}),
             "gpu": DEVFREQ, "npu": DEVFREQ, "dmc": DEVFREQ,
             "boost": choice(0, 1), "no_turbo": choice(0, 1)},
    "pcie": {"aspm_policy": choice(*ASPM_POLICIES)},
    # vendor rknpu driver's debugfs (drivers/rknpu/rknpu_debugger.c): a power hold and the
    # idle power-off delay
    "rknpu": {"power": choice("on", "off", True, False),  # YAML 1.1 reads a bare on as true
               "power_off_delay_ms": integer(0, 86_400_000)},
    "cpuidle": {"disable_deeper_than_us": integer(0, 2**31 - 2),
                "dma_latency_us": integer(0, 2_000_000_000)},
    "nvpmodel": {"mode": _power_mode},
    "jetson_clocks": {"gpu": choice("max"), "railgate": _railgate, "emc": _emc_rate,
                      "fan": _fan_pwm},
    "sysctl": ("map", text(SYSCTL_KEY, "a vm.* sysctl name such as vm.swappiness, or one of "
                        "kernel.timer_migration, kernel.nmi_watchdog, kernel.numa_balancing, "
                        "net.core.busy_poll, net.core.busy_read"),
               lambda v: None if isinstance(v, int) and not isinstance(v, bool)
               else "an integer"),
    "overlay": {"dvfs": text(PROFILE_NAME, "a dts-overlays/ entry name")},  # key required
    "cmdline": ("map", choice(*CMDLINE_NAMES), _cmdline),
    "irqbalance": {"banned_cpus": _cpus},
    # /proc/sys/kernel/io_uring_disabled (0 all, 1 CAP_SYS_ADMIN or io_uring_group, 2 none)
    # and io_uring_group (a gid; -1 none): Documentation/admin-guide/sysctl/kernel.rst
    "io_uring": {"disabled": choice(0, 1, 2), "group": integer(-1, 2**31 - 1),
                 "limit_memlock": {"units": ("list", text(UNIT_NAME, "a service unit name "
                                                          "such as edge-agent.service")),
                                   "value": _memlock}},
}


def validate_profile(data: Any, file: str) -> dict[str, Any]:
    """Check a parsed profile document against the schema; returns it unchanged."""
    if not isinstance(data, dict):
        raise ProfileError(file, "", "a profile is a YAML mapping of sections "
                           f"({', '.join(SCHEMA)})")
    validate(data, SCHEMA, "", file, ProfileError)
    if "overlay" in data and "dvfs" not in data["overlay"]:
        raise ProfileError(file, "overlay", "expected overlay.dvfs, a dts-overlays/ entry name")
    memlock = data.get("io_uring", {}).get("limit_memlock")
    if memlock is not None and not {"units", "value"} <= set(memlock):
        raise ProfileError(file, "io_uring.limit_memlock", "expected units (a list of service "
                           "names) and value (bytes, a size with K/M/G, or infinity)")
    return data
