"""Real-time: housekeeping CPUs, RT throttling, IRQ affinity by action name, and the inference
thread's policy.

The inference thread's policy is not a file: it is handed to the service (``runtime``),
which applies it to the inference threads through :mod:`agent.kernel.sched`.

Safety rules, each from the kernel's documentation:

- **A housekeeping CPU, always** (``rt.housekeeping_cpus``, default the lowest-capacity
  online cores that isolcpus left to the kernel, or the first of them where all cores are
  alike).  No SCHED_FIFO/RR thread of the profile runs there: per-CPU kernel work (kworkers,
  RCU callbacks, ksoftirqd, timers) runs at normal priority and is starved on a CPU an RT
  thread keeps busy (Documentation/scheduler/sched-rt-group.rst: throttling exists so that
  "a run-away realtime task will not lock up the machine").
- **Device IRQs go to the housekeeping CPUs** (``housekeeping`` as an ``irq_affinity``
  target), away from the RT inference CPUs (Documentation/core-api/irq/irq-affinity.rst).
- **``sched_rt_runtime_us: -1`` only with isolation and a reason**: -1 turns RT throttling
  off (sched-rt-group.rst, section 2.1); :mod:`agent.tuning.tuners.rt_throttle` says when.
"""

from __future__ import annotations

import fnmatch
from typing import Any

from agent.kernel import irqs
from agent.kernel import sched as rt
from agent.kernel.parsers import format_cpulist
from agent.tuning.plan import Change, PlanContext, read_normalised
from agent.tuning.tuners import rt_throttle as throttle
from agent.tuning.values import HOUSEKEEPING, default_housekeeping, resolve_cpus

REALTIME = ("fifo", "rr")


def _policy_and_priority(ctx: PlanContext, key: str,
                         selector: dict[str, Any]) -> tuple[str, int]:
    policy, priority = selector.get("policy", "other"), selector.get("priority", 0)
    if (policy in REALTIME) != (priority >= 1):
        raise ctx.error(f"{key}.priority", f"{priority} does not suit policy {policy}: fifo "
                        "and rr take 1..99, the others 0")
    return policy, priority


def _cpus(ctx: PlanContext, key: str, selector: str) -> list[int]:
    try:
        return resolve_cpus(selector, ctx.topology, ctx.cpus.get("housekeeping"))
    except ValueError as error:
        raise ctx.error(key, str(error)) from None


def _housekeeping(ctx: PlanContext, section: dict[str, Any]) -> list[int]:
    """The housekeeping CPUs: the profile's (online ones only), else the default."""
    online = set(ctx.topology.cpu.online)
    if "housekeeping_cpus" not in section:
        return default_housekeeping(ctx.topology)
    key = "rt.housekeeping_cpus"
    cpus = _cpus(ctx, key, section["housekeeping_cpus"])
    if not online & set(cpus):
        raise ctx.error(key, f"{format_cpulist(cpus)} holds no online CPU (online: "
                        f"{format_cpulist(sorted(online))})")
    isolated = sorted(set(cpus) & set(ctx.topology.cpu.isolated))
    if isolated:
        ctx.warnings.append(f"{key}: {format_cpulist(isolated)} is isolated (isolcpus): the "
                            "kernel keeps its housekeeping off it")
    return sorted(online & set(cpus))


def _rt_cpus(ctx: PlanContext, key: str, selector: str, policy: str) -> list[int]:
    """The CPUs of a thread the profile schedules; SCHED_FIFO/RR ones leave the housekeeping
    CPUs free (unless ``housekeeping`` is asked for by name: an IRQ thread beside its IRQ)."""
    cpus = _cpus(ctx, f"{key}.cpus", selector)
    if policy not in REALTIME or selector == HOUSEKEEPING:
        return _online(ctx, f"{key}.cpus", selector, cpus)
    housekeeping = ctx.cpus["housekeeping"]
    kept = [cpu for cpu in cpus if cpu not in housekeeping]
    if not set(kept) & set(ctx.topology.cpu.online):
        raise ctx.error(f"{key}.cpus", f"{selector} resolves to {format_cpulist(cpus)}, whose "
                        "online CPUs are all housekeeping CPUs "
                        f"({format_cpulist(housekeeping)}); a {policy} thread needs an online "
                        "CPU outside rt.housekeeping_cpus")
    if len(kept) < len(cpus):
        ctx.warnings.append(f"{key}.cpus: {selector} resolves to {format_cpulist(cpus)}; the "
                            f"{policy} threads run on {format_cpulist(kept)}, leaving the "
                            f"housekeeping CPUs {format_cpulist(housekeeping)} to the kernel")
    return _online(ctx, f"{key}.cpus", selector, kept)


def _online(ctx: PlanContext, key: str, selector: str, cpus: list[int]) -> list[int]:
    """The online CPUs of a thread's set (an nvpmodel mode or hot-plug took the others; the
    service plans again when a CPU comes or goes, see agent.service.hotplug); all of them
    when none is online, which the affinity call then refuses, naming them."""
    online = [cpu for cpu in cpus if cpu in ctx.topology.cpu.online]
    offline = sorted(set(cpus) - set(online))
    if offline and online:
        ctx.warnings.append(f"{key}: {selector} includes the offline CPUs "
                            f"{format_cpulist(offline)}; the threads run on "
                            f"{format_cpulist(online)} (planned again when CPUs come online)")
        return online
    return cpus


def _plan_threads(ctx: PlanContext, key: str, selector: dict[str, Any]) -> None:
    """Threads chosen by comm pattern and/or pid; only on the real root, whose pids are real."""
    if "comm" not in selector and "pid" not in selector:
        raise ctx.error(key, "name the threads with comm (a pattern), pid, or both")
    policy, priority = _policy_and_priority(ctx, key, selector)
    cpus = _rt_cpus(ctx, key, selector.get("cpus", "all"), policy)
    wanted = rt.format_sched(rt.ThreadSched(policy, priority, cpus))
    if not ctx.root.is_host:
        ctx.warnings.append(f"{key}: thread scheduling applies on the real root only; skipped")
        return
    threads = rt.threads_matching(ctx.root, selector.get("comm", "*"), selector.get("pid"))
    if not threads:
        ctx.warnings.append(f"{key}: no thread matches; nothing to do")
    if any(comm.startswith("iou-wrk-") for _pid, _tid, comm in threads):
        ctx.warnings.append(f"{key}: io-wq workers (iou-wrk-*) are made on demand and exit "
                            "when idle: a pin holds for the workers that exist now; "
                            "IORING_REGISTER_IOWQ_AFF sets the CPUs of every worker")
    for pid, tid, comm in threads:
        path = rt.thread_path(pid, tid)
        current = read_normalised(ctx.root, path, "sched")
        if current is not None and current != wanted:
            ctx.changes.append(Change(tuner="sched", path=path, current=current, desired=wanted,
                                      key=key, compare="sched", note=comm))


def _plan_inference(ctx: PlanContext, section: dict[str, Any]) -> None:
    wanted = dict(section["inference"])
    policy, _priority = _policy_and_priority(ctx, "rt.inference", wanted)
    if "cpus" in wanted or policy in REALTIME:  # an RT thread is never left on every CPU
        wanted["cpus"] = _rt_cpus(ctx, "rt.inference", wanted.get("cpus", "all"), policy)
        ctx.cpus["inference"] = wanted["cpus"]
    if ctx.topology.cpu.isolated and "cpus" in wanted:
        outside = sorted(set(wanted["cpus"]) - set(ctx.topology.cpu.isolated))
        if outside and set(wanted["cpus"]) & set(ctx.topology.cpu.isolated):
            ctx.warnings.append(f"rt.inference.cpus: mixes isolated and housekeeping CPUs "
                                f"(not isolated: {outside})")
    ctx.runtime["inference"] = wanted


def _plan_irqs(ctx: PlanContext, section: dict[str, Any]) -> None:
    """Each matching IRQ's smp_affinity_list; per-CPU IRQs and those of chained MSI chips are
    skipped (the kernel refuses to move them), managed ones are found when applying (see
    agent.kernel.irqs)."""
    targets: set[int] = set()
    rows = irqs.parse_rows(ctx.root.read_text("/proc/interrupts")) \
        if section.get("irq_affinity") else {}
    gic = irqs.has_gic(rows)
    for pattern, selector in section.get("irq_affinity", {}).items():
        key = f"rt.irq_affinity.{pattern}"
        cpus = _irq_cpus(ctx, section, key, selector)
        matched = sorted(irq for irq, row in rows.items()
                         if any(fnmatch.fnmatchcase(name, pattern) for name in row.actions))
        if not matched:
            ctx.warnings.append(f"{key}: no IRQ action matches; nothing to do")
        for irq in matched:
            refusal = irqs.chip_refusal(rows[irq], gic)
            reason = irqs.per_cpu_reason(rows[irq]) or (refusal[1] if refusal else None)
            if reason is not None:
                ctx.warnings.append(f"{key}: IRQ {irq} ({', '.join(rows[irq].actions)}) "
                                    f"skipped: {reason}")
                continue
            targets.update(cpus)
            ctx.want("rt", rt.irq_affinity_path(irq), ",".join(map(str, cpus)), key,
                     compare="cpulist")
    if targets:
        ctx.cpus["irqs"] = sorted(targets)


def _irq_cpus(ctx: PlanContext, section: dict[str, Any], key: str, selector: str) -> list[int]:
    """The CPUs of an IRQ setting, with a warning when they include RT inference CPUs."""
    cpus = _cpus(ctx, key, selector)
    rt_cpus = sorted(set(cpus) & set(ctx.cpus.get("inference", [])))
    if rt_cpus and section.get("inference", {}).get("policy") in REALTIME:
        ctx.warnings.append(f"{key}: {selector} puts device IRQs on the RT inference CPUs "
                            f"{format_cpulist(rt_cpus)}; housekeeping keeps them apart")
    return cpus


def _plan_default_irq_affinity(ctx: PlanContext, section: dict[str, Any]) -> None:
    """/proc/irq/default_smp_affinity, a hex mask: the CPUs of IRQs set up from now on
    (Documentation/core-api/irq/irq-affinity.rst); IRQs that exist keep theirs.  The kernel
    refuses a mask with no online CPU (EINVAL), so the plan does first."""
    key = "rt.default_irq_affinity"
    cpus = _irq_cpus(ctx, section, key, section["default_irq_affinity"])
    online = sorted(set(cpus) & set(ctx.topology.cpu.online))
    if not online:
        raise ctx.error(key, f"{format_cpulist(cpus)} holds no online CPU (online: "
                        f"{format_cpulist(ctx.topology.cpu.online)}); the kernel refuses a "
                        "default IRQ mask without one")
    try:  # rollback writes the mask back as it was (a switch keeps the first original)
        original = ctx.root.read_text(irqs.DEFAULT_AFFINITY).strip()
    except FileNotFoundError:
        original = ""  # want() reports the missing file
    ctx.want("rt", irqs.DEFAULT_AFFINITY, format_cpulist(cpus), key, compare="cpumask",
             write=irqs.format_mask(cpus), restore=original,
             note="IRQs set up from now on; existing IRQs keep their affinity")


def with_kernel_args(settings: dict[str, Any]) -> dict[str, Any]:
    """A profile that sets the default IRQ mask and manages kernel arguments (``cmdline``)
    plans ``irqaffinity=`` with the same CPUs too: the mask holds for IRQs set up after the
    apply, the argument for those set up during boot (kernel-parameters.txt)."""
    wanted = settings.get("rt", {}).get("default_irq_affinity")
    if wanted is None or "cmdline" not in settings or "irqaffinity" in settings["cmdline"]:
        return settings
    return {**settings, "cmdline": {**settings["cmdline"], "irqaffinity": wanted}}


def plan(section: dict[str, Any], ctx: PlanContext) -> None:
    warning = rt.rt_kernel_warning(ctx.topology.kernel.preempt_rt)
    if warning:
        ctx.warnings.append(f"rt: {warning}")
    ctx.cpus["housekeeping"] = _housekeeping(ctx, section)
    if "inference" in section:
        _plan_inference(ctx, section)
    for index, selector in enumerate(section.get("threads", [])):
        _plan_threads(ctx, f"rt.threads[{index}]", selector)
    if "workqueue_cpus" in section:
        throttle.plan_workqueue(ctx, section, _cpus(ctx, "rt.workqueue_cpus",
                                                    section["workqueue_cpus"]))
    if "kthreads" in section:
        throttle.plan_kthreads(ctx, _cpus(ctx, "rt.kthreads", section["kthreads"]))
    if "sched_rt_runtime_us" in section:
        throttle.plan_runtime(ctx, section)
    _plan_irqs(ctx, section)
    if "default_irq_affinity" in section:
        _plan_default_irq_affinity(ctx, section)
    throttle.warn_irq_threads(ctx, section)
