"""cpuidle: disable idle states whose exit latency exceeds a bound, on every online CPU."""

from __future__ import annotations

from typing import Any

from agent.tuning.plan import PlanContext

CPU = "/sys/devices/system/cpu"


def plan(section: dict[str, Any], ctx: PlanContext) -> None:
    bound = section.get("disable_deeper_than_us")
    if bound is None:
        return
    for cluster in ctx.topology.cpu.clusters:
        for state in cluster.idle_states:
            if state.latency_us is None or state.latency_us <= bound:
                continue
            for cpu in cluster.online_cpus:
                ctx.want("cpuidle", f"{CPU}/cpu{cpu}/cpuidle/{state.state}/disable", "1",
                         "cpuidle.disable_deeper_than_us",
                         note=f"{state.name}: exit latency {state.latency_us} us > {bound} us")
