"""Kernel features: release, PREEMPT_RT, cgroup mode, THP, PSI, io_uring.

Each may be absent (not built, or off on the command line); absent is a finding, not an error.
"""

from __future__ import annotations

import ctypes
import errno
import gzip
import os
import zlib

from agent.discovery.model import Kernel, Thp
from agent.kernel import parsers
from agent.kernel.reader import SysReader

THP = "/sys/kernel/mm/transparent_hugepage"
CGROUP = "/sys/fs/cgroup"
IO_URING_SETUP = 425  # the same syscall number on x86_64 and arm64


def probe_io_uring_errno() -> int:
    """Ask the running kernel whether io_uring_setup exists and is allowed; 0 if it is.

    Called with a NULL params pointer so nothing is created: EFAULT/EINVAL mean the syscall
    is there; ENOSYS means not built, EPERM disabled by sysctl (checked first, before the
    params are read) or blocked by seccomp.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    result = libc.syscall(IO_URING_SETUP, 0, None)
    if result >= 0:
        os.close(result)
        return 0
    code = ctypes.get_errno()
    return code if code in (errno.ENOSYS, errno.EPERM) else 0


def probe_io_uring() -> bool:
    return probe_io_uring_errno() == 0


_URING_STATUS = {0: "enabled", 1: "restricted", 2: "disabled"}


def _io_uring(reader: SysReader) -> tuple[bool | None, str | None]:
    """(usable, status): the sysctl where the kernel has it (6.6+), else the syscall itself
    on the host; a fixture without the sysctl cannot be probed."""
    sysctl = reader.integer("/proc/sys/kernel/io_uring_disabled")
    if sysctl is not None:  # 1 still admits CAP_SYS_ADMIN and the io_uring_group
        return sysctl != 2, _URING_STATUS.get(sysctl)
    if not reader.root.is_host:  # absent on 5.10-6.1, which still have io_uring
        return None, None
    code = probe_io_uring_errno()
    return code == 0, {0: "enabled", errno.ENOSYS: "not built"}.get(code, "blocked")


def _rt_from_config(reader: SysReader, release: str | None) -> bool:
    if release and reader.exists(f"/boot/config-{release}"):
        config = reader.text(f"/boot/config-{release}") or ""
        return parsers.kernel_config_enabled(config, "PREEMPT_RT")
    if reader.exists("/proc/config.gz"):
        data = reader.raw("/proc/config.gz")
        try:
            config = gzip.decompress(data or b"").decode(errors="replace")
        except (OSError, EOFError, zlib.error):
            reader.warn("/proc/config.gz: not a gzip file")
            return False
        return parsers.kernel_config_enabled(config, "PREEMPT_RT")
    return False


def _cgroup_mode(reader: SysReader) -> tuple[str | None, str]:
    """(mode, path of the v2 hierarchy) from the fstype mounted on /sys/fs/cgroup."""
    mounts = reader.parsed("/proc/mounts", parsers.parse_mounts) or []
    types = {point: fstype for _, point, fstype in mounts}  # later mounts win
    if types.get(CGROUP) == "cgroup2":
        return "v2", CGROUP
    if types.get(f"{CGROUP}/unified") == "cgroup2":
        return "hybrid", f"{CGROUP}/unified"
    if any(fstype == "cgroup" for fstype in types.values()):
        return "v1", ""
    if reader.exists(f"{CGROUP}/cgroup.controllers"):
        return "v2", CGROUP
    return None, ""


def _thp(reader: SysReader, cmdline: str) -> Thp:
    enabled = reader.parsed(f"{THP}/enabled", parsers.parse_selection)
    defrag = reader.parsed(f"{THP}/defrag", parsers.parse_selection)
    return Thp(enabled=enabled[0] if enabled else None, defrag=defrag[0] if defrag else None,
               khugepaged_defrag=reader.integer(f"{THP}/khugepaged/defrag"),
               cmdline=parsers.thp_cmdline_choice(cmdline))


def discover_kernel(reader: SysReader) -> Kernel:
    release = reader.text("/proc/sys/kernel/osrelease")
    version = reader.text("/proc/sys/kernel/version")
    model = parsers.preempt_model(version) if version else None
    preempt_rt = (model == "PREEMPT_RT" or reader.integer("/sys/kernel/realtime") == 1
                  or _rt_from_config(reader, release))
    mode, v2_path = _cgroup_mode(reader)
    controllers = (reader.words(f"{v2_path}/cgroup.controllers") or []) if v2_path else []
    cmdline = reader.text("/proc/cmdline") or ""
    io_uring, uring_status = _io_uring(reader)
    return Kernel(release=release, version=version, preempt_rt=preempt_rt, preempt_model=model,
                  cgroup_v2=mode == "v2", cgroup_mode=mode, cgroup_controllers=controllers,
                  thp=_thp(reader, cmdline), io_uring=io_uring,
                  io_uring_disabled=reader.integer("/proc/sys/kernel/io_uring_disabled"),
                  io_uring_group=reader.integer("/proc/sys/kernel/io_uring_group"),
                  io_uring_status=uring_status,
                  nvme_poll_queues=reader.integer("/sys/module/nvme/parameters/poll_queues"),
                  psi=reader.text("/proc/pressure/cpu") is not None,
                  cmdline=cmdline or None,
                  sched_rt_runtime_us=reader.integer("/proc/sys/kernel/sched_rt_runtime_us"))
