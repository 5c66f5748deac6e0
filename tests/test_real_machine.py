"""Discovery on this machine's real / against independent sources of the same facts."""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path

import psutil
import pytest

from agent.discovery import Topology, discover
from agent.kernel.fsroot import Root


@pytest.fixture(scope="module")
def topology() -> Topology:
    return discover(Root("/"))


def test_cpu_count_and_online(topology: Topology) -> None:
    # os.cpu_count() counts online CPUs (sysconf _SC_NPROCESSORS_ONLN).
    assert len(topology.cpu.online) == os.cpu_count()
    assert topology.cpu.count == len(topology.cpu.online) + len(topology.cpu.offline)
    assert sorted(c for cl in topology.cpu.clusters for c in cl.cpus) == \
        list(range(topology.cpu.count))


def test_memory_matches_psutil(topology: Topology) -> None:
    assert topology.memory.total_bytes == psutil.virtual_memory().total


def test_kernel_release_matches_platform(topology: Topology) -> None:
    assert topology.kernel.release == platform.release()
    assert topology.kernel.version == platform.version()


def test_thp_as_the_file_says(topology: Topology) -> None:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not path.exists():
        assert topology.kernel.thp.enabled is None
        return
    selected = re.search(r"\[(\w+)\]", path.read_text())
    assert selected is not None
    assert topology.kernel.thp.enabled == selected.group(1)


def test_cgroup_mode_matches_mounts(topology: Topology) -> None:
    fstypes = {fields[1]: fields[2] for fields in
               (line.split() for line in Path("/proc/mounts").read_text().splitlines())}
    assert topology.kernel.cgroup_v2 == (fstypes.get("/sys/fs/cgroup") == "cgroup2")


def test_block_devices_match_sys_block(topology: Topology) -> None:
    expected = {name for name in os.listdir("/sys/block")
                if os.path.exists(f"/sys/block/{name}/device")
                and not re.match(r"^(loop|ram|zram|mtdblock)\d+$", name)}
    assert {b.name for b in topology.block} == expected


def test_pci_devices_match_sysfs(topology: Topology) -> None:
    pci = Path("/sys/bus/pci/devices")
    expected = sorted(os.listdir(pci)) if pci.exists() else []
    assert [d.bdf for d in topology.pci] == expected


def test_numa_nodes_cover_all_cpus(topology: Topology) -> None:
    if topology.memory.numa_nodes:
        covered = sorted(c for node in topology.memory.numa_nodes for c in node.cpus)
        assert covered == sorted(topology.cpu.online)


def test_board_family_matches_architecture(topology: Topology) -> None:
    if platform.machine() == "x86_64":
        assert topology.board.family == "x86"
        assert topology.board.arch == "x86_64"


def test_no_nvidia_gpu_reported_without_nvidia_pci_device(topology: Topology) -> None:
    nvidia_pci = [d for d in topology.pci if d.vendor_id == "0x10de"]
    assert len([g for g in topology.gpus if g.vendor == "nvidia"]) == len(
        [d for d in nvidia_pci if (d.class_ or "").startswith("0x03")])
