"""RT throttling and what has to hold before a profile may turn it off; the kernel threads an
RT inference thread can starve.  Each fact with its source: docs/kernel-facts/rt-throttling.md.

- **Throttling stays on** (``sched_rt_runtime_us`` below 100 %) unless the inference CPUs are
  isolated (``isolcpus``, ``nohz_full`` or an isolated cpuset partition, as the kernel reports
  them: /sys/devices/system/cpu/{isolated,nohz_full}, /sys/fs/cgroup/cpuset.cpus.isolated),
  unbound work is on the housekeeping CPUs (the workqueue cpumask, and kthreadd, whose
  affinity every new kthread inherits), and the profile says why (``rt.unthrottled_reason``).
  Bound per-CPU kthreads (kworker/N, ksoftirqd/N, on PREEMPT_RT ktimers/N and rcuc/N) cannot
  leave an inference CPU; a CPU-bound RT thread there starves them.
- **6.12+ (the fair server)**: RT bandwidth control is gone without RT_GROUP_SCHED; a
  per-CPU deadline server (debugfs sched/fair_server/cpuN/runtime, 50 ms each second) runs
  SCHED_OTHER work instead, and ``sched_rt_runtime_us`` only bounds SCHED_DEADLINE admission
  (-1: none).  Writing -1 there turns nothing off, so it is skipped; a fair server at 0 is
  what would, and is warned about.
- **PREEMPT_RT IRQ threads** run SCHED_FIFO 50; an inference thread above them delays the
  completion interrupts of the devices it waits on wherever they share a CPU.
- **stalld** (a daemon that boosts starved threads) is named when it is there.
"""

from __future__ import annotations

import re
from typing import Any

from agent.kernel import irqs, sched
from agent.kernel.fsroot import Root
from agent.kernel.parsers import format_cpulist, parse_cpulist
from agent.kernel.reader import SysReader
from agent.tuning.plan import Change, PlanContext, read_normalised

SCHED_RT_RUNTIME = "/proc/sys/kernel/sched_rt_runtime_us"
WORKQUEUE_CPUMASK = irqs.WORKQUEUE_CPUMASK
FAIR_SERVER = "/sys/kernel/debug/sched/fair_server"
KTHREADD = "/proc/2/status"
PF_KTHREAD, PF_NO_SETAFFINITY = 0x00200000, 0x04000000  # include/linux/sched.h
ISOLATION = (("isolcpus", "/sys/devices/system/cpu/isolated"),
             ("nohz_full", "/sys/devices/system/cpu/nohz_full"),
             ("cpuset partition", "/sys/fs/cgroup/cpuset.cpus.isolated"))
STALLD_UNITS = ("/etc/systemd/system/stalld.service", "/lib/systemd/system/stalld.service",
                "/usr/lib/systemd/system/stalld.service")
IRQ_THREAD_PRIORITY = 50  # kernel/irq/manage.c setup_irq_thread: sched_set_fifo(), MAX_RT_PRIO/2
FAIR_SERVER_RELEASE = (6, 12)
UNTHROTTLED = (-1, 1_000_000)  # no throttling, and a runtime of the whole period


def release(ctx: PlanContext) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", ctx.topology.kernel.release or "")
    return (int(match[1]), int(match[2])) if match else None


def has_fair_server(ctx: PlanContext) -> bool:
    version = release(ctx)
    return ctx.root.is_dir(FAIR_SERVER) or (version is not None
                                            and version >= FAIR_SERVER_RELEASE)


def isolated(ctx: PlanContext) -> dict[int, str]:
    """CPU -> how the kernel isolates it (as it reports it, not as the command line asks)."""
    reader = SysReader(ctx.root)
    found: dict[int, str] = {}
    for how, path in ISOLATION:
        for cpu in reader.cpulist(path) or []:
            found.setdefault(cpu, how)
    return found


def _cpus_allowed(ctx: PlanContext, status: str) -> list[int] | None:
    """A task's Cpus_allowed_list from /proc/PID/status; None when unreadable."""
    text = SysReader(ctx.root).text(status) or ""
    match = re.search(r"^Cpus_allowed_list:\s*(\S+)", text, re.MULTILINE)
    try:
        return parse_cpulist(match[1]) if match else None
    except ValueError:
        return None


def _workqueue_cpus(ctx: PlanContext) -> list[int] | None:
    """The unbound workqueues' CPUs as planned, else as the file holds them."""
    if "workqueue" in ctx.cpus:
        return ctx.cpus["workqueue"]
    try:
        return irqs.parse_mask(ctx.root.read_text(WORKQUEUE_CPUMASK))
    except (OSError, ValueError):
        return None


def plan_workqueue(ctx: PlanContext, section: dict[str, Any], cpus: list[int]) -> None:
    """``rt.workqueue_cpus``: the unbound workqueues' cpumask (a hex mask; the kernel refuses
    one without an online CPU); a kernel without the file is skipped with a warning."""
    key = "rt.workqueue_cpus"
    online = sorted(set(cpus) & set(ctx.topology.cpu.online))
    if not online:
        raise ctx.error(key, f"{format_cpulist(cpus)} holds no online CPU (online: "
                        f"{format_cpulist(ctx.topology.cpu.online)})")
    if not ctx.root.exists(WORKQUEUE_CPUMASK):
        ctx.warnings.append(f"{key}: skipped: {WORKQUEUE_CPUMASK} does not exist here")
        return
    original = ctx.root.read_text(WORKQUEUE_CPUMASK).strip()
    ctx.want("rt", WORKQUEUE_CPUMASK, format_cpulist(online), key, compare="cpumask",
             write=irqs.format_mask(online), restore=original,
             note="unbound workqueues; per-CPU (bound) kworkers stay where they are")
    ctx.cpus["workqueue"] = online


def movable_kthreads(root: Root) -> list[tuple[int, str]]:
    """(pid, comm) of the kernel threads user space may move: PF_KTHREAD without
    PF_NO_SETAFFINITY in /proc/PID/stat's flags (include/linux/sched.h).  Bound per-CPU
    kthreads and the workqueues' kworkers carry PF_NO_SETAFFINITY (the workqueue cpumask
    places the unbound ones); IRQ threads follow their IRQ's affinity (kernel/irq/manage.c
    irq_thread_check_affinity), so they are left to rt.irq_affinity."""
    found = []
    for pid in _pids(root):
        try:
            stat = root.read_text(f"/proc/{pid}/stat")
        except OSError:
            continue  # it ended meanwhile
        comm, _, rest = stat.partition("(")[2].rpartition(")")
        fields = rest.split()
        if len(fields) > 6 and fields[6].isdigit():
            flags = int(fields[6])
            if flags & PF_KTHREAD and not flags & PF_NO_SETAFFINITY \
                    and not comm.startswith("irq/"):
                found.append((int(pid), comm))
    return sorted(found)


def plan_kthreads(ctx: PlanContext, cpus: list[int]) -> None:
    """``rt.kthreads``: kthreadd (whose affinity new kthreads inherit) and the unbound kernel
    threads onto ``cpus``, each keeping its policy and priority; the real root only."""
    key = "rt.kthreads"
    if not ctx.root.is_host:
        ctx.warnings.append(f"{key}: kernel threads are moved on the real root only; skipped")
        return
    for pid, comm in movable_kthreads(ctx.root):
        path = sched.thread_path(pid, pid)
        try:
            current = read_normalised(ctx.root, path, "sched")
        except (OSError, ValueError) as error:  # SCHED_DEADLINE, or gone in between
            ctx.warnings.append(f"{key}: {comm} (pid {pid}) left alone: {error}")
            continue
        if current is None:
            continue
        had = sched.parse_sched(current)
        wanted = sched.format_sched(sched.ThreadSched(had.policy, had.priority, cpus))
        if current != wanted:
            ctx.changes.append(Change(tuner="sched", path=path, current=current,
                                      desired=wanted, key=key, compare="sched", note=comm))
    ctx.cpus["kthreads"] = cpus


def _missing(ctx: PlanContext, section: dict[str, Any], rt_cpus: list[int]) -> list[str]:
    """What keeps throttling on: each condition that does not hold, said as the fix."""
    missing = []
    isolation = isolated(ctx)
    loose = [cpu for cpu in rt_cpus if cpu not in isolation]
    if loose:
        missing.append(f"the inference CPUs {format_cpulist(loose)} are not isolated (none of "
                       "isolcpus=, nohz_full= with rcu_nocbs=, or a cpuset partition "
                       "'isolated' covers them as the kernel reports)")
    housekeeping = set(ctx.cpus.get("housekeeping", []))
    workqueue = _workqueue_cpus(ctx)
    if workqueue is None or not set(workqueue) <= housekeeping:
        missing.append(f"unbound workqueues run on "
                       f"{format_cpulist(workqueue) if workqueue else 'unknown CPUs'} "
                       "(set rt.workqueue_cpus: housekeeping)")
    kthreadd = ctx.cpus.get("kthreads") or _cpus_allowed(ctx, KTHREADD)
    if kthreadd is None or not set(kthreadd) <= housekeeping:
        missing.append("unbound kthreads (kthreadd, pid 2, and what it starts) run on "
                       f"{format_cpulist(kthreadd) if kthreadd else 'unknown CPUs'}, not "
                       "only the housekeeping CPUs (set rt.kthreads: housekeeping)")
    if not section.get("unthrottled_reason"):
        missing.append("the profile gives no rt.unthrottled_reason")
    return missing


def plan_runtime(ctx: PlanContext, section: dict[str, Any]) -> None:
    """``rt.sched_rt_runtime_us``: a runtime below the period is planned as asked; -1 or the
    whole period only when every condition holds, else skipped naming what is missing."""
    key, value = "rt.sched_rt_runtime_us", section["sched_rt_runtime_us"]
    if value not in UNTHROTTLED:
        ctx.want("rt", SCHED_RT_RUNTIME, str(value), key)
        return
    rt_cpus = ctx.cpus.get("inference") or sorted(
        set(ctx.topology.cpu.online) - set(ctx.cpus.get("housekeeping", [])))
    if has_fair_server(ctx):
        ctx.warnings.append(
            f"{key}: skipped: on {ctx.topology.kernel.release} (6.12+) RT throttling is the "
            "fair server (a deadline server per CPU, debugfs sched/fair_server/cpuN/runtime), "
            f"and {value} would only lift SCHED_DEADLINE admission control; SCHED_OTHER "
            "kthreads keep their share, SCHED_FIFO ones (PREEMPT_RT ktimers/N, rcuc/N) below "
            "the inference priority do not")
        _warn_fair_server_off(ctx, rt_cpus)
        return
    missing = _missing(ctx, section, rt_cpus)
    current = ctx.topology.kernel.sched_rt_runtime_us
    if missing and current in UNTHROTTLED:
        ctx.warnings.append(f"{key}: {value} not planned, and RT throttling is already off "
                            f"here ({current}, set outside edge-agent) although: "
                            + "; ".join(missing))
    elif missing:
        ctx.warnings.append(f"{key}: {value} skipped, RT throttling stays on ("
                            f"{current if current is not None else 'the current'} of "
                            "1000000 us): " + "; ".join(missing))
    else:
        ctx.want("rt", SCHED_RT_RUNTIME, str(value), key,
                 note=f"unthrottled: {section['unthrottled_reason']}")
    ctx.warnings.append(f"{key}: {stalld(ctx)}")


def _warn_fair_server_off(ctx: PlanContext, cpus: list[int]) -> None:
    reader = SysReader(ctx.root)
    off = [cpu for cpu in cpus if reader.integer(f"{FAIR_SERVER}/cpu{cpu}/runtime") == 0]
    if off:
        ctx.warnings.append(f"rt.sched_rt_runtime_us: the fair server of CPU "
                            f"{format_cpulist(off)} has runtime 0 ({FAIR_SERVER}/cpuN/runtime): "
                            "nothing keeps SCHED_OTHER kthreads running under an RT thread "
                            "there")


def stalld(ctx: PlanContext) -> str:
    """Whether stalld (boosts threads starved on a CPU with SCHED_DEADLINE) is here."""
    unit = next((path for path in STALLD_UNITS if ctx.root.exists(path)), None)
    running = any(_comm(ctx.root, pid) == "stalld" for pid in _pids(ctx.root))
    if running or unit:
        return (f"stalld is {'running' if running else 'installed'}"
                f"{f' ({unit})' if unit else ''}: it boosts threads starved for its "
                "threshold, so a starved kworker still runs, late")
    return "stalld is not installed: nothing rescues a starved kworker on an inference CPU"


def _pids(root: Root) -> list[str]:
    try:
        return [name for name in root.listdir("/proc") if name.isdigit()]
    except OSError:
        return []


def _comm(root: Root, pid: str) -> str | None:
    try:
        return root.read_text(f"/proc/{pid}/comm").strip()
    except OSError:
        return None


def _irq_cpus(ctx: PlanContext, irq: int) -> list[int]:
    """The CPUs an IRQ (and so its thread) will run on: as planned, else as it is now."""
    path = f"/proc/irq/{irq}/smp_affinity_list"
    planned = next((c.desired for c in ctx.changes if c.path == path), None)
    try:
        return parse_cpulist(planned or ctx.root.read_text(path).strip())
    except (OSError, ValueError):
        return []


def warn_irq_threads(ctx: PlanContext, section: dict[str, Any]) -> None:
    """On PREEMPT_RT, device IRQs run in threads at SCHED_FIFO 50: an inference thread at or
    above that delays the completions of the GPU/NPU it waits on where they share a CPU.
    Called after the IRQs are planned: those moved off the inference CPUs are no risk."""
    wanted = section.get("inference", {})
    priority, cpus = wanted.get("priority", 0), set(ctx.cpus.get("inference", []))
    if not ctx.topology.kernel.preempt_rt or priority < IRQ_THREAD_PRIORITY or not cpus:
        return
    names = [name for name in [*(g.devfreq for g in ctx.topology.gpus),
                               *((n.sysfs or "").rsplit("/", 1)[-1] for n in ctx.topology.npus)]
             if name]
    try:
        rows = irqs.parse_rows(ctx.root.read_text("/proc/interrupts"))
    except OSError:
        return
    threads = sorted({f"irq/{irq}-{action}" for irq, row in rows.items()
                      for action in row.actions if any(action.startswith(n) for n in names)
                      and cpus & set(_irq_cpus(ctx, irq))})
    if threads:
        ctx.warnings.append(
            f"rt.inference.priority: {priority} is not below the PREEMPT_RT IRQ threads "
            f"(SCHED_FIFO {IRQ_THREAD_PRIORITY}) of the devices inference waits on, and "
            f"{', '.join(threads)} may run on the inference CPUs {format_cpulist(sorted(cpus))}"
            ": a completion there waits for the inference thread; use a priority below "
            f"{IRQ_THREAD_PRIORITY}, or move those IRQs (rt.irq_affinity) to the housekeeping "
            "CPUs")
