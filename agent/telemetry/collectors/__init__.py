"""Telemetry collectors: one per kernel source, registered in :func:`build_collectors`.

Each collector is built once from the discovered topology, resolves the files it needs up
front, and reads only values per sample, through the same :class:`~agent.kernel.fsroot.Root` as
discovery, so a fixture tree can stand in for the device.
"""

from __future__ import annotations

from agent.discovery.model import Topology
from agent.kernel.fsroot import Root
from agent.kernel.reader import SysReader
from agent.telemetry.collectors.base import Collector
from agent.telemetry.collectors.block import BlockCollector
from agent.telemetry.collectors.cgroup import CgroupCollector
from agent.telemetry.collectors.cpu import CpuCollector
from agent.telemetry.collectors.fans import FanCollector
from agent.telemetry.collectors.gpu import GpuCollector, default_nvml
from agent.telemetry.collectors.load import LoadCollector
from agent.telemetry.collectors.memory import MemoryCollector, SwapCollector
from agent.telemetry.collectors.net import NetCollector
from agent.telemetry.collectors.npu import NpuCollector
from agent.telemetry.collectors.nvml import NvmlGpuSample, NvmlTelemetry, PynvmlTelemetry
from agent.telemetry.collectors.power import PowerCollector
from agent.telemetry.collectors.psi import PsiCollector
from agent.telemetry.collectors.thermal import ThermalCollector
from agent.telemetry.collectors.thp import ThpCollector
from agent.telemetry.groups import COLLECTOR_GROUPS, METRIC_GROUPS

__all__ = ["COLLECTOR_GROUPS", "METRIC_GROUPS", "Collector", "NvmlGpuSample", "NvmlTelemetry",
           "PynvmlTelemetry", "build_collectors"]


def build_collectors(root: Root, topology: Topology, nvml: NvmlTelemetry | None = None,
                     data_plane_cgroup: str | None = None) -> list[Collector]:
    """Every collector, in the order of telemetry ``metrics`` (``COLLECTOR_GROUPS`` names
    them).  ``nvml`` defaults to the real
    driver on the host root when the topology has an NVIDIA discrete GPU.
    ``data_plane_cgroup``: the data plane's cgroup directory, reported in ``cgroup``."""
    reader = SysReader(root)
    return [
        CpuCollector(reader, topology),
        LoadCollector(reader),
        MemoryCollector(reader),
        SwapCollector(reader),
        PsiCollector(reader),
        CgroupCollector(reader, topology, data_plane=data_plane_cgroup),
        ThermalCollector(reader, topology),
        PowerCollector(reader, topology),
        FanCollector(reader, topology),
        GpuCollector(reader, topology, nvml or default_nvml(root, topology)),
        NpuCollector(reader, topology),
        BlockCollector(reader, topology),
        NetCollector(reader),
        ThpCollector(reader),
    ]
