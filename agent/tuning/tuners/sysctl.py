"""sysctl values: every vm.* name (within its documented range where vm.rst gives one), plus
an explicit allowlist of kernel.* and net.core.* names.

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


# vm.* names with a documented range (Documentation/admin-guide/sysctl/vm.rst and their
# sysctl tables' extra1/extra2; docs/kernel-facts/refusals.md); other vm.* names take any
# integer and the file's own range applies.  None: no upper bound in the table.
VM: dict[str, tuple[int, int | None, str]] = {
    "vm.swappiness": (0, 200, "0..200 since 5.8 (mm/vmscan.c), 0..100 before"),
    "vm.dirty_ratio": (0, 100, "percent of dirtyable memory"),
    "vm.dirty_background_ratio": (0, 100, "percent of dirtyable memory"),
    "vm.dirty_bytes": (2 * 4096, None, "at least two pages (dirty_bytes_min); 0 is refused"),
    "vm.dirty_background_bytes": (0, None, "bytes"),
    "vm.dirty_expire_centisecs": (0, 2**31 - 1, "centiseconds"),
    "vm.dirty_writeback_centisecs": (0, 2**31 - 1, "centiseconds; 0 stops periodic writeback"),
    "vm.overcommit_memory": (0, 2, "0 heuristic, 1 always, 2 never overcommit"),
    "vm.overcommit_ratio": (0, 2**31 - 1, "percent"),
    "vm.vfs_cache_pressure": (0, 2**31 - 1, "100 is the default"),
    "vm.watermark_scale_factor": (1, 3000, "in 1/10000 of memory (mm/page_alloc.c)"),
    "vm.compaction_proactiveness": (0, 100, "0 disables proactive compaction"),
    "vm.page-cluster": (0, 31, "log2 of pages read per swap-in (mm/swap.c)"),
}
# each *_bytes is the counterpart of its *_ratio: writing one makes the other read 0 (vm.rst)
COUNTERPARTS = (("vm.dirty_ratio", "vm.dirty_bytes"),
                ("vm.dirty_background_ratio", "vm.dirty_background_bytes"))
MIN_FREE = "vm.min_free_kbytes"


def path_of(name: str) -> str:
    return "/proc/sys/" + name.replace(".", "/")


def _vm_bounds(name: str, value: int, ctx: PlanContext) -> None:
    """A vm.* value outside its documented range, refused at plan time."""
    key = f"sysctl.{name}"
    if name == "vm.drop_caches":
        raise ctx.error(key, "drop_caches is an action, not a setting: nothing holds it or "
                        "restores it; leave it out of profiles")
    if name == MIN_FREE:
        total = ctx.topology.memory.total_bytes
        high = total // 1024 // 20 if total else 262_144
        if not 128 <= value <= high:
            raise ctx.error(key, f"{value} is out of range; allowed: 128..{high} kB (5 % of "
                            "this device's memory; the kernel's own default is clamped to "
                            "128..262144 kB, and vm.rst warns that too high a value OOMs the "
                            "machine at once, too low deadlocks it under pressure)")
        return
    bounds = VM.get(name)
    if bounds is None:
        return
    low, top, meaning = bounds
    if value < low or (top is not None and value > top):
        raise ctx.error(key, f"{value} is out of range; allowed: {low}.."
                        f"{top if top is not None else ''} ({meaning})")


def plan(section: dict[str, Any], ctx: PlanContext) -> None:
    for ratio, size in COUNTERPARTS:
        if ratio in section and size in section:
            raise ctx.error(f"sysctl.{size}", f"sysctl.{ratio} and sysctl.{size} are "
                            "counterparts: writing one makes the kernel read the other as 0, so "
                            "both never hold (vm.rst); set one of them")
    for name, value in section.items():
        key = f"sysctl.{name}"
        known = ALLOWED.get(name)
        if known is None:  # vm.*: any integer within its documented range
            _vm_bounds(name, value, ctx)
            ctx.want("sysctl", path_of(name), str(value), key)
            continue
        allowed = f"{known.low}..{known.high} ({known.meaning})"
        if not known.low <= value <= known.high:
            raise ctx.error(key, f"{value} is out of range; allowed: {allowed}")
        ctx.want("sysctl", path_of(name), str(value), key,
                 lacking=(f" ({known.absent_when})", allowed))
