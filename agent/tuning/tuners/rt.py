"""Real-time: RT throttling, IRQ affinity by action name, and the inference thread's policy.

The inference thread's policy is not a file: it is handed to the service (``runtime``),
which applies it to the loop's own thread through :mod:`agent.tuning.rt`.
"""

from __future__ import annotations

from typing import Any

from agent.tuning import rt
from agent.tuning.plan import PlanContext
from agent.tuning.values import resolve_cpus

SCHED_RT_RUNTIME = "/proc/sys/kernel/sched_rt_runtime_us"


def plan(section: dict[str, Any], ctx: PlanContext) -> None:
    warning = rt.rt_kernel_warning(ctx.topology.kernel.preempt_rt)
    if warning:
        ctx.warnings.append(f"rt: {warning}")
    if "sched_rt_runtime_us" in section:
        ctx.want("rt", SCHED_RT_RUNTIME, str(section["sched_rt_runtime_us"]),
                 "rt.sched_rt_runtime_us")
    for pattern, selector in section.get("irq_affinity", {}).items():
        key = f"rt.irq_affinity.{pattern}"
        try:
            cpus = resolve_cpus(selector, ctx.topology)
        except ValueError as error:
            raise ctx.error(key, str(error)) from None
        irqs = rt.irqs_matching(ctx.root, pattern)
        if not irqs:
            ctx.warnings.append(f"{key}: no IRQ action matches; nothing to do")
        for irq in irqs:
            ctx.want("rt", rt.irq_affinity_path(irq), ",".join(map(str, cpus)), key,
                     compare="cpulist")
    if "inference" in section:
        wanted = dict(section["inference"])
        policy, priority = wanted.get("policy", "other"), wanted.get("priority", 0)
        if (policy in ("fifo", "rr")) != (priority >= 1):
            raise ctx.error("rt.inference.priority", f"{priority} does not suit policy "
                            f"{policy}: fifo and rr take 1..99, the others 0")
        if "cpus" in wanted:
            try:
                wanted["cpus"] = resolve_cpus(wanted["cpus"], ctx.topology)
            except ValueError as error:
                raise ctx.error("rt.inference.cpus", str(error)) from None
        if ctx.topology.cpu.isolated and "cpus" in wanted:
            outside = sorted(set(wanted["cpus"]) - set(ctx.topology.cpu.isolated))
            if outside and set(wanted["cpus"]) & set(ctx.topology.cpu.isolated):
                ctx.warnings.append(f"rt.inference.cpus: mixes isolated and housekeeping CPUs "
                                    f"(not isolated: {outside})")
        ctx.runtime["inference"] = wanted
