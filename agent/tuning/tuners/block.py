"""Block queues per device-name pattern, and NVMe power-state latency.

Queue files: https://docs.kernel.org/block/queue-sysfs.html.
"""

from __future__ import annotations

import fnmatch
from typing import Any

from agent.tuning.plan import PlanContext

NVME_PS_LATENCY = "/sys/module/nvme_core/parameters/default_ps_max_latency_us"


def plan(section: dict[str, Any], ctx: PlanContext) -> None:
    for pattern, wanted in section.items():
        devices = [d for d in ctx.topology.block if fnmatch.fnmatchcase(d.name, pattern)]
        if not devices:
            ctx.warnings.append(f"block.{pattern}: no block device matches; nothing to do")
        for device in devices:
            queue = f"/sys/block/{device.name}/queue"
            for name, value in wanted.items():
                key = f"block.{pattern}.{name}"
                if name == "scheduler":
                    offered = device.available_schedulers or []
                    if value not in offered:
                        raise ctx.error(key, f"{value!r} is not offered by {device.name} "
                                        f"(available: {', '.join(offered) or 'none'})")
                    ctx.want("block", f"{queue}/scheduler", value, key, compare="selection")
                else:
                    ctx.want("block", f"{queue}/{name}", str(value), key)


def plan_nvme(section: dict[str, Any], ctx: PlanContext) -> None:
    if "default_ps_max_latency_us" in section:
        ctx.want("nvme", NVME_PS_LATENCY, str(section["default_ps_max_latency_us"]),
                 "nvme.default_ps_max_latency_us",
                 note="applies to NVMe devices probed afterwards: takes effect after a reboot "
                      "(or set nvme_core.default_ps_max_latency_us= on the kernel command line)")
