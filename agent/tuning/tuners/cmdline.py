"""Kernel arguments in the boot config (``cmdline:``); persistent, effective after a reboot.

Only these names, each documented in Documentation/admin-guide/kernel-parameters.txt:

- ``isolcpus=[flag,...,]<cpu-list>``: CPUs taken out of the scheduler's balancing
  (``domain``) and away from managed IRQs (``managed_irq``); ``nohz`` as a flag too.
- ``nohz_full=<cpu-list>``: adaptive-ticks CPUs (CONFIG_NO_HZ_FULL); the boot CPU stays a
  housekeeping CPU (Documentation/timers/no_hz.rst), so one listed here is warned about.
- ``rcu_nocbs=<cpu-list>``: RCU callbacks offloaded from these CPUs (CONFIG_RCU_NOCB_CPU).
- ``irqaffinity=<cpu-list>``: the default IRQ affinity from boot on.
- ``nvme.poll_queues=<n>``: NVMe poll queues for io_uring's IORING_SETUP_IOPOLL; the module
  parameter is read when the queues are set up, so the boot config is where it belongs.
- ``transparent_hugepage=always|madvise|never``: THP's mode from boot on.

CPU lists take the profile's CPU selectors (``cluster:big``, ``housekeeping``, ``cpus:4-7``);
``housekeeping`` is the rt tuner's set when it ran.  The plan never reboots.
"""

from __future__ import annotations

from typing import Any

from agent.kernel.parsers import format_cpulist
from agent.tuning.bootargs import AFTER_REBOOT, PREFIX, BootConfigError, config_path, running
from agent.tuning.plan import Change, PlanContext, read_normalised
from agent.tuning.values import resolve_cpus

CPU_LISTS = ("isolcpus", "nohz_full", "rcu_nocbs", "irqaffinity")
ISOLCPUS_FLAGS = ("domain", "managed_irq", "nohz")
THP_MODES = ("always", "madvise", "never")
NAMES = (*CPU_LISTS, "nvme.poll_queues", "transparent_hugepage")


def _cpus(ctx: PlanContext, key: str, selector: str) -> list[int]:
    try:
        return resolve_cpus(selector, ctx.topology, ctx.cpus.get("housekeeping"))
    except ValueError as error:
        raise ctx.error(key, str(error)) from None


def split_flags(value: str) -> tuple[list[str], str]:
    """``managed_irq,domain,cluster:big`` -> (flags, selector)."""
    parts = value.split(",")
    flags: list[str] = []
    while len(parts) > 1 and parts[0] in ISOLCPUS_FLAGS:
        flags.append(parts.pop(0))
    return flags, ",".join(parts)


def _token(ctx: PlanContext, name: str, value: Any) -> str:
    key = f"cmdline.{name}"
    if name in CPU_LISTS:
        flags, selector = split_flags(str(value)) if name == "isolcpus" else ([], str(value))
        cpus = _cpus(ctx, key, selector)
        housekeeping = set(ctx.cpus.get("housekeeping", [])) & set(cpus)
        if name in ("isolcpus", "nohz_full") and housekeeping:
            ctx.warnings.append(f"{key}: {selector} includes the housekeeping CPUs "
                                f"{format_cpulist(sorted(housekeeping))}, which keep the "
                                "kernel's own work")
        if name == "nohz_full" and 0 in cpus:
            ctx.warnings.append(f"{key}: CPU 0 (the boot CPU) stays a housekeeping CPU "
                                "(Documentation/timers/no_hz.rst)")
        return f"{name}={','.join([*flags, format_cpulist(cpus)])}"
    if name == "transparent_hugepage" and value not in THP_MODES:
        raise ctx.error(key, f"{value!r} is not a THP mode; allowed: {', '.join(THP_MODES)}")
    if name == "nvme.poll_queues" and not (isinstance(value, int) and value >= 0):
        raise ctx.error(key, f"{value!r} is not a queue count; allowed: an integer >= 0 (0 "
                        "turns polling off; the driver caps it at the CPU count)")
    return f"{name}={value}"


def plan(section: dict[str, Any], ctx: PlanContext) -> None:
    try:
        config = config_path(ctx.root)
    except BootConfigError as error:
        ctx.lacking("cmdline", f"no boot config edge-agent can edit: {error}",
                    "Armbian armbianEnv.txt, extlinux.conf, u-boot-update's "
                    "U_BOOT_PARAMETERS, the Pi's cmdline.txt or GRUB's /etc/default/grub")
        return
    booted = running(ctx.root)
    for name, value in section.items():
        path, key = PREFIX + name, f"cmdline.{name}"
        token = _token(ctx, name, value)
        try:
            current = ctx.baseline[path] if path in ctx.baseline else \
                read_normalised(ctx.root, path, "cmdline")
        except (OSError, ValueError) as error:
            raise ctx.error(key, f"cannot read {config}: {error}") from None
        if current == token:
            if token not in booted:
                ctx.warnings.append(f"{key}: {token} is in {config}; {AFTER_REBOOT}")
            continue
        ctx.changes.append(Change(tuner="cmdline", path=path, current=current or "",
                                  desired=token, key=key, compare="cmdline", persistent=True,
                                  note=f"{config}: {AFTER_REBOOT}"))
