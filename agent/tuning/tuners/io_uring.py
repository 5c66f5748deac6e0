"""io_uring's system-wide switches: ``kernel.io_uring_disabled`` and ``kernel.io_uring_group``.

Documentation/admin-guide/sysctl/kernel.rst (6.6+): io_uring_disabled 0 lets every process
create rings, 1 only CAP_SYS_ADMIN and members of io_uring_group (-1: no group), 2 nobody
(io_uring_setup fails with EPERM).  The check is made in io_uring_setup only: rings that exist
keep working.  Kernels before 6.6 (the 5.10/5.15/6.1 vendor kernels) have neither file and
still have io_uring, so a missing file is a knob this kernel lacks, not "io_uring is off".

``io_uring.limit_memlock`` (registered buffers against RLIMIT_MEMLOCK) is a systemd drop-in,
planned by its own tuner; this one ignores it.
"""

from __future__ import annotations

from typing import Any

from agent.tuning.plan import PlanContext

DISABLED = "/proc/sys/kernel/io_uring_disabled"
GROUP = "/proc/sys/kernel/io_uring_group"
KEYS = (("disabled", DISABLED), ("group", GROUP))
NOTE = "applies to rings created afterwards; rings that exist keep working"


def plan(section: dict[str, Any], ctx: PlanContext) -> None:
    for name, path in KEYS:
        if name in section:
            ctx.want("io_uring", path, str(section[name]), f"io_uring.{name}", note=NOTE,
                     lacking=(" (the io_uring sysctls came in kernel 6.6; older kernels "
                              "still have io_uring, without a switch for it)",
                              "a 6.6+ kernel, or list io_uring under optional"))
    disabled = section.get("disabled", ctx.topology.kernel.io_uring_disabled)
    if "group" in section and disabled not in (1, None):
        ctx.warnings.append(f"io_uring.group: {section['group']} has an effect only with "
                            f"io_uring_disabled = 1 (it will be {disabled})")
    if disabled == 1 and section.get("group", ctx.topology.kernel.io_uring_group) == -1:
        ctx.warnings.append("io_uring.disabled: 1 with io_uring_group -1 leaves io_uring to "
                            "CAP_SYS_ADMIN processes only")
