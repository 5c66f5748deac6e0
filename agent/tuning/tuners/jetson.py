"""``nvpmodel: {mode: <id or name>}``: the Jetson power mode a profile requires.

The mode is validated against the live ``/etc/nvpmodel.conf`` (ids and names drift between
modules and releases) and planned as one ``nvpmodel:mode`` change, applied with
``nvpmodel -m`` (see ``agent.tuning.nvpmodel_mode``) before any clock setting: a switch
rewrites the cpufreq/devfreq limits, so whatever is planned after it is planned against the
wanted mode's caps (``planned_mode``).  A switch that needs a reboot is refused here.

The plan also reports the EMC, DLA and PVA caps of the mode in force after it
(``runtime.nvpmodel``), which no sysfs limit of the agent's own shows.
"""

from __future__ import annotations

from typing import Any

from agent.kernel import parsers
from agent.tuning import nvpmodel
from agent.tuning.nvpmodel import NvpmodelConf, PowerMode
from agent.tuning.nvpmodel_mode import COMPARE, PATH, reboot_reason
from agent.tuning.plan import Change, PlanContext

NOT_JETSON = "nvpmodel on an NVIDIA Jetson whose L4T has /etc/nvpmodel.conf"


def jetson_conf(ctx: PlanContext, section: str) -> NvpmodelConf | None:
    """The live conf, or None after ``ctx.lacking`` said why there is none."""
    if ctx.topology.board.family != "jetson":
        ctx.lacking(section, f"this device is a {ctx.topology.board.family} board, not an "
                    "NVIDIA Jetson", NOT_JETSON)
        return None
    conf = nvpmodel.load_conf(ctx.root)
    if conf is None or not conf.modes:
        ctx.lacking(section, f"{nvpmodel.CONF} does not exist or names no power mode (a "
                    "container, or L4T without nvpmodel)", NOT_JETSON)
    return conf if conf is not None and conf.modes else None


def planned_mode(ctx: PlanContext, conf: NvpmodelConf) -> PowerMode | None:
    """The mode in force once the changes planned so far are applied."""
    wanted = next((c.desired for c in ctx.changes if c.compare == COMPARE), None)
    mode_id = int(wanted) if wanted is not None else nvpmodel.active_mode_id(ctx.root, conf)
    return conf.modes.get(mode_id) if mode_id is not None else None


def report_caps(ctx: PlanContext, conf: NvpmodelConf) -> None:
    """``runtime.nvpmodel``: the mode after the plan and its EMC/DLA/PVA caps (Hz, null: no
    cap), in the plan like its resolved CPU sets."""
    mode = planned_mode(ctx, conf)
    if mode is not None:
        ctx.runtime["nvpmodel"] = {"mode": mode.id, "name": mode.name,
                                   "caps_hz": nvpmodel.engine_caps(mode)}


def _warn_online_cpus(ctx: PlanContext, wanted: PowerMode) -> None:
    """A mode onlines and offlines cores (CPU_ONLINE CORE_n); everything else in the plan
    is resolved against the CPUs online now (hardware-reference: re-read the topology after
    any mode change)."""
    cores = {int(arg.removeprefix("CORE_")) for (param, arg), v in wanted.values.items()
             if param == "CPU_ONLINE" and arg.startswith("CORE_") and v == 1}
    online = set(ctx.topology.cpu.online)
    if cores and cores != online:
        ctx.warnings.append(
            f"nvpmodel.mode: mode {wanted.id} ({wanted.name}) runs CPUs "
            f"{parsers.format_cpulist(sorted(cores))}, online now: "
            f"{parsers.format_cpulist(sorted(online))}; the per-CPU settings of this plan "
            "follow the CPUs online now: switch first ('sudo nvpmodel -m "
            f"{wanted.id}'), then plan the profile again")


def plan(section: dict[str, Any], ctx: PlanContext) -> None:
    conf = jetson_conf(ctx, "nvpmodel")
    if conf is None:
        return
    if "mode" in section:
        key = "nvpmodel.mode"
        wanted = conf.find(section["mode"])
        if wanted is None:
            raise ctx.error(key, f"{section['mode']!r} is not a power mode of {nvpmodel.CONF} "
                            f"on this device; allowed: {conf.allowed()}")
        active_id = nvpmodel.active_mode_id(ctx.root, conf)
        active = conf.modes.get(active_id) if active_id is not None else None
        reason = reboot_reason(conf, active, wanted) if active_id != wanted.id else None
        if reason is not None:
            raise ctx.error(key, reason)
        original = ctx.baseline.get(PATH)  # switching profiles: the mode before tuning
        current = original if original is not None else (
            str(active_id) if active_id is not None else None)
        if current is None:  # nothing to restore on rollback
            raise ctx.error(key, f"neither {nvpmodel.STATUS} nor a DEFAULT in "
                            f"{nvpmodel.CONF} says which mode is active; set one with "
                            "'sudo nvpmodel -m N' first")
        if active_id != wanted.id:
            _warn_online_cpus(ctx, wanted)
        if current != str(wanted.id) or active_id != wanted.id:
            ctx.changes.append(Change(
                tuner="nvpmodel", path=PATH, current=current, desired=str(wanted.id), key=key,
                compare=COMPARE, persistent=True,
                note=f"{wanted.name}: at once with 'nvpmodel -m {wanted.id}' and kept across "
                "reboots; later clock settings are planned against its caps"))
    report_caps(ctx, conf)
