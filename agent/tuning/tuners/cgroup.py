"""cgroup v2: the agent's cgroup limits, and the controllers its parent must delegate.

The cgroup itself comes from systemd (``Delegate=yes`` on the unit) or from
:func:`create_cgroup`; profiles only set limits, which the kernel files take in bytes.
"""

from __future__ import annotations

import os
from typing import Any

from agent.discovery.model import Topology
from agent.kernel.fsroot import Root
from agent.tuning.plan import Change, PlanContext
from agent.tuning.values import resolve_cpus, resolve_size

PROFILE_KEY_OF = {"memory.max": "memory_max", "memory.high": "memory_high", "cpu.max": "cpu_max",
                  "cpuset.cpus": "cpus", "cpuset.mems": "mems"}
CONTROLLER_OF = {"memory_max": "memory", "memory_high": "memory", "cpu_max": "cpu",
                 "cpus": "cpuset", "mems": "cpuset"}


def hierarchy(topology: Topology) -> str | None:
    """Where the cgroup v2 tree is mounted: the whole tree, or the hybrid ``unified`` part."""
    return {"v2": "/sys/fs/cgroup", "hybrid": "/sys/fs/cgroup/unified"}.get(
        topology.kernel.cgroup_mode or "")


def _limit_values(section: dict[str, Any], ctx: PlanContext) -> dict[str, str]:
    total = ctx.topology.memory.total_bytes
    values: dict[str, str] = {}
    current_key = "memory_max"
    try:
        if "memory_max" in section:
            values["memory.max"] = resolve_size(section["memory_max"], total)
        current_key = "memory_high"
        if "memory_high" in section:
            # a percentage of memory.high is of memory.max when one is set
            base = values.get("memory.max")
            values["memory.high"] = resolve_size(
                section["memory_high"], int(base) if base and base != "max" else total)
        if "cpu_max" in section:
            values["cpu.max"] = section["cpu_max"]
        current_key = "cpus"
        if "cpus" in section:
            values["cpuset.cpus"] = ",".join(map(str, resolve_cpus(section["cpus"],
                                                                   ctx.topology)))
        if "mems" in section:
            values["cpuset.mems"] = section["mems"]
    except ValueError as error:
        raise ctx.error(f"cgroup.{current_key}", str(error)) from None
    return values


def plan(section: dict[str, Any], ctx: PlanContext) -> None:
    mount = hierarchy(ctx.topology)
    if mount is None:
        raise ctx.error("cgroup", "needs a cgroup v2 hierarchy; this device has "
                        f"{ctx.topology.kernel.cgroup_mode or 'none'}")
    relative = section.get("path", "edge-agent.slice")
    directory = f"{mount}/{relative}"
    if not ctx.root.is_dir(directory):
        raise ctx.error("cgroup.path", f"{directory} does not exist: let systemd create it "
                        "(Delegate=yes in the unit) or create it before applying")
    values = _limit_values(section, ctx)
    if "memory.max" in values and values["memory.max"] != "max":
        usage = ctx.current(f"{directory}/memory.current", "cgroup.memory_max")
        if int(values["memory.max"]) < int(usage):
            raise ctx.error("cgroup.memory_max", f"{values['memory.max']} bytes is below the "
                            f"cgroup's current usage of {usage} bytes")
    needed = sorted({CONTROLLER_OF[k] for k in section if k in CONTROLLER_OF})
    if needed:
        parent = os.path.dirname(directory)
        control = f"{parent}/cgroup.subtree_control"
        enabled = set(ctx.current(control, "cgroup").split())
        missing = [c for c in needed if c not in enabled]
        if missing:
            ctx.root.check_writable(control)
            ctx.changes.append(_controllers_change(control, enabled, missing))
    for name, value in values.items():
        compare = "cpulist" if name == "cpuset.cpus" else "value"
        ctx.want("cgroup", f"{directory}/{name}", value, f"cgroup.{PROFILE_KEY_OF[name]}",
                 compare=compare)


def _controllers_change(control: str, enabled: set[str], missing: list[str]) -> Change:
    """Enabling controllers is ``+x`` and undoing it ``-x``: not a plain overwrite."""
    return Change(tuner="cgroup", path=control, current=" ".join(sorted(enabled)),
                  desired=" ".join(missing), key="cgroup", compare="controllers",
                  write=" ".join(f"+{c}" for c in missing),
                  restore=" ".join(f"-{c}" for c in missing))


def create_cgroup(root: Root, directory: str) -> bool:
    """Create a cgroup directory (real cgroupfs fills it); False if it already existed."""
    root.check_writable(f"{directory}/cgroup.procs")
    try:
        os.mkdir(root.host_path(directory))
    except FileExistsError:
        return False
    return True


def remove_cgroup(root: Root, directory: str) -> None:
    root.check_writable(f"{directory}/cgroup.procs")
    os.rmdir(root.host_path(directory))


def move_into(root: Root, directory: str, task_id: int, threads: bool = False) -> None:
    """Move a process (``cgroup.procs``) or one thread (``cgroup.threads``) in: one id per
    write, as the kernel requires."""
    root.write_text(f"{directory}/{'cgroup.threads' if threads else 'cgroup.procs'}",
                    str(task_id))
