"""CPUs: online/offline sets, clusters from cpufreq policies, core types, idle states.

A cluster is a cpufreq policy.  Its CPUs are ``related_cpus`` (offline ones included, since a
power mode may take a whole cluster down); when an inactive policy refuses reads (EBUSY), the
``cpuN/cpufreq`` links, which exist for every present CPU, still tell membership.
"""

from __future__ import annotations

import re

from agent.discovery.model import Cluster, Cpu, IdleState
from agent.kernel import parsers
from agent.kernel.reader import SysReader

CPU = "/sys/devices/system/cpu"

# (implementer, part) from /proc/cpuinfo -> core name.
ARM_CORES = {
    ("0x41", "0xd03"): "Cortex-A53", ("0x41", "0xd04"): "Cortex-A35",
    ("0x41", "0xd05"): "Cortex-A55", ("0x41", "0xd07"): "Cortex-A57",
    ("0x41", "0xd08"): "Cortex-A72", ("0x41", "0xd09"): "Cortex-A73",
    ("0x41", "0xd0a"): "Cortex-A75", ("0x41", "0xd0b"): "Cortex-A76",
    ("0x41", "0xd0d"): "Cortex-A77", ("0x41", "0xd41"): "Cortex-A78",
    ("0x41", "0xd42"): "Cortex-A78AE", ("0x41", "0xd44"): "Cortex-X1",
    ("0x41", "0xd46"): "Cortex-A510", ("0x41", "0xd47"): "Cortex-A710",
    ("0x41", "0xd48"): "Cortex-X2", ("0x41", "0xd4d"): "Cortex-A715",
    ("0x41", "0xd4e"): "Cortex-X3", ("0x41", "0xd80"): "Cortex-A520",
    ("0x41", "0xd81"): "Cortex-A720", ("0x41", "0xd82"): "Cortex-X4",
    ("0x41", "0xd0c"): "Neoverse-N1", ("0x41", "0xd40"): "Neoverse-V1",
    ("0x41", "0xd49"): "Neoverse-N2", ("0x41", "0xd4f"): "Neoverse-V2",
    ("0x4e", "0x003"): "Denver 2", ("0x4e", "0x004"): "Carmel",
}

_CAPACITY_TYPES = {1: ["uniform"], 2: ["little", "big"], 3: ["little", "mid", "big"]}


def _core_names(reader: SysReader, cpuinfo: list[dict[str, str]]) -> dict[int, str]:
    names: dict[int, str] = {}
    for block in cpuinfo:
        key = (block.get("CPU implementer", ""), block.get("CPU part", ""))
        if key in ARM_CORES and block["processor"].isdigit():
            names[int(block["processor"])] = ARM_CORES[key]
    # Intel hybrid parts list their P- and E-cores as separate PMUs.
    for pmu, label in (("cpu_core", "P-core"), ("cpu_atom", "E-core")):
        if reader.exists(f"/sys/devices/{pmu}/cpus"):
            for cpu in reader.cpulist(f"/sys/devices/{pmu}/cpus") or []:
                names[cpu] = label
    return names


def _policy_index(path: str) -> int:
    match = re.search(r"policy(\d+)$", path)
    return int(match.group(1)) if match else -1


def _policy_members(reader: SysReader, policy: str, present: list[int]) -> list[int]:
    related = reader.parsed(f"{policy}/related_cpus", parsers.parse_cpus_spaced)
    if related:
        return related
    return [cpu for cpu in present if reader.realpath(f"{CPU}/cpu{cpu}/cpufreq") == policy]


def _first_known(reader: SysReader, paths: list[str]) -> int | None:
    """The first value that parses; every path is read so one CPU's garbage is warned
    about without losing the cluster's value."""
    values = [reader.integer(path) for path in paths]
    return next((value for value in values if value is not None), None)


def _read_idle_states(reader: SysReader, cpus: list[int]) -> list[IdleState]:
    """Idle states of a cluster's online CPUs; ``disabled_cpus`` lists every CPU that
    disabled one, since ``disable`` is per CPU."""
    if not cpus:
        return []
    state_dirs = sorted(reader.glob(f"{CPU}/cpu{cpus[0]}/cpuidle/state*"),
                        key=lambda p: int(p.rsplit("state", 1)[1]))
    states: list[IdleState] = []
    for path in state_dirs:
        state = path.rsplit("/", 1)[1]
        per_cpu = [f"{CPU}/cpu{cpu}/cpuidle/{state}" for cpu in cpus]
        disable = {cpu: reader.integer(f"{d}/disable") for cpu, d in zip(cpus, per_cpu,
                                                                          strict=True)}
        disabled_cpus = [cpu for cpu, value in disable.items() if value == 1]
        states.append(IdleState(
            name=reader.text(f"{path}/name") or state,
            latency_us=_first_known(reader, [f"{d}/latency" for d in per_cpu]),
            residency_us=_first_known(reader, [f"{d}/residency" for d in per_cpu]),
            disabled=None if all(v is None for v in disable.values()) else bool(disabled_cpus),
            state=state, disabled_cpus=disabled_cpus))
    return states


def _merge_idle_states(clusters: list[Cluster]) -> list[IdleState]:
    """System-wide view: states of the first cluster, disabled anywhere counts as disabled."""
    active = [c for c in clusters if c.idle_states]
    if not active:
        return []
    merged = []
    for state in active[0].idle_states:
        disabled_cpus = sorted({cpu for c in active for s in c.idle_states
                                if s.state == state.state for cpu in s.disabled_cpus})
        merged.append(IdleState(name=state.name, latency_us=state.latency_us,
                                residency_us=state.residency_us,
                                disabled=bool(disabled_cpus) if state.disabled is not None
                                else None, state=state.state, disabled_cpus=disabled_cpus))
    return merged


def _read_cluster(reader: SysReader, index: int, policy: str | None, cpus: list[int],
                  online: set[int]) -> Cluster:
    online_cpus = [cpu for cpu in cpus if cpu in online]
    cluster = Cluster(id=index, cpus=cpus, policy=policy.rsplit("/", 1)[1] if policy else None,
                      core_type=None, min_khz=None, max_khz=None, available_khz=None,
                      governor=None, available_governors=None, online_cpus=online_cpus)
    if policy:
        cluster.min_khz = reader.integer(f"{policy}/cpuinfo_min_freq")
        cluster.max_khz = reader.integer(f"{policy}/cpuinfo_max_freq")
        available = reader.integers(f"{policy}/scaling_available_frequencies")
        cluster.available_khz = sorted(available) if available else None
        cluster.governor = reader.text(f"{policy}/scaling_governor")
        cluster.available_governors = reader.words(f"{policy}/scaling_available_governors")
        cluster.scaling_min_khz = reader.integer(f"{policy}/scaling_min_freq")
        cluster.scaling_max_khz = reader.integer(f"{policy}/scaling_max_freq")
        cluster.cur_khz = reader.integer(f"{policy}/scaling_cur_freq")
        cluster.scaling_driver = reader.text(f"{policy}/scaling_driver")
    cluster.idle_states = _read_idle_states(reader, online_cpus)
    return cluster


def _assign_core_types(clusters: list[Cluster], names: dict[int, str]) -> None:
    hybrid = {"P-core": "big", "E-core": "little"}
    capacities = sorted({c.capacity for c in clusters if c.capacity is not None})
    for cluster in clusters:
        cluster.core_name = next((names[c] for c in cluster.cpus if c in names), None)
    # /proc/cpuinfo omits offline CPUs: name them after a cluster of the same capacity.
    for cluster in clusters:
        if cluster.core_name is None:
            twins = {c.core_name for c in clusters
                     if c.core_name and c.capacity == cluster.capacity}
            cluster.core_name = twins.pop() if len(twins) == 1 else None
    for cluster in clusters:
        if cluster.core_name in hybrid:
            cluster.core_type = hybrid[cluster.core_name]
        elif cluster.capacity is not None and len(capacities) in _CAPACITY_TYPES:
            cluster.core_type = _CAPACITY_TYPES[len(capacities)][
                capacities.index(cluster.capacity)]
        elif cluster.capacity is not None:
            rank = capacities.index(cluster.capacity)
            cluster.core_type = ("little" if rank == 0 else
                                 "big" if rank == len(capacities) - 1 else "mid")
        else:
            cluster.core_type = "uniform"


def discover_cpu(reader: SysReader, cpuinfo: list[dict[str, str]]) -> Cpu:
    present = reader.cpulist(f"{CPU}/present")
    if not present:
        present = sorted(int(name[3:]) for name in reader.listdir(CPU)
                         if re.fullmatch(r"cpu\d+", name))
    online_list = reader.cpulist(f"{CPU}/online")
    online = set(present if online_list is None else online_list)
    names = _core_names(reader, cpuinfo)
    capacity = {cpu: reader.integer(f"{CPU}/cpu{cpu}/cpu_capacity")
                for cpu in present if reader.exists(f"{CPU}/cpu{cpu}/cpu_capacity")}

    clusters: list[Cluster] = []
    covered: set[int] = set()
    for policy in sorted(reader.glob(f"{CPU}/cpufreq/policy*"), key=_policy_index):
        cpus = sorted(set(_policy_members(reader, policy, present)) - covered)
        if not cpus:
            reader.warn(f"{policy}: no CPUs found for this policy")
            continue
        covered.update(cpus)
        clusters.append(_read_cluster(reader, len(clusters), policy, cpus, online))

    # Without cpufreq (VMs, missing driver) group the remaining CPUs by core kind.
    leftover: dict[tuple[int | None, str | None], list[int]] = {}
    for cpu in present:
        if cpu not in covered:
            leftover.setdefault((capacity.get(cpu), names.get(cpu)), []).append(cpu)
    for cpus in leftover.values():
        clusters.append(_read_cluster(reader, len(clusters), None, cpus, online))

    for cluster in clusters:
        known = [value for cpu in cluster.cpus if (value := capacity.get(cpu)) is not None]
        cluster.capacity = max(known) if known else None
    _assign_core_types(clusters, names)

    return Cpu(count=len(present), online=sorted(online),
               offline=sorted(set(present) - online),
               isolated=reader.cpulist(f"{CPU}/isolated") or [],
               clusters=clusters, idle_states=_merge_idle_states(clusters),
               idle_driver=reader.text(f"{CPU}/cpuidle/current_driver"))
