"""cgroup v2 limits on the inference data plane, wherever :mod:`agent.tuning.placement` put it.

Under systemd each limit is a runtime property of ``edge_agent.slice`` (a change on path
``systemd:edge_agent.slice/MemoryMax``, read and written through the systemd boundary);
without systemd it is a file of the data plane's leaf in the agent's delegated subtree.
Either way the original is journaled and restored exactly.  ``cgroup.path`` no longer moves
anything (the agent decides where the data plane runs, inside what it owns); a ``..`` in it is
still refused.
"""

from __future__ import annotations

from typing import Any

from agent.kernel.cgroup_model import CONTROLLER_FILES
from agent.kernel.pages import page_size
from agent.kernel.parsers import format_cpulist, parse_cpulist
from agent.tuning.placement import CgroupfsPlacement, Placement
from agent.tuning.plan import Change, PlanContext, matches, read_normalised
from agent.tuning.units import PROPERTIES, SLICE, UNSET, UnitError, dropin_path, normalise
from agent.tuning.values import resolve_cpus, resolve_size

FILE_OF = {"memory_max": "memory.max", "memory_high": "memory.high", "cpu_max": "cpu.max",
           "cpu_weight": "cpu.weight", "cpus": "cpuset.cpus", "mems": "cpuset.mems"}
CONTROLLER_OF = {key: prop.controller for key, prop in PROPERTIES.items()}
UNIT_PREFIX = "systemd:"


def unit_path(unit: str, name: str) -> str:
    return f"{UNIT_PREFIX}{unit}/{name}"


def split_unit_path(path: str) -> tuple[str, str]:
    """``systemd:edge_agent.slice/MemoryMax`` -> (unit, property)."""
    unit, _, name = path.removeprefix(UNIT_PREFIX).partition("/")
    return unit, name


def _limit_values(section: dict[str, Any], ctx: PlanContext) -> dict[str, str]:
    """Profile key -> the kernel file's form (bytes or ``max``, CPU lists, ``cpu.max``)."""
    total = ctx.topology.memory.total_bytes
    page = page_size(ctx.root.is_host, ctx.root.base)
    values: dict[str, str] = {}
    key = "memory_max"
    try:
        if "memory_max" in section:
            values["memory_max"] = resolve_size(section["memory_max"], total, page)
        key = "memory_high"
        if "memory_high" in section:
            # a percentage of memory.high is of memory.max when one is set
            base = values.get("memory_max")
            values["memory_high"] = resolve_size(
                section["memory_high"], int(base) if base and base != "max" else total, page)
        for key in ("cpu_max", "cpu_weight", "mems"):
            if key in section:
                values[key] = str(section[key])
        key = "cpu_max"
        if "cpu_max" in values:
            _check_cpu_max(values["cpu_max"])
        key = "cpus"
        if "cpus" in section:
            values["cpus"] = ",".join(map(str, resolve_cpus(section["cpus"], ctx.topology)))
    except ValueError as error:
        raise ctx.error(f"cgroup.{key}", str(error)) from None
    return values


def _check_cpu_max(value: str) -> None:
    """The kernel's bounds (kernel/sched/core.c): a period of 1 ms to 1 s, a quota of at
    least 1 ms."""
    quota, _, period = value.partition(" ")
    if period and not 1000 <= int(period) <= 1_000_000:
        raise ValueError(f"{value!r}: the period must be 1000 to 1000000 µs")
    if quota != "max" and int(quota) < 1000:
        raise ValueError(f"{value!r}: the quota must be max or at least 1000 µs")


def _check_usage(ctx: PlanContext, values: dict[str, str], usage: str | None) -> None:
    """A limit below what the data plane uses now would get it OOM-killed at once."""
    limit = values.get("memory_max", "max")
    if limit != "max" and usage is not None and usage.isdigit() and int(limit) < int(usage):
        raise ctx.error("cgroup.memory_max", f"{limit} bytes is below the data plane's "
                        f"current usage of {usage} bytes")


def plan(section: dict[str, Any], ctx: PlanContext, placement: Placement) -> None:
    if placement.mode == "none":
        raise ctx.error("cgroup", placement.reason)
    path = str(section.get("path", ""))
    if ".." in path.split("/") or path.startswith("/"):
        raise ctx.error("cgroup.path", f"{path}: must stay inside the agent's own cgroup")
    if path:
        ctx.warnings.append(f"cgroup.path: {path} is not used: the data plane runs in "
                            f"{placement.limits_dir}, which the agent owns")
    values = _limit_values(section, ctx)
    offered = ctx.topology.kernel.cgroup_controllers or []
    if isinstance(placement, CgroupfsPlacement):
        offered = placement.offered()
    for key in values:
        if CONTROLLER_OF[key] not in offered:
            raise ctx.error(f"cgroup.{key}", f"needs the {CONTROLLER_OF[key]} controller, "
                            f"which is not available here (available: "
                            f"{' '.join(offered) or 'none'})")
    if isinstance(placement, CgroupfsPlacement):
        _plan_files(values, ctx, placement)
    else:
        _plan_units(values, ctx, placement)


def _unit_value(key: str, value: str, ctx: PlanContext) -> str:
    """A kernel-form limit as the unit property takes it."""
    if key in ("memory_max", "memory_high"):
        return "infinity" if value == "max" else value
    if key == "cpu_max":
        quota, _, period = value.partition(" ")
        if quota == "max":
            return ""
        percent = int(quota) * 100 / int(period or 100000)
        if round(percent, 2) * int(period or 100000) != int(quota) * 100 or percent <= 0:
            raise ctx.error("cgroup.cpu_max", f"{value!r} is {percent:g}% of a CPU; "
                            "systemd's CPUQuota= takes a percentage with at most two "
                            "decimals, above 0")
        return f"{percent:g}%"
    if key in ("cpus", "mems"):
        return value.replace(" ", "")
    return value


def _plan_units(values: dict[str, str], ctx: PlanContext, placement: Placement) -> None:
    assert placement.units is not None
    names = {key: PROPERTIES[key].name for key in values}
    try:
        shown = placement.units.show(SLICE, [*names.values(), "MemoryCurrent"])
    except UnitError as error:
        raise ctx.error("cgroup", f"cannot read {SLICE}'s properties: {error}") from None
    _check_usage(ctx, values, shown.get("MemoryCurrent"))
    for key, value in values.items():
        path = unit_path(SLICE, names[key])
        desired = shown_form(names[key], _unit_value(key, value, ctx))
        current = ctx.baseline.get(path, shown.get(names[key]))
        if current is None:
            raise ctx.error(f"cgroup.{key}", f"systemd does not show {names[key]} for {SLICE}")
        # no runtime drop-in yet: rollback removes the one set-property writes
        restore = None if ctx.root.exists(dropin_path(SLICE, names[key])) else \
            UNSET + current
        change = Change(tuner="cgroup", path=path, current=current, desired=desired,
                        key=f"cgroup.{key}", compare="unit", restore=restore)
        if not matches(change, current):
            ctx.changes.append(change)


def shown_form(name: str, value: str) -> str:
    """A desired property value in the form ``Units.show`` reads back."""
    if name == "CPUQuota" or value == "":
        return value
    return normalise(name, value)


def _plan_files(values: dict[str, str], ctx: PlanContext,
                placement: CgroupfsPlacement) -> None:
    leaf = placement.limits_dir
    assert leaf is not None
    # memory.current exists once the memory controller is on for the leaf: not before
    usage = read_normalised(ctx.root, f"{leaf}/memory.current", "value") \
        if ctx.root.exists(f"{leaf}/memory.current") else None
    _check_usage(ctx, values, usage)
    defaults = {name: text for files in CONTROLLER_FILES.values() for name, text in
                files.items()}
    for key, value in values.items():
        path = placement.check(f"{leaf}/{FILE_OF[key]}")
        ctx.root.check_writable(path)
        compare = "cpulist" if key in ("cpus", "mems") else "value"
        current = ctx.baseline.get(path)
        if current is None:
            # before the leaf exists (prepared at apply or at the data plane's start) it
            # holds the kernel's defaults for a new cgroup
            current = ctx.current(path, f"cgroup.{key}", compare) if ctx.root.exists(path) \
                else read_default(defaults[FILE_OF[key]], compare)
        desired = _file_value(key, value, current, page_size(ctx.root.is_host, ctx.root.base))
        change = Change(tuner="cgroup", path=path, current=current, desired=desired,
                        key=f"cgroup.{key}", compare=compare)
        if not matches(change, current):
            ctx.changes.append(change)


def read_default(text: str, compare: str) -> str:
    return text if compare == "value" else ",".join(text.split())


def _file_value(key: str, value: str, current: str, page: int) -> str:
    """What the file reads back: whole pages for memory, ``quota period`` for cpu.max."""
    if key in ("memory_max", "memory_high") and value != "max":
        return str(int(value) // page * page)
    if key == "cpu_max" and " " not in value:
        return f"{value} {current.split()[1] if ' ' in current else 100000}"
    if key in ("cpus", "mems"):
        return format_cpulist(parse_cpulist(value))
    return value
