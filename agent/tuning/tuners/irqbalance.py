"""irqbalance's banned CPUs (``irqbalance.banned_cpus``), so it does not undo the plan.

irqbalance rewrites /proc/irq/*/smp_affinity every 10 s, moving device IRQs back onto the
CPUs ``rt.irq_affinity`` kept free (Documentation/core-api/irq/irq-affinity.rst: the
affinity file is the only control, and a daemon may write it too).  On Debian/Ubuntu its
systemd unit reads /etc/default/irqbalance (EnvironmentFile); irqbalance >= 1.8 takes
``IRQBALANCE_BANNED_CPULIST`` (a CPU list) and discards the older hex-mask
``IRQBALANCE_BANNED_CPUS`` with a message (Debian 12 ships 1.9.2, Ubuntu 22.04 and so
JetPack 6 ship 1.8.0), while 1.6 and 1.7 (Ubuntu 20.04, so JetPack 5) read only the hex mask.
The variable the installed version reads is written (dpkg's status says which version); both
where the version is unknown.  Each variable's line is edited or added, the rest kept byte for
byte;
edge-agent runs ``systemctl try-restart irqbalance.service`` (restarting it only if it
runs) after apply and rollback, on the real root only.
"""

from __future__ import annotations

import re
from typing import Any

from agent.discovery.runtimes import dpkg_packages
from agent.kernel.irqs import format_mask
from agent.kernel.parsers import format_cpulist
from agent.kernel.reader import SysReader
from agent.tuning.kinds import ABSENT, IRQBALANCE
from agent.tuning.plan import Change, PlanContext, read_normalised
from agent.tuning.values import resolve_cpus

VARIABLE = "IRQBALANCE_BANNED_CPULIST"
OLD_VARIABLE = "IRQBALANCE_BANNED_CPUS"
UNIT_FILES = ("/etc/systemd/system/irqbalance.service", "/lib/systemd/system/irqbalance.service",
              "/usr/lib/systemd/system/irqbalance.service")
ENABLED = "/etc/systemd/system/multi-user.target.wants/irqbalance.service"


def installed(ctx: PlanContext) -> bool:
    return any(ctx.root.exists(path) for path in UNIT_FILES)


def _line(name: str) -> re.Pattern[str]:
    return re.compile(rf"^[ \t]*(export[ \t]+)?{name}=.*$", re.MULTILINE)


def with_banned(text: str, value: str, variable: str = VARIABLE) -> str:
    """``text`` with the last active ``variable=`` line set (added at the end when there is
    none); every other byte kept."""
    found = list(_line(variable).finditer(text))
    line = f"{variable}={value}"
    if found:
        last = found[-1]
        return text[:last.start()] + line + text[last.end():]
    return text + ("" if not text or text.endswith("\n") else "\n") + line + "\n"


def variables(ctx: PlanContext) -> tuple[str, ...]:
    """The banned-CPU variables the installed irqbalance reads: CPULIST from 1.8 on, the hex
    mask before; both when dpkg does not say which version is installed."""
    version = dpkg_packages(SysReader(ctx.root)).get("irqbalance", "")
    numbers = re.match(r"(?:\d+:)?(\d+)\.(\d+)", version)
    if numbers is None:
        return (VARIABLE, OLD_VARIABLE)
    return (VARIABLE,) if (int(numbers[1]), int(numbers[2])) >= (1, 8) else (OLD_VARIABLE,)


def plan(section: dict[str, Any], ctx: PlanContext) -> None:
    key = "irqbalance.banned_cpus"
    if not installed(ctx):
        ctx.warnings.append(f"{key}: irqbalance is not installed here (no irqbalance.service "
                            "unit): nothing to ban")
        return
    try:
        cpus = resolve_cpus(section["banned_cpus"], ctx.topology, ctx.cpus.get("housekeeping"))
    except ValueError as error:
        raise ctx.error(key, str(error)) from None
    if set(cpus) >= set(ctx.topology.cpu.online):
        raise ctx.error(key, f"{format_cpulist(cpus)} bans every online CPU; irqbalance needs "
                        "at least one (the housekeeping CPUs)")
    try:
        current = ctx.baseline[IRQBALANCE] if IRQBALANCE in ctx.baseline else \
            read_normalised(ctx.root, IRQBALANCE, "file")
    except (OSError, ValueError) as error:
        raise ctx.error(key, f"cannot read {IRQBALANCE}: {error}") from None
    names = variables(ctx)
    if names == (VARIABLE,) and current is not None and _line(OLD_VARIABLE).search(current):
        ctx.warnings.append(f"{key}: {IRQBALANCE} also sets {OLD_VARIABLE} (a hex mask), which "
                            f"irqbalance >= 1.8 discards; {VARIABLE} is what it reads")
    values = {VARIABLE: format_cpulist(cpus), OLD_VARIABLE: format_mask(cpus)}
    desired = current or ""
    for name in names:
        desired = with_banned(desired, values[name], name)
    if desired != current:
        which = "" if len(names) == 1 else " (the irqbalance version is unknown: both the " \
            "1.8+ list and the older mask)"
        ctx.changes.append(Change(
            tuner="irqbalance", path=IRQBALANCE, current=current, desired=desired, key=key,
            compare="file", persistent=True, restore=ABSENT if current is None else None,
            note="; ".join(f"{name}={values[name]}" for name in names) + which
            + "; irqbalance is restarted if it runs"))


def warn_unbanned(settings: dict[str, Any], ctx: PlanContext) -> None:
    """IRQ affinity without a ban: a running irqbalance moves the IRQs back within seconds."""
    if not settings.get("rt", {}).get("irq_affinity") or "irqbalance" in settings:
        return
    if installed(ctx):
        state = "enabled" if ctx.root.exists(ENABLED) else "installed"
        ctx.warnings.append(f"rt.irq_affinity: irqbalance is {state} and rebalances IRQs every "
                            "10 s, undoing this; add irqbalance.banned_cpus (e.g. the "
                            "inference CPUs) or disable irqbalance.service")
