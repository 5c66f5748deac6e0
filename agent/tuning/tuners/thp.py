"""Transparent huge pages: enabled, defrag, khugepaged defrag
(https://docs.kernel.org/admin-guide/mm/transhuge.html).
"""

from __future__ import annotations

from typing import Any

from agent.tuning.plan import PlanContext

THP = "/sys/kernel/mm/transparent_hugepage"


def plan(section: dict[str, Any], ctx: PlanContext) -> None:
    admin = ctx.topology.kernel.thp.cmdline
    for key in ("enabled", "defrag"):
        if key not in section:
            continue
        if key == "enabled" and admin:
            ctx.warnings.append(f"thp.enabled: transparent_hugepage={admin} is set on the kernel "
                                "command line by the administrator; not overriding it")
            continue
        ctx.want("thp", f"{THP}/{key}", section[key], f"thp.{key}", compare="selection")
    if "khugepaged_defrag" in section:
        ctx.want("thp", f"{THP}/khugepaged/defrag", str(int(section["khugepaged_defrag"])),
                 "thp.khugepaged_defrag")
    if "dynamic" in section:
        ctx.runtime["thp_dynamic"] = dict(section["dynamic"])
