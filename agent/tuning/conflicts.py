"""Plan-time conflicts between sections: settings that each look right alone and together
contradict, refused before anything is written, naming both keys.

- Two keys resolving to the same file: the same value is planned once; different values are
  refused (on a board whose cores are all alike ``cluster:big`` and ``cluster:little`` name
  the same CPUs, so their policies are the same files).
- A frequency floor above a ceiling of the same cpufreq policy or devfreq node set by another
  key (``cluster:big: {min_khz: max}`` with ``cluster:little: {max_khz: min}`` on such a
  board): after both writes the kernel resolves the pair its own way (newer kernels let max
  win, older ones refuse), which pins every core at the floor of the two.
- A cgroup ``cpus`` (the data plane's cpuset) that leaves out the CPUs ``rt.inference.cpus``
  puts the inference threads on: the kernel would keep them off those CPUs.
"""

from __future__ import annotations

from typing import Any

from agent.discovery.model import Topology
from agent.kernel.parsers import format_cpulist
from agent.tuning.errors import ProfileError
from agent.tuning.plan import Change
from agent.tuning.values import resolve_cpus

# a floor file and its ceiling in the same directory (cpufreq policy, devfreq node)
LIMIT_PAIRS = (("scaling_min_freq", "scaling_max_freq"), ("min_freq", "max_freq"))


def _same_file(file: str, changes: list[Change]) -> list[Change]:
    """The changes with each path once; a second key with another value is refused."""
    first: dict[str, Change] = {}
    kept = []
    for change in changes:
        other = first.get(change.path)
        if other is None:
            first[change.path] = change
            kept.append(change)
            continue
        if other.desired == change.desired and other.compare == change.compare:
            continue  # two keys asking for the same value: planned once
        raise ProfileError(file, change.key, f"{change.path} is set twice with contradicting "
                           f"values: {other.key} asks for {other.desired!r}, {change.key} "
                           f"for {change.desired!r} (both resolve to this file here); set it "
                           "in one place")
    return kept


def _limits(file: str, changes: list[Change]) -> None:
    by_path = {c.path: c for c in changes}
    for change in changes:
        directory, _, name = change.path.rpartition("/")
        for floor, ceiling in LIMIT_PAIRS:
            high = by_path.get(f"{directory}/{ceiling}")
            if name != floor or high is None or high.key == change.key:
                continue
            if change.desired.isdigit() and high.desired.isdigit() and \
                    int(change.desired) > int(high.desired):
                raise ProfileError(file, change.key, f"{change.key} raises the floor of "
                                   f"{directory} to {change.desired}, above the ceiling "
                                   f"{high.desired} that {high.key} sets there (both name "
                                   "the same CPUs or node on this device); set them in one "
                                   "place")


def _cgroup_cpus(file: str, settings: dict[str, Any], topology: Topology,
                 cpus: dict[str, list[int]]) -> None:
    selector = settings.get("cgroup", {}).get("cpus")
    inference = cpus.get("inference")
    if selector is None or not inference:
        return
    try:
        allowed = set(resolve_cpus(str(selector), topology, cpus.get("housekeeping")))
    except ValueError:
        return  # the cgroup tuner has said why
    outside = sorted(set(inference) - allowed)
    if outside:
        raise ProfileError(file, "cgroup.cpus", f"{selector} ({format_cpulist(sorted(allowed))})"
                           f" leaves out CPUs {format_cpulist(outside)} that rt.inference.cpus "
                           f"({format_cpulist(inference)}) runs inference on: the data "
                           "plane's cpuset would keep its threads off them; include them, or "
                           "narrow rt.inference.cpus")


def check(file: str, changes: list[Change], settings: dict[str, Any], topology: Topology,
          cpus: dict[str, list[int]]) -> list[Change]:
    """The plan's changes, each file once; ProfileError naming both keys on a conflict."""
    kept = _same_file(file, changes)
    _limits(file, kept)
    _cgroup_cpus(file, settings, topology, cpus)
    return kept
