"""A policy's governor with its energy_performance_preference, and the global turbo knobs.

EPP exists only while intel_pstate or amd-pstate-epp runs in active mode
(Documentation/admin-guide/pm/intel_pstate.rst, amd-pstate.rst).  Both drivers refuse any EPP
but ``performance`` while the policy runs the performance governor (EBUSY), so the writes are
ordered for apply and, reversed, for rollback: EPP first when the policy is not on
performance now, the governor first when it is and the profile moves it off.
"""

from __future__ import annotations

from typing import Any

from agent.tuning.plan import PlanContext

EPP_DRIVERS = ("intel_pstate", "amd-pstate-epp")
BOOST = "/sys/devices/system/cpu/cpufreq/boost"
NO_TURBO = "/sys/devices/system/cpu/intel_pstate/no_turbo"


def _epp(ctx: PlanContext, key: str, directory: str, epp: str, governor: str) -> None:
    path = f"{directory}/energy_performance_preference"
    driver = ctx.root.read_text(f"{directory}/scaling_driver").strip() \
        if ctx.root.exists(f"{directory}/scaling_driver") else "none"
    if driver not in EPP_DRIVERS or not ctx.root.exists(path):
        ctx.lacking(f"{key}.epp", f"{path} does not exist (scaling_driver {driver}; EPP needs "
                    "intel_pstate or amd-pstate-epp in active mode)", "a policy of those drivers")
        return
    offered = ctx.root.read_text(f"{directory}/energy_performance_available_preferences")
    if epp not in offered.split():
        raise ctx.error(f"{key}.epp", f"{epp!r} is not offered by {directory} (available: "
                        f"{', '.join(offered.split())})")
    if governor == "performance" and epp != "performance":
        raise ctx.error(f"{key}.epp", f"{epp} under the performance governor: {driver} "
                        "refuses it (EBUSY); allowed: performance, or governor powersave")
    ctx.want("cpufreq", path, epp, key)


def plan_policy(ctx: PlanContext, key: str, directory: str, governor: str | None,
                epp: str | None) -> None:
    """The governor (already chosen from its fallbacks) and EPP of one policy, in order."""
    path = f"{directory}/scaling_governor"
    now = ctx.current(path, key) if governor is not None or epp is not None else ""
    target = governor or now
    if governor is not None and now == "performance" and governor != now:
        ctx.want("cpufreq", path, governor, key)
        governor = None  # written before EPP, so EPP is not refused
    if epp is not None:
        _epp(ctx, key, directory, epp, target)
    if governor is not None:
        ctx.want("cpufreq", path, governor, key)


def plan_global(ctx: PlanContext, section: dict[str, Any]) -> None:
    """``dvfs.boost`` (acpi-cpufreq, amd-pstate: cpufreq/boost) and ``dvfs.no_turbo``
    (intel_pstate: intel_pstate/no_turbo; 1 keeps the cores at or below base frequency)."""
    if "boost" in section:
        ctx.want("cpufreq", BOOST, str(section["boost"]), "dvfs.boost", lacking=(
            " (intel_pstate has no boost file: use dvfs.no_turbo)", "a cpufreq driver with "
            "boost support (acpi-cpufreq, amd-pstate)"))
    if "no_turbo" in section:
        ctx.want("cpufreq", NO_TURBO, str(section["no_turbo"]), "dvfs.no_turbo", lacking=(
            " (no intel_pstate driver: use dvfs.boost)", "a device running intel_pstate"))
