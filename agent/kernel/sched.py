"""Real-time placement: thread scheduling policy and CPU affinity, and IRQ lookup by name.

Applying returns the thread's original settings so the caller can put them back on shutdown
or rollback.  Affinity is set before the policy, so a thread never runs at real-time priority
on a CPU it was not meant to occupy; if the policy change then fails, the affinity is restored
and nothing is left half-applied.
"""

from __future__ import annotations

import errno
import fnmatch
import os
import resource
import threading
from dataclasses import dataclass

from agent.kernel.fsroot import Root
from agent.kernel.irqs import parse_rows
from agent.kernel.parsers import format_cpulist, parse_cpulist

SCHED_POLICIES: dict[str, int] = {
    "other": os.SCHED_OTHER,
    "fifo": os.SCHED_FIFO,
    "rr": os.SCHED_RR,
    "batch": os.SCHED_BATCH,
    "idle": os.SCHED_IDLE,
}

_POLICY_NAMES = {number: name for name, number in SCHED_POLICIES.items()}
_REALTIME = frozenset({"fifo", "rr"})
_RT_PRIORITY = range(1, 100)


class RtError(ValueError):
    """A scheduling request that is invalid or that the kernel refused, with the fix."""


class AffinityRefused(RtError):
    """sched_setaffinity failed with EINVAL: CPUs outside the thread's cpuset, or a thread
    the kernel pins itself (PF_NO_SETAFFINITY); the thread is left unchanged."""


# io_uring's kernel-side threads carry the ring owner's name: "iou-sqp-<pid>" polls the
# submission queue (IORING_SETUP_SQPOLL), "iou-wrk-<pid>" are io-wq workers, made on demand
# and gone when idle.  Kernels before 6.3/6.4 mark both PF_NO_SETAFFINITY, so
# sched_setaffinity is EINVAL ("io_uring/io-wq: stop setting PF_NO_SETAFFINITY on io-wq
# workers", "io_uring/sqpoll: Do not set PF_NO_SETAFFINITY on sqpoll threads", March 2023);
# io_uring has its own knobs for their CPUs.
IO_URING_THREADS = {
    "iou-wrk-": "io-wq worker; use IORING_REGISTER_IOWQ_AFF",
    "iou-sqp-": "SQPOLL thread; use IORING_SETUP_SQ_AFF with sq_thread_cpu",
}


def io_uring_thread(comm: str | None) -> str | None:
    """What an io_uring kernel-side thread is and how it is pinned; None for other threads."""
    return next((why for prefix, why in IO_URING_THREADS.items()
                 if (comm or "").startswith(prefix)), None)


@dataclass(frozen=True)
class ThreadSched:
    """A thread's scheduling: policy name (a key of SCHED_POLICIES), priority and CPUs."""

    policy: str
    priority: int
    cpus: list[int]


# -- threads -------------------------------------------------------------------------------


def read_thread_sched(tid: int) -> ThreadSched:
    """The current policy, priority and affinity of a thread (native TID)."""
    number = os.sched_getscheduler(tid) & ~os.SCHED_RESET_ON_FORK  # a flag, not a policy
    if number not in _POLICY_NAMES:
        raise RtError(
            f"thread {tid} uses scheduling policy {number} (e.g. SCHED_DEADLINE), which the "
            f"agent cannot restore; supported: {', '.join(SCHED_POLICIES)}")
    return ThreadSched(policy=_POLICY_NAMES[number],
                       priority=os.sched_getparam(tid).sched_priority,
                       cpus=sorted(os.sched_getaffinity(tid)))


def _validate(wanted: ThreadSched) -> None:
    """Reject requests the kernel would refuse with a bare EINVAL, naming the field."""
    if wanted.policy not in SCHED_POLICIES:
        raise RtError(f"policy {wanted.policy!r} is unknown; allowed: "
                      f"{', '.join(SCHED_POLICIES)}")
    if wanted.policy in _REALTIME and wanted.priority not in _RT_PRIORITY:
        raise RtError(f"priority {wanted.priority} is out of range for policy "
                      f"{wanted.policy!r}; allowed: 1-99")
    if wanted.policy not in _REALTIME and wanted.priority != 0:
        raise RtError(f"priority {wanted.priority} is invalid for policy {wanted.policy!r}; "
                      "allowed: 0 (only fifo and rr take 1-99)")
    if not wanted.cpus:
        raise RtError("cpus is empty; allowed: a non-empty list of CPU numbers")
    if min(wanted.cpus) < 0:
        raise RtError(f"cpus {wanted.cpus} holds a negative number; allowed: CPU numbers >= 0")


def _set_affinity(tid: int, cpus: list[int]) -> None:
    try:
        os.sched_setaffinity(tid, cpus)
    except ProcessLookupError:
        raise
    except OSError as exc:
        kind = AffinityRefused if exc.errno == errno.EINVAL else RtError
        raise kind(f"cpus {cpus} refused for thread {tid}: {exc.strerror}; allowed: "
                   "online CPUs in the thread's cpuset") from exc


def _set_policy(tid: int, wanted: ThreadSched) -> None:
    try:
        os.sched_setscheduler(tid, SCHED_POLICIES[wanted.policy],
                              os.sched_param(wanted.priority))
    except PermissionError as exc:
        raise RtError(_permission_hint(tid, wanted)) from exc
    except ProcessLookupError:
        raise
    except OSError as exc:
        raise RtError(f"policy {wanted.policy!r} priority {wanted.priority} refused for "
                      f"thread {tid}: {exc.strerror}") from exc


def _permission_hint(tid: int, wanted: ThreadSched) -> str:
    """Say what grants the permission: the capability, the rlimit, or the RT cgroup budget."""
    refused = (f"policy {wanted.policy!r} priority {wanted.priority} not permitted for "
               f"thread {tid}")
    if wanted.policy not in _REALTIME:
        return (f"{refused}: changing another user's thread, or leaving 'idle', needs "
                "CAP_SYS_NICE (AmbientCapabilities=CAP_SYS_NICE in the systemd unit)")
    soft, _hard = resource.getrlimit(resource.RLIMIT_RTPRIO)
    limit = "unlimited" if soft == resource.RLIM_INFINITY else str(soft)
    return (f"{refused}: needs CAP_SYS_NICE or RLIMIT_RTPRIO >= {wanted.priority} (this "
            f"process: {limit}); set LimitRTPRIO={wanted.priority} or "
            "AmbientCapabilities=CAP_SYS_NICE in the systemd unit, and with "
            "CONFIG_RT_GROUP_SCHED give the agent's cgroup an RT runtime budget")


def apply_thread_sched(tid: int, wanted: ThreadSched) -> ThreadSched:
    """Pin and schedule a thread; return its original settings for restore_thread_sched.

    Raises RtError for an invalid request or a refusal; the thread is then left unchanged.
    A thread that has exited raises ProcessLookupError.
    """
    _validate(wanted)
    original = read_thread_sched(tid)
    _set_affinity(tid, wanted.cpus)
    try:
        _set_policy(tid, wanted)
    except RtError:
        os.sched_setaffinity(tid, original.cpus)
        raise
    return original


def restore_thread_sched(tid: int, original: ThreadSched) -> None:
    """Undo apply_thread_sched: policy first, so the thread leaves RT before it moves."""
    _validate(original)
    _set_policy(tid, original)
    _set_affinity(tid, original.cpus)


def apply_to_current_thread(wanted: ThreadSched) -> ThreadSched:
    """apply_thread_sched for the calling thread, as the inference loop does for itself."""
    return apply_thread_sched(threading.get_native_id(), wanted)


def threads_matching(root: Root, comm_pattern: str,
                     pid: int | None = None) -> list[tuple[int, int, str]]:
    """(pid, tid, comm) of threads whose comm matches an fnmatch pattern, in numeric order.

    With ``pid`` only that process's threads are scanned.  Processes and threads that exit
    during the scan are skipped, as is a ``pid`` that does not exist.
    """
    pids = [pid] if pid is not None else _numeric_entries(root, "/proc")
    found: list[tuple[int, int, str]] = []
    for proc in pids:
        for tid in _numeric_entries(root, f"/proc/{proc}/task"):
            comm = _read_comm(root, proc, tid)
            if comm is not None and fnmatch.fnmatchcase(comm, comm_pattern):
                found.append((proc, tid, comm))
    return found


def _numeric_entries(root: Root, directory: str) -> list[int]:
    try:
        names = root.listdir(directory)
    except (FileNotFoundError, ProcessLookupError):
        return []
    return sorted(int(name) for name in names if name.isdigit())


def _read_comm(root: Root, pid: int, tid: int) -> str | None:
    try:
        return root.read_text(f"/proc/{pid}/task/{tid}/comm").rstrip("\n")
    except (FileNotFoundError, ProcessLookupError):
        return None


# -- IRQs ------------------------------------------------------------------------------------

def parse_interrupts(text: str) -> dict[int, list[str]]:
    """/proc/interrupts -> {irq: [action names]}; NMI/LOC-style rows are not IRQs."""
    return {irq: row.actions for irq, row in parse_rows(text).items()}


def irqs_matching(root: Root, pattern: str) -> list[int]:
    """IRQ numbers with any action name matching an fnmatch pattern such as ``nvme*``."""
    irqs = parse_interrupts(root.read_text("/proc/interrupts"))
    return sorted(irq for irq, names in irqs.items()
                  if any(fnmatch.fnmatchcase(name, pattern) for name in names))


def irq_affinity_path(irq: int) -> str:
    """The CPU-list affinity file of an IRQ (the hex-mask ``smp_affinity`` is its twin)."""
    return f"/proc/irq/{irq}/smp_affinity_list"


def rt_kernel_warning(preempt_rt: bool) -> str | None:
    """A warning for RT settings on a kernel without PREEMPT_RT, else None."""
    if preempt_rt:
        return None
    return ("kernel is not PREEMPT_RT: real-time priorities and affinities are applied, "
            "but worst-case latency is not bounded")


def is_realtime(sched: ThreadSched) -> bool:
    """SCHED_FIFO or SCHED_RR: the policies RT throttling and housekeeping are about."""
    return sched.policy in _REALTIME


def reset_thread_sched(tid: int, cpus: list[int]) -> None:
    """What a thread has before any profile touches it: SCHED_OTHER at nice 0 on ``cpus``
    (the process's full set).  A thread born of a SCHED_FIFO thread inherits its policy,
    priority and affinity (sched(7)), so what such a thread "had" is no baseline."""
    restore_thread_sched(tid, ThreadSched("other", 0, cpus))
    try:
        os.setpriority(os.PRIO_PROCESS, tid, 0)  # PRIO_PROCESS with a TID: that thread only
    except PermissionError as exc:  # lowering a nice value needs CAP_SYS_NICE
        raise RtError(f"nice 0 not permitted for thread {tid}: needs CAP_SYS_NICE") from exc


def format_sched(sched: ThreadSched) -> str:
    """``fifo:80:4-7``: how a thread's scheduling is journaled and compared."""
    return f"{sched.policy}:{sched.priority}:{format_cpulist(sched.cpus)}"


def parse_sched(text: str) -> ThreadSched:
    policy, priority, cpus = text.split(":")
    return ThreadSched(policy, int(priority), parse_cpulist(cpus))


def thread_path(pid: int, tid: int) -> str:
    return f"/proc/{pid}/task/{tid}"


def tid_of(path: str) -> int:
    return int(path.rstrip("/").rsplit("/", 1)[1])
