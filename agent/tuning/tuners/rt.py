"""Real-time: RT throttling, IRQ affinity by action name, and the inference thread's policy.

The inference thread's policy is not a file: it is handed to the service (``runtime``),
which applies it to the loop's own thread through :mod:`agent.kernel.sched`.
"""

from __future__ import annotations

from typing import Any

from agent.kernel import sched as rt
from agent.tuning.plan import Change, PlanContext, read_normalised
from agent.tuning.values import resolve_cpus

SCHED_RT_RUNTIME = "/proc/sys/kernel/sched_rt_runtime_us"


def _policy_and_priority(ctx: PlanContext, key: str,
                         selector: dict[str, Any]) -> tuple[str, int]:
    policy, priority = selector.get("policy", "other"), selector.get("priority", 0)
    if (policy in ("fifo", "rr")) != (priority >= 1):
        raise ctx.error(f"{key}.priority", f"{priority} does not suit policy {policy}: fifo "
                        "and rr take 1..99, the others 0")
    return policy, priority


def _wanted_sched(ctx: PlanContext, key: str, selector: dict[str, Any]) -> rt.ThreadSched:
    policy, priority = _policy_and_priority(ctx, key, selector)
    try:
        cpus = resolve_cpus(selector.get("cpus", "all"), ctx.topology)
    except ValueError as error:
        raise ctx.error(f"{key}.cpus", str(error)) from None
    return rt.ThreadSched(policy, priority, cpus)


def _plan_threads(ctx: PlanContext, key: str, selector: dict[str, Any]) -> None:
    """Threads chosen by comm pattern and/or pid; only on the real root, whose pids are real."""
    if "comm" not in selector and "pid" not in selector:
        raise ctx.error(key, "name the threads with comm (a pattern), pid, or both")
    wanted = rt.format_sched(_wanted_sched(ctx, key, selector))
    if not ctx.root.is_host:
        ctx.warnings.append(f"{key}: thread scheduling applies on the real root only; skipped")
        return
    threads = rt.threads_matching(ctx.root, selector.get("comm", "*"), selector.get("pid"))
    if not threads:
        ctx.warnings.append(f"{key}: no thread matches; nothing to do")
    for pid, tid, comm in threads:
        path = rt.thread_path(pid, tid)
        current = read_normalised(ctx.root, path, "sched")
        if current is not None and current != wanted:
            ctx.changes.append(Change(tuner="sched", path=path, current=current, desired=wanted,
                                      key=key, compare="sched", note=comm))


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
    for index, selector in enumerate(section.get("threads", [])):
        _plan_threads(ctx, f"rt.threads[{index}]", selector)
    if "inference" in section:
        wanted = dict(section["inference"])
        _policy_and_priority(ctx, "rt.inference", wanted)
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
