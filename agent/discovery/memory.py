"""Memory size and NUMA nodes."""

from __future__ import annotations

import re

from agent.discovery.model import Memory, NumaNode
from agent.kernel import parsers
from agent.kernel.reader import SysReader

NODES = "/sys/devices/system/node"


def discover_memory(reader: SysReader) -> Memory:
    meminfo = reader.parsed("/proc/meminfo", parsers.parse_meminfo) or {}
    if "MemTotal" not in meminfo:
        reader.warn("/proc/meminfo: no MemTotal line")
    nodes = []
    for path in reader.glob(f"{NODES}/node*"):
        match = re.search(r"node(\d+)$", path)
        if not match:
            continue
        node_meminfo = reader.parsed(f"{path}/meminfo", parsers.parse_meminfo) or {}
        nodes.append(NumaNode(id=int(match.group(1)),
                              cpus=reader.cpulist(f"{path}/cpulist") or [],
                              total_bytes=node_meminfo.get("MemTotal")))
    nodes.sort(key=lambda node: node.id)
    return Memory(total_bytes=meminfo.get("MemTotal"),
                  swap_total_bytes=meminfo.get("SwapTotal"), numa_nodes=nodes)
