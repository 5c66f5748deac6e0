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

Without the resume latency file (``CONFIG_PM`` off, or an older kernel) the bound falls back
to disabling the deeper states on the same CPUs (``stateK/disable``), and where cpuidle has no
such file either, to the service's /dev/cpu_dma_latency hold (see ``_without_pm_qos``).
"""

from __future__ import annotations

from typing import Any

from agent.discovery.model import IdleState
from agent.kernel import pm_qos
from agent.kernel.parsers import format_cpulist
from agent.tuning.plan import PlanContext

CPU = "/sys/devices/system/cpu"
RESUME_LATENCY = "power/pm_qos_resume_latency_us"
POLL = "POLL"  # the x86 polling state's name (drivers/cpuidle/poll_state.c)


def latency_floor(states: list[IdleState]) -> tuple[int, str] | None:
    """The lowest bound worth writing for these states, and the state it keeps."""
    known = [s for s in states if s.latency_us is not None]
    if not known:
        return None
    if known[0].name == POLL and len(known) > 1:
        return known[1].latency_us or 0, f"{known[1].name} (x86: below it only POLL is left, "\
            "idle=poll behaviour; TuneD keeps C1)"
    return known[0].latency_us or 0, f"{known[0].name}, state 0, which is always available"


def _clamped(ctx: PlanContext, key: str, bound: int, states: list[IdleState]) -> int:
    floor = latency_floor(states)
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
    without: list[tuple[int, int, list[IdleState]]] = []  # no PM QoS file: cpu, bound, states
    for cluster in ctx.topology.cpu.clusters:
        mine = [cpu for cpu in cluster.online_cpus if cpu in cpus]
        if not mine:
            continue
        value = _clamped(ctx, key, bound, cluster.idle_states)
        deeper = [s for s in cluster.idle_states
                  if s.latency_us is not None and s.latency_us > value]
        if not deeper:  # no state of this cluster is deeper: nothing to ask for
            continue
        for cpu in mine:
            path = f"{CPU}/cpu{cpu}/{RESUME_LATENCY}"
            if not ctx.root.exists(path):
                without.append((cpu, value, deeper))
                continue
            ctx.want("cpuidle", path, pm_qos.resume_latency_value(value), key,
                     note=f"{', '.join(s.name for s in deeper)} avoided (exit latency > "
                     f"{value} us) on {where}")
    if without:
        _without_pm_qos(ctx, key, without)


def _without_pm_qos(ctx: PlanContext, key: str,
                    without: list[tuple[int, int, list[IdleState]]]) -> None:
    """No resume latency file (a kernel without CONFIG_PM, or before it existed): the deeper
    states are disabled on those CPUs instead (``stateK/disable``, per CPU, restored by
    rollback); where cpuidle has no such file either, the service holds
    /dev/cpu_dma_latency at the bound (system-wide).  docs/kernel-facts/refusals.md"""
    held: list[int] = []
    for cpu, value, deeper in without:
        paths = [(s, f"{CPU}/cpu{cpu}/cpuidle/{s.state}/disable") for s in deeper if s.state]
        if not paths or not all(ctx.root.exists(p) for _, p in paths):
            held.append(cpu)
            continue
        for state, path in paths:
            ctx.want("cpuidle", path, "1", key, note=f"{state.name} disabled on cpu{cpu} "
                     f"(exit latency {state.latency_us} us > {value} us): no {RESUME_LATENCY}")
    cpus = format_cpulist(sorted(cpu for cpu, _, _ in without))
    if len(held) < len(without):
        ctx.warnings.append(f"{key}: CPUs {cpus} have no {RESUME_LATENCY} (a kernel without "
                            "CONFIG_PM): their deeper idle states are disabled instead "
                            "(cpuidle stateK/disable, restored by rollback)")
    if not held:
        return
    value = min(v for cpu, v, _ in without if cpu in held)
    if not ctx.root.exists(pm_qos.DMA_LATENCY):
        ctx.lacking(key, f"CPUs {format_cpulist(held)} have neither {RESUME_LATENCY} nor "
                    f"cpuidle stateK/disable, and {pm_qos.DMA_LATENCY} does not exist",
                    "a kernel with CONFIG_PM or CONFIG_CPU_IDLE")
        return
    ctx.runtime["dma_latency_us"] = min(value, ctx.runtime.get("dma_latency_us", value))
    ctx.warnings.append(f"{key}: CPUs {format_cpulist(held)} have neither {RESUME_LATENCY} "
                        f"nor cpuidle stateK/disable: the service holds {pm_qos.DMA_LATENCY} "
                        f"at {value} us instead (system-wide: every CPU keeps out of the "
                        "deeper states while it runs; the CLI's profile apply does not hold it)")


def _plan_dma_latency(ctx: PlanContext, bound: int) -> None:
    key = "cpuidle.dma_latency_us"
    if not ctx.root.exists(pm_qos.DMA_LATENCY):
        ctx.warnings.append(f"{key}: skipped: {pm_qos.DMA_LATENCY} does not exist (a kernel "
                            "without CONFIG_CPU_IDLE); nothing holds the CPU latency")
        return
    states = ctx.topology.cpu.idle_states
    value = _clamped(ctx, key, bound, states)
    ctx.runtime["dma_latency_us"] = min(value, ctx.runtime.get("dma_latency_us", value))
    ctx.warnings.append(f"{key}: {value} us system-wide: the service (edge-agent run) holds "
                        f"{pm_qos.DMA_LATENCY} while this profile is applied; the CLI's "
                        "profile apply does not (the kernel drops the hold when it exits)")


def plan(section: dict[str, Any], ctx: PlanContext) -> None:
    if section.get("disable_deeper_than_us") is not None:
        _plan_resume_latency(ctx, section["disable_deeper_than_us"])
    if section.get("dma_latency_us") is not None:
        _plan_dma_latency(ctx, section["dma_latency_us"])
