"""sysctl values: every vm.* name, plus an explicit allowlist of kernel.* and net.core.* names.

Each allowlisted name carries its documented meaning and values (Documentation/admin-guide/
sysctl/kernel.rst and net.rst); a kernel built without the feature has no file, which is an
error when the profile asks for it itself and a warning when it is optional or inherited.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from agent.tuning.plan import PlanContext


class Sysctl(NamedTuple):
    low: int
    high: int
    meaning: str
    absent_when: str  # why a kernel may lack the file


ALLOWED: dict[str, Sysctl] = {
    # kernel.rst: 1 lets the timer code move timers queued on a busy CPU's wheel to another
    # (non-idle) CPU; 0 keeps them where they were queued, so housekeeping timers do not land
    # on the inference cores.  TuneD's realtime profile sets 0.
    "kernel.timer_migration": Sysctl(0, 1, "0 keeps timers on the CPU that queued them",
                                     "the kernel is built without CONFIG_SMP/NO_HZ_COMMON"),
    # kernel.rst: 0 disables the hard-lockup detector (a perf NMI every watchdog_thresh
    # seconds on each CPU); TuneD's realtime profile sets 0.  Read-only on arm64 kernels
    # without an NMI-capable hard-lockup detector.
    "kernel.nmi_watchdog": Sysctl(0, 1, "0 stops the periodic hard-lockup NMI on every CPU",
                                  "the kernel has no lockup detector (CONFIG_LOCKUP_DETECTOR)"),
    # kernel.rst: 0 stops automatic NUMA balancing, whose hinting faults unmap pages
    # periodically; TuneD's network-latency/realtime profiles set 0.
    "kernel.numa_balancing": Sysctl(0, 1, "0 stops NUMA hinting faults and page migration",
                                    "the kernel is built without CONFIG_NUMA_BALANCING"),
    # net.rst: µs to busy-poll the device queue in poll()/select() (busy_poll) and in
    # socket reads (busy_read); 0 is off, 50 is the documented recommendation.
    "net.core.busy_poll": Sysctl(0, 1_000_000, "µs poll()/select() spin on the NIC queue",
                                 "the kernel is built without CONFIG_NET_RX_BUSY_POLL"),
    "net.core.busy_read": Sysctl(0, 1_000_000, "µs a socket read spins on the NIC queue",
                                 "the kernel is built without CONFIG_NET_RX_BUSY_POLL"),
}


def path_of(name: str) -> str:
    return "/proc/sys/" + name.replace(".", "/")


def plan(section: dict[str, Any], ctx: PlanContext) -> None:
    for name, value in section.items():
        key = f"sysctl.{name}"
        known = ALLOWED.get(name)
        if known is None:  # vm.*: any integer, the file's own range applies
            ctx.want("sysctl", path_of(name), str(value), key)
            continue
        allowed = f"{known.low}..{known.high} ({known.meaning})"
        if not known.low <= value <= known.high:
            raise ctx.error(key, f"{value} is out of range; allowed: {allowed}")
        ctx.want("sysctl", path_of(name), str(value), key,
                 lacking=(f" ({known.absent_when})", allowed))
