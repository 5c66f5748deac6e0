"""cpuidle: latency bounds the kernel's idle governors honour, instead of disabled states.

``disable_deeper_than_us: N`` keeps the inference cores out of every idle state whose exit
latency is above N us.  It writes the per-CPU PM QoS resume latency,
``/sys/devices/system/cpu/cpuK/power/pm_qos_resume_latency_us``
(Documentation/ABI/testing/sysfs-devices-power), of the inference cores
(``rt.inference.cpus`` when the rt tuner resolved them, else every online CPU).  The menu,
teo and ladder governors take the lower of it and the system-wide CPU latency QoS target
through ``cpuidle_governor_latency_req()`` and select no state whose exit latency exceeds it
(menu_select: ``if (s->exit_latency_ns > latency_req) break``), so a state whose latency is
exactly N is still used.  Unlike ``stateK/disable`` writes on every CPU, the other cores keep
their deep states, and the value is one number per core that rollback restores.

The file's encoding (drivers/base/power/sysfs.c): it reads "0" while nothing is asked ("no
constraint"); writing 0 means "no constraint" too, so a bound of 0 us is written as "n/a"
(no latency tolerated); negatives are EINVAL.

Two bounds are never written (Documentation/admin-guide/pm/cpuidle.rst):

- one below state 0's exit latency: WFI (arm64) or POLL (x86) is always available, so it
  has no effect beyond state 0's own latency; it is raised to that with a warning;
- on x86, one below C1's exit latency: only the POLL loop would be left (``idle=poll``
  behaviour: the core spins and never idles); it is raised to C1's latency with a warning,
  as TuneD's latency profiles keep C1 (``cstate.id_no_zero:1``).

``dma_latency_us: N`` asks for a system-wide bound instead: the service holds
``/dev/cpu_dma_latency`` open with N written (Documentation/power/pm_qos_interface.rst)
while the profile is applied; the kernel drops the request when the file is closed, even
when the agent crashes, so it is not journaled.  The same floors apply.
"""

from __future__ import annotations

from typing import Any

from agent.discovery.model import IdleState
from agent.kernel import pm_qos
from agent.kernel.parsers import format_cpulist
from agent.tuning.plan import PlanContext

CPU = "/sys/devices/system/cpu"
POLL = "POLL"  # the x86 polling state's name (drivers/cpuidle/poll_state.c)


def _floor(states: list[IdleState]) -> tuple[int, str] | None:
    """The lowest bound worth writing for these states, and the state it keeps."""
    known = [s for s in states if s.latency_us is not None]
    if not known:
        return None
    if known[0].name == POLL and len(known) > 1:
        return known[1].latency_us or 0, f"{known[1].name} (x86: below it only POLL is left, "\
            "idle=poll behaviour; TuneD keeps C1)"
    return known[0].latency_us or 0, f"{known[0].name}, state 0, which is always available"


def _clamped(ctx: PlanContext, key: str, bound: int, states: list[IdleState]) -> int:
    floor = _floor(states)
    if floor is None or bound >= floor[0]:
        return bound
    warning = f"{key}: {bound} us raised to {floor[0]} us, the exit latency of {floor[1]}"
    if warning not in ctx.warnings:  # once, not once per cluster
        ctx.warnings.append(warning)
    return floor[0]


def _plan_resume_latency(ctx: PlanContext, bound: int) -> None:
    key = "cpuidle.disable_deeper_than_us"
    online = set(ctx.topology.cpu.online)
    inference = sorted(set(ctx.cpus.get("inference", [])) & online)
    cpus = inference or sorted(online)
    where = (f"the inference cores {format_cpulist(cpus)} (rt.inference.cpus)" if inference
             else f"every online CPU, {format_cpulist(cpus)} (no rt.inference.cpus)")
    for cluster in ctx.topology.cpu.clusters:
        mine = [cpu for cpu in cluster.online_cpus if cpu in cpus]
        if not mine:
            continue
        value = _clamped(ctx, key, bound, cluster.idle_states)
        avoided = [s.name for s in cluster.idle_states
                   if s.latency_us is not None and s.latency_us > value]
        if not avoided:  # no state of this cluster is deeper: nothing to ask for
            continue
        for cpu in mine:
            ctx.want("cpuidle", f"{CPU}/cpu{cpu}/power/pm_qos_resume_latency_us",
                     pm_qos.resume_latency_value(value), key,
                     note=f"{', '.join(avoided)} avoided (exit latency > {value} us) on "
                     f"{where}")


def _plan_dma_latency(ctx: PlanContext, bound: int) -> None:
    key = "cpuidle.dma_latency_us"
    if not ctx.root.exists(pm_qos.DMA_LATENCY):
        ctx.warnings.append(f"{key}: skipped: {pm_qos.DMA_LATENCY} does not exist (a kernel "
                            "without CONFIG_CPU_IDLE); nothing holds the CPU latency")
        return
    states = ctx.topology.cpu.idle_states
    value = _clamped(ctx, key, bound, states)
    ctx.runtime["dma_latency_us"] = value
    ctx.warnings.append(f"{key}: {value} us system-wide: the service (edge-agent run) holds "
                        f"{pm_qos.DMA_LATENCY} while this profile is applied; the CLI's "
                        "profile apply does not (the kernel drops the hold when it exits)")


def plan(section: dict[str, Any], ctx: PlanContext) -> None:
    if section.get("disable_deeper_than_us") is not None:
        _plan_resume_latency(ctx, section["disable_deeper_than_us"])
    if section.get("dma_latency_us") is not None:
        _plan_dma_latency(ctx, section["dma_latency_us"])
