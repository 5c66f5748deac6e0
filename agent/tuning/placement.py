"""Where the inference data plane runs, so the profile's cgroup limits apply to it alone.

- Under systemd (every supported board) systemd owns the tree: the data plane is a transient
  scope in ``edge_agent.slice`` and the limits are the slice's runtime properties
  (:mod:`agent.tuning.units`).
- Without systemd (a container) the agent's own cgroup is its delegated subtree, and
  cgroupfs's no-internal-process rule applies (Documentation/admin-guide/cgroup-v2.rst): the
  processes there move into the leaf ``edge-agent`` before controllers are enabled for the
  children, and the data plane gets the leaf ``inference``, where the limits are written.
  Nothing outside the subtree is written.
- Elsewhere (cgroup v1 or hybrid, no v2 tree) the data plane runs unplaced, and a profile's
  ``cgroup`` section is a plan-time error.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from agent.discovery.kernel import CGROUP
from agent.discovery.model import Topology
from agent.kernel.counters import parse_cgroup_path
from agent.kernel.fsroot import Root, WriteRefused
from agent.kernel.parsers import parse_memory_events
from agent.tuning.units import SCOPE_PREFIX, SLICE, Units

AGENT_LEAF = "edge-agent"  # the control plane's leaf (cgroupfs mode)
DATA_LEAF = "inference"  # the data plane's leaf (cgroupfs mode)
CONTROLLERS = ("cpu", "cpuset", "memory")
MEMORY_EVENTS = ("high", "max", "oom", "oom_kill")


class Placement:
    """No placement: the data plane runs where the agent runs."""

    mode = "none"

    def __init__(self, root: Root, reason: str) -> None:
        self.root, self.reason = root, reason
        self.units: Units | None = None
        self.limits_dir: str | None = None  # the cgroup (logical path) the limits are on

    def prepare(self) -> None:
        """Make the data plane's cgroup ready for limits; idempotent."""

    def command(self, argv: list[str], serial: int) -> list[str]:
        return argv

    def adopt(self, pid: int) -> None:
        """Move a freshly started data plane into its cgroup."""

    def memory_events(self) -> dict[str, int] | None:
        """The data plane's ``memory.events`` (hierarchical: every restart of it counts)."""
        if self.limits_dir is None:
            return None
        try:
            return parse_memory_events(self.root.read_text(f"{self.limits_dir}/memory.events"))
        except (OSError, ValueError):
            return None

    def describe(self) -> dict[str, str | None]:
        return {"mode": self.mode, "cgroup": self.limits_dir,
                "reason": self.reason if self.mode == "none" else None}


class SystemdPlacement(Placement):
    mode = "systemd"

    def __init__(self, root: Root, units: Units) -> None:
        super().__init__(root, "")
        self.units = units
        self.limits_dir = f"{CGROUP}/{SLICE}"

    def command(self, argv: list[str], serial: int) -> list[str]:
        assert self.units is not None
        if not self.units.spawns:  # a fixture root's model: the child runs where we run
            return argv
        # unique per start: the scope of a process just ended may not be collected yet
        return self.units.scope_command(f"{SCOPE_PREFIX}{os.getpid()}-{serial}.scope", argv)


class CgroupfsPlacement(Placement):
    mode = "cgroupfs"

    def __init__(self, root: Root, subtree: str) -> None:
        super().__init__(root, "")
        self.subtree = subtree.rstrip("/")
        self.limits_dir = f"{self.subtree}/{DATA_LEAF}"

    def check(self, path: str) -> str:
        """Refuse a write outside the agent's delegated subtree."""
        if ".." in path.split("/") or not path.startswith(self.subtree + "/"):
            raise WriteRefused(errno.EPERM, f"{path}: outside the agent's cgroup subtree "
                               f"{self.subtree}; refused")
        return path

    def offered(self) -> list[str]:
        return self.root.read_text(f"{self.subtree}/cgroup.controllers").split()

    def enabled(self) -> list[str]:
        return self.root.read_text(f"{self.subtree}/cgroup.subtree_control").split()

    def prepare(self) -> None:
        """Leaf first, then controllers, then the data plane's leaf: the kernel refuses
        ``+memory`` in ``cgroup.subtree_control`` while the cgroup holds any process."""
        root, subtree = self.root, self.subtree
        is_real_root = not root.exists(f"{subtree}/cgroup.type")  # exempt from the rule
        wanted = [c for c in CONTROLLERS if c in self.offered() and c not in self.enabled()]
        if wanted and not is_real_root:
            leaf = self.check(f"{subtree}/{AGENT_LEAF}")
            root.mkdir(leaf)
            pids = root.read_text(f"{subtree}/cgroup.procs").split()
            for pid in dict.fromkeys([*pids, str(os.getpid())]):  # one pid per write
                try:
                    root.write_text(f"{leaf}/cgroup.procs", pid)
                except ProcessLookupError:
                    continue  # it ended meanwhile
        if wanted:
            root.write_text(self.check(f"{subtree}/cgroup.subtree_control"),
                            " ".join(f"+{c}" for c in wanted))
        root.mkdir(self.check(f"{subtree}/{DATA_LEAF}"))

    def adopt(self, pid: int) -> None:
        self.root.write_text(self.check(f"{self.limits_dir}/cgroup.procs"), str(pid))


def own_cgroup(root: Root) -> str | None:
    """The agent's cgroup v2 directory (logical), its ``edge-agent`` leaf counted as the
    subtree it was delegated."""
    try:
        relative = parse_cgroup_path(root.read_text("/proc/self/cgroup"))
    except (OSError, ValueError):
        return None
    directory = (CGROUP + relative).rstrip("/")
    if directory.rsplit("/", 1)[-1] == AGENT_LEAF:
        directory = directory.rsplit("/", 1)[0]
    return directory


def systemd_runs(root: Root, own: str | None) -> bool:
    """sd_booted(3) on the host; below a fixture root, an agent cgroup named like a unit."""
    if root.is_host:
        return Path("/run/systemd/system").is_dir()
    return root.is_dir("/run/systemd/system") or (own or "").endswith((".service", ".scope"))


def detect(root: Root, topology: Topology, units: Units | None = None) -> Placement:
    """The placement for this device; ``units`` replaces systemd (tests, fakes)."""
    if topology.kernel.cgroup_mode != "v2":
        return Placement(root, f"needs a cgroup v2 hierarchy; this device has "
                         f"{topology.kernel.cgroup_mode or 'none'}")
    own = own_cgroup(root)
    if units is not None or systemd_runs(root, own):
        if units is None:
            from agent.tuning.units_model import DropInUnits

            units = Units() if root.is_host else DropInUnits(root)
        return SystemdPlacement(root, units)
    if own is None or not root.is_dir(own):
        return Placement(root, "the agent's own cgroup is unknown (/proc/self/cgroup)")
    return CgroupfsPlacement(root, own)
