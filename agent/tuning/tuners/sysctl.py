"""sysctl values below /proc/sys/vm (the schema admits only vm.* names)."""

from __future__ import annotations

from typing import Any

from agent.tuning.plan import PlanContext


def plan(section: dict[str, Any], ctx: PlanContext) -> None:
    for name, value in section.items():
        path = "/proc/sys/" + name.replace(".", "/")
        ctx.want("sysctl", path, str(value), f"sysctl.{name}")
