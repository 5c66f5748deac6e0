"""Hardware discovery: reads sysfs/procfs through a Root and returns a Topology.

Nothing here imports onnxruntime or paho: ``edge-agent discover`` must start fast.
"""

from __future__ import annotations

from agent.discovery.block import discover_block
from agent.discovery.board import discover_board
from agent.discovery.cpu import discover_cpu
from agent.discovery.gpu import discover_gpus
from agent.discovery.kernel import discover_kernel
from agent.discovery.memory import discover_memory
from agent.discovery.model import Topology, Udev, UdevDeviceInfo
from agent.discovery.npu import discover_npus
from agent.discovery.nvml import NvmlSource, PynvmlSource
from agent.discovery.pci import discover_pci
from agent.discovery.power import discover_power
from agent.discovery.runtimes import discover_runtimes
from agent.discovery.thermal import discover_thermal
from agent.kernel import parsers
from agent.kernel.fsroot import Root
from agent.kernel.reader import SysReader

__all__ = ["Topology", "discover"]


def _udev(reader: SysReader) -> Udev:
    """udev's view of accelerators when it runs on this host; sysfs alone under a fixture."""
    from agent.discovery import udev

    if not reader.root.is_host or not udev.udev_running():
        return Udev(used=False)
    try:
        found = udev.enumerate_devices()
    except udev.UdevUnavailable as error:
        reader.warn(f"udev: {error}")
        return Udev(used=False)
    return Udev(used=True, devices=[
        UdevDeviceInfo(subsystem=d.subsystem, sys_name=d.sys_name, devnode=d.devnode,
                       driver=d.driver) for d in found])


def discover(root: Root, nvml: NvmlSource | None = None) -> Topology:
    """Read the whole topology.  ``nvml`` defaults to the real driver on the host root only:
    a fixture tree must not be mixed with the host's GPUs."""
    if nvml is None and root.is_host:
        nvml = PynvmlSource()
    reader = SysReader(root)
    cpuinfo = reader.parsed("/proc/cpuinfo", parsers.parse_cpuinfo) or []
    board = discover_board(reader, cpuinfo)
    pci = discover_pci(reader)
    rails, fans = discover_power(reader)
    return Topology(
        board=board, cpu=discover_cpu(reader, cpuinfo), memory=discover_memory(reader),
        gpus=discover_gpus(reader, pci, nvml), npus=discover_npus(reader, board.soc, pci),
        thermal=discover_thermal(reader), power_rails=rails, fans=fans,
        block=discover_block(reader), pci=pci, kernel=discover_kernel(reader),
        udev=_udev(reader), root=str(root.base), warnings=reader.warnings,
        runtimes=discover_runtimes(reader))
