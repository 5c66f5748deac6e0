"""Transparent huge pages: enabled, defrag, khugepaged defrag
(https://docs.kernel.org/admin-guide/mm/transhuge.html).

A kernel built without CONFIG_TRANSPARENT_HUGEPAGE (common on PREEMPT_RT builds, where THP
was long unavailable: the Xavier NX RT kernel has none) has no
/sys/kernel/mm/transparent_hugepage at all; transhuge.rst documents the sysfs files only
for kernels with THP.  A profile that only inherits THP settings still plans there.
"""

from __future__ import annotations

from typing import Any

from agent.tuning.plan import PlanContext
from agent.tuning.schema import THP_DEFRAG, THP_ENABLED

THP = "/sys/kernel/mm/transparent_hugepage"
NO_THP = (": this kernel is built without transparent huge pages "
          "(CONFIG_TRANSPARENT_HUGEPAGE, Documentation/admin-guide/mm/transhuge.rst)")
ALLOWED = {"enabled": ", ".join(THP_ENABLED), "defrag": ", ".join(THP_DEFRAG),
           "khugepaged_defrag": "0, 1"}


def plan(section: dict[str, Any], ctx: PlanContext) -> None:
    admin = ctx.topology.kernel.thp.cmdline
    present = ctx.root.is_dir(THP)
    lacking = None if present else NO_THP
    for key in ("enabled", "defrag"):
        if key not in section:
            continue
        if key == "enabled" and admin:
            ctx.warnings.append(f"thp.enabled: transparent_hugepage={admin} is set on the kernel "
                                "command line by the administrator; not overriding it")
            continue
        ctx.want("thp", f"{THP}/{key}", section[key], f"thp.{key}", compare="selection",
                 lacking=(lacking or "", f"{ALLOWED[key]} where the kernel has the file"))
    if "khugepaged_defrag" in section:
        ctx.want("thp", f"{THP}/khugepaged/defrag", str(int(section["khugepaged_defrag"])),
                 "thp.khugepaged_defrag",
                 lacking=(lacking or "", f"{ALLOWED['khugepaged_defrag']} where the kernel "
                          "has the file"))
    if "dynamic" in section:
        if not present:  # the controller switches thp.enabled: nothing to switch here
            ctx.lacking("thp.dynamic", f"{THP} does not exist{NO_THP}",
                        "the dynamic controller on a kernel with THP only")
            return
        ctx.runtime["thp_dynamic"] = dict(section["dynamic"])
