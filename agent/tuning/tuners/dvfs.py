"""DVFS: cpufreq governor/min/max per cluster, devfreq for GPU, NPU and memory controller.

Limits are ordered so min <= max holds after every single write (raise max first when the
new min is above the current max), and rollback in reverse order keeps it too.
"""

from __future__ import annotations

from typing import Any

from agent.discovery.model import Cluster
from agent.kernel.reader import SysReader
from agent.tuning import nvpmodel
from agent.tuning.plan import PlanContext
from agent.tuning.tuners import pstate
from agent.tuning.values import resolve_cpus, resolve_frequency

POLICIES = "/sys/devices/system/cpu/cpufreq"
DEVFREQ = "/sys/class/devfreq"


def _limits(ctx: PlanContext, key: str, directory: str, names: tuple[str, str],
            wanted: dict[str, Any], offered: tuple[list[int] | None, int | None, int | None],
            unit: str, tuner: str) -> None:
    """Plan min/max writes in an order that never crosses the current limits.

    A min above the current max that the profile does not raise too (an nvpmodel or thermal
    cap, a site limit) is clamped to that max with a warning, never written as min > max:
    cpufreq's store_scaling_min_freq and devfreq's min_freq_store only file a QoS request,
    which newer kernels silently resolve in favour of max and older ones refuse (EINVAL).
    """
    resolved = {}
    for field, name in zip((f"min_{unit}", f"max_{unit}"), names, strict=True):
        if field in wanted:
            try:
                resolved[name] = resolve_frequency(wanted[field], *offered, unit=unit)
            except ValueError as error:
                raise ctx.error(f"{key}.{field}", f"{error} ({directory})") from None
    low, high = (resolved.get(n) for n in names)
    if low is not None and high is not None and low > high:
        raise ctx.error(key, f"min {low} is above max {high}")
    current_max = int(ctx.current(f"{directory}/{names[1]}", key))
    if low is not None and high is None and low > current_max:
        ctx.warnings.append(f"{key}.min_{unit}: {low} is above the current max {current_max} "
                            f"of {directory} (a power-mode, thermal or site cap); clamped to "
                            f"{current_max}: raise max_{unit} as well for more")
        resolved[names[0]] = low = current_max
    order = list(names) if low is None or low <= current_max else list(reversed(names))
    for name in order:
        if name in resolved:
            ctx.want(tuner, f"{directory}/{name}", str(resolved[name]), key,
                     restore=_floor_restore(ctx, key, directory, names, name, offered))


def _floor_restore(ctx: PlanContext, key: str, directory: str, names: tuple[str, str],
                   name: str, offered: tuple[list[int] | None, int | None, int | None]
                   ) -> str | None:
    """A min at the hardware's lowest frequency is no floor at all: rollback writes 0,
    which puts the user's frequency QoS request back to its default, instead of filing the
    old floor as a request (docs/kernel-facts/ineffective.md, "Frequency floors")."""
    available, hardware_min, _max = offered
    lowest = min(available) if available else hardware_min if name == "scaling_min_freq" \
        else None
    if name != names[0] or lowest is None:
        return None
    return "0" if int(ctx.current(f"{directory}/{name}", key)) <= lowest else None


def pick_governor(ctx: PlanContext, key: str, directory: str, wanted: str,
                  available: list[str] | None) -> str:
    """The first of ``a|b|c`` the node offers (the first one when it lists none)."""
    options = wanted.split("|")
    chosen = next((g for g in options if available is None or g in available), None)
    if chosen is None:
        offered = ", ".join(available or [])
        asked = f"{options[0]!r} is not" if len(options) == 1 else \
            f"none of {', '.join(options)} is"
        raise ctx.error(f"{key}.governor", f"{asked} available in {directory} "
                        f"(available: {offered})")
    return chosen


def _governor(ctx: PlanContext, key: str, directory: str, governor: str,
              available: list[str] | None, tuner: str) -> None:
    chosen = pick_governor(ctx, key, directory, governor, available)
    ctx.want(tuner, f"{directory}/{'scaling_governor' if tuner == 'cpufreq' else 'governor'}",
             chosen, key)


def _policies_for(ctx: PlanContext, selector: str, key: str) -> list[Cluster]:
    try:
        cpus = set(resolve_cpus(selector, ctx.topology))
    except ValueError as error:
        raise ctx.error(key, str(error)) from None
    chosen = [c for c in ctx.topology.cpu.clusters if c.policy and cpus & set(c.cpus)]
    for cluster in chosen:
        if not set(cluster.cpus) <= cpus:
            ctx.warnings.append(f"{key}: {cluster.policy} also governs CPUs outside {selector} "
                                f"({cluster.cpus}); cpufreq limits are per policy")
    if not chosen:
        raise ctx.error(key, f"{selector} has no cpufreq policy on this device")
    return chosen


def _cpu(ctx: PlanContext, section: dict[str, Any]) -> None:
    if not any(c.policy for c in ctx.topology.cpu.clusters):
        ctx.warnings.append("dvfs.cpu: this device exposes no cpufreq (a VM, or no driver); "
                            "CPU frequency settings skipped")
        return
    for selector, wanted in section.items():
        key = f"dvfs.cpu.{selector}"
        for cluster in _policies_for(ctx, selector, key):
            if not cluster.online_cpus:
                ctx.warnings.append(f"{key}: {cluster.policy} skipped, its CPUs are offline")
                continue
            directory = f"{POLICIES}/{cluster.policy}"
            governor = pick_governor(ctx, key, directory, wanted["governor"],
                                     cluster.available_governors) if "governor" in wanted \
                else None
            pstate.plan_policy(ctx, key, directory, governor, wanted.get("epp"))
            _limits(ctx, key, directory, ("scaling_min_freq", "scaling_max_freq"), wanted,
                    (cluster.available_khz, cluster.min_khz, cluster.max_khz), "khz", "cpufreq")


def _devfreq_nodes(ctx: PlanContext, kind: str) -> list[str]:
    if kind == "gpu":
        return [g.devfreq for g in ctx.topology.gpus if g.devfreq]
    if kind == "npu":
        return [n.devfreq for n in ctx.topology.npus if n.devfreq]
    reader = SysReader(ctx.root)
    return [n for n in reader.listdir(DEVFREQ)
            if reader.of_node_name(f"{DEVFREQ}/{n}/device") == "dmc"]


def _devfreq(ctx: PlanContext, kind: str, wanted: dict[str, Any]) -> None:
    key = f"dvfs.{kind}"
    nodes = _devfreq_nodes(ctx, kind)
    if not nodes:  # e.g. mainline RK3588 kernels have no NPU OPP table and no DMC devfreq
        ctx.lacking(key, f"this device has no {kind} devfreq node", "a device whose kernel "
                    f"registers a {kind} devfreq node (rk3588: the vendor BSP kernel)")
        return
    reader = SysReader(ctx.root)
    for node in nodes:
        directory = f"{DEVFREQ}/{node}"
        if "governor" in wanted:
            _governor(ctx, key, directory, wanted["governor"],
                      reader.words(f"{directory}/available_governors"), "devfreq")
        # Without a frequency table the current limits are the only known range.
        offered = (reader.integers(f"{directory}/available_frequencies") or None,
                   reader.integer(f"{directory}/min_freq"),
                   reader.integer(f"{directory}/max_freq"))
        _limits(ctx, key, directory, ("min_freq", "max_freq"), wanted, offered, "hz", "devfreq")


def _warn_beyond_nvpmodel(ctx: PlanContext, first_change: int) -> None:
    """On Jetson the power mode stays the base policy: say when a limit exceeds its cap.
    A profile that switches the mode (``nvpmodel.mode``, planned first) is held to the
    wanted mode's caps: ``nvpmodel -m`` rewrites the limits to them."""
    wanted = next((c.desired for c in ctx.changes if c.compare == "nvpmodel"), None)
    mode = nvpmodel.active_caps(ctx.root, int(wanted) if wanted is not None else None)
    if mode is None:
        return
    name, caps = mode
    for change in ctx.changes[first_change:]:
        if not change.path.endswith(("min_freq", "max_freq")):
            continue  # governors have no cap
        limit_file = change.path.replace("min_freq", "max_freq")
        cap = caps.get(ctx.root.realpath(limit_file))
        if cap is not None and int(change.desired) > cap:
            ctx.warnings.append(f"{change.key}: {change.path} = {change.desired} is above the "
                                f"cap {cap} of nvpmodel mode {name}; nvpmodel rewrites limits "
                                "at boot and on 'nvpmodel -m', change the mode for more")


def plan(section: dict[str, Any], ctx: PlanContext) -> None:
    first_change = len(ctx.changes)
    if "cpu" in section:
        _cpu(ctx, section["cpu"])
    pstate.plan_global(ctx, section)
    for kind in ("gpu", "npu", "dmc"):
        if kind in section:
            _devfreq(ctx, kind, section[kind])
    if ctx.topology.board.family == "jetson":
        _warn_beyond_nvpmodel(ctx, first_change)
