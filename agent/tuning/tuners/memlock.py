"""``io_uring.limit_memlock``: a LimitMEMLOCK= systemd drop-in for units on old kernels.

Before Linux 5.12 io_uring charged its rings (SQ/CQ arrays, SQEs) and registered buffers to
the process's RLIMIT_MEMLOCK, 64 KiB by default on older distributions, so a few rings or
any registered buffer failed with ENOMEM.  Commit 26bfa89e25f4 ("io_uring: place ring SQ/CQ
arrays under memcg memory limits", 5.12) moved the rings to memcg accounting; there, only
registered buffers (IORING_REGISTER_BUFFERS) still count against the limit, and not for a
process with CAP_IPC_LOCK.  So the drop-in is written on kernels older than 5.12 only, and
skipped with a warning elsewhere.  systemd reads drop-ins on ``daemon-reload`` (run after
apply and rollback on the real root); the limit applies when the unit next starts
(systemd.exec(5), LimitMEMLOCK=).
"""

from __future__ import annotations

import re
from typing import Any

from agent.tuning.kinds import ABSENT
from agent.tuning.plan import Change, PlanContext, read_normalised
from agent.tuning.values import resolve_size

FILE = "/etc/systemd/system/{unit}.d/edge-agent-memlock.conf"
MEMCG_SINCE = (5, 12)
_RELEASE = re.compile(r"^(\d+)\.(\d+)")


def body(value: str) -> str:
    return ("# edge-agent (io_uring.limit_memlock): io_uring charges locked memory to "
            f"RLIMIT_MEMLOCK before Linux 5.12\n[Service]\nLimitMEMLOCK={value}\n")


def _value(raw: Any) -> str:
    """``infinity``, or bytes (sizes with K/M/G are converted, as systemd reads 1024-based)."""
    return "infinity" if raw == "infinity" else resolve_size(raw, None)


def plan(section: dict[str, Any], ctx: PlanContext) -> None:
    if "limit_memlock" not in section:
        return  # io_uring.disabled / group are another planner's
    key = "io_uring.limit_memlock"
    release = ctx.topology.kernel.release or ""
    match = _RELEASE.match(release)
    if match is None or (int(match.group(1)), int(match.group(2))) >= MEMCG_SINCE:
        why = f"kernel {release}" if match else "the kernel release is unknown"
        ctx.warnings.append(f"{key}: skipped: {why}; since 5.12 io_uring's rings are charged "
                            "to the memory cgroup, not RLIMIT_MEMLOCK (only registered buffers "
                            "still count, and not for a service with CAP_IPC_LOCK, such as one "
                            "running as root)")
        return
    settings = section["limit_memlock"]
    try:
        value = _value(settings["value"])
    except ValueError as error:
        raise ctx.error(f"{key}.value", str(error)) from None
    for unit in settings["units"]:
        path = FILE.format(unit=unit)
        try:
            current = ctx.baseline[path] if path in ctx.baseline else \
                read_normalised(ctx.root, path, "file")
        except (OSError, ValueError) as error:
            raise ctx.error(key, f"cannot read {path}: {error}") from None
        if current == body(value):
            continue
        ctx.changes.append(Change(
            tuner="io_uring", path=path, current=current, desired=body(value), key=key,
            compare="file", persistent=True, restore=ABSENT if current is None else None,
            note=f"LimitMEMLOCK={value} for {unit}: applies when it next starts"))
