"""A readable one-screen summary of a Topology for a person at a terminal."""

from __future__ import annotations

from itertools import groupby

from agent.discovery.model import Cluster, PowerRail, Topology
from agent.kernel.parsers import format_cpulist


def _mhz(low: int | None, high: int | None, per_mhz: int) -> str:
    if low is None and high is None:
        return "freq n/a"
    if low is None and high is not None:
        return f"up to {high // per_mhz} MHz"
    fmt = [f"{v // per_mhz}" if v is not None else "?" for v in (low, high)]
    return f"{fmt[0]}-{fmt[1]} MHz"


def _cluster_key(cluster: Cluster) -> tuple[object, ...]:
    return (cluster.core_type, cluster.core_name, cluster.min_khz, cluster.max_khz,
            cluster.governor, cluster.scaling_driver, bool(cluster.online_cpus))


def _cpu_lines(topology: Topology) -> list[str]:
    cpu = topology.cpu
    head = f"{cpu.count} CPUs, online {format_cpulist(cpu.online) or 'none'}"
    if cpu.offline:
        head += f", offline {format_cpulist(cpu.offline)}"
    if cpu.isolated:
        head += f", isolated {format_cpulist(cpu.isolated)}"
    lines = [head]
    # x86 drivers make one policy per CPU: show identical neighbours as one line.
    for _, group in groupby(cpu.clusters, key=_cluster_key):
        members = list(group)
        first = members[0]
        cpus = format_cpulist([c for m in members for c in m.cpus])
        policies = (f"{len(members)} policies" if len(members) > 1
                    else first.policy or "no cpufreq")
        kind = " ".join(p for p in (first.core_type, first.core_name) if p)
        limit = ""
        if first.scaling_max_khz and first.max_khz and first.scaling_max_khz < first.max_khz:
            limit = f" (capped at {first.scaling_max_khz // 1000} MHz)"
        state = "" if first.online_cpus else " (offline)"
        lines.append(f"  cpu {cpus:<8} {kind:<22} {_mhz(first.min_khz, first.max_khz, 1000)}"
                     f"{limit}  {first.governor or ''}  [{policies}]{state}")
    if cpu.idle_states:
        states = ", ".join(f"{s.name} ({s.latency_us} µs)" + (" disabled" if s.disabled else "")
                           for s in cpu.idle_states)
        lines.append(f"  idle: {states}")
    return lines


def _rail(rail: PowerRail) -> str:
    parts = [rail.name]
    if rail.voltage_mv is not None:
        parts.append(f"{rail.voltage_mv / 1000:.2f} V")
    if rail.power_mw is not None:
        parts.append(f"{rail.power_mw / 1000:.2f} W")
    return " ".join(parts) + f" ({rail.source})"


def render_summary(topology: Topology) -> str:
    board, kernel, memory = topology.board, topology.kernel, topology.memory
    rows: list[tuple[str, list[str]]] = []
    title = board.model or board.module_name or (
        "virtual machine" if board.virtual else "unknown board")
    detail = " ".join(p for p in (board.family, board.soc, f"({board.arch})" if board.arch
                                  else None) if p)
    if board.l4t:
        detail += f", L4T {board.l4t}" + (f" / JetPack {board.jetpack}" if board.jetpack else "")
    rows.append(("Board", [f"{title} — {detail}"]))
    thp = kernel.thp.enabled or "n/a"
    if kernel.thp.cmdline:
        thp += " (set on cmdline)"
    uring = kernel.io_uring_status or {True: "yes", False: "no", None: "unknown"}[
        kernel.io_uring]
    realtime = " (real-time)" if kernel.preempt_rt else ""
    rows.append(("Kernel", [
        f"{kernel.release} preempt {kernel.preempt_model or 'unknown'}{realtime}"
        f" · cgroup {kernel.cgroup_mode or 'n/a'} · THP {thp}"
        f" · PSI {'yes' if kernel.psi else 'no'} · io_uring {uring}"]))
    rows.append(("CPU", _cpu_lines(topology)))
    gib = f"{memory.total_bytes / 2**30:.1f} GiB" if memory.total_bytes else "unknown"
    rows.append(("Memory", [f"{gib}, {len(memory.numa_nodes) or 1} NUMA node(s)"]))
    rows.append(("GPU", [
        f"{g.name} ({g.vendor}, {g.kind})" + (f" devfreq {g.devfreq}" if g.devfreq else "")
        + (f" {g.drm_card}" if g.drm_card else "")
        + (f" {g.pci_bdf}" if g.pci_bdf else "") + (f" NUMA {g.numa_node}"
                                                  if g.numa_node is not None else "")
        + (f" {_mhz(g.min_hz, g.max_hz, 1_000_000)}" if g.max_hz else "")
        + (f" {g.memory_bytes / 2**30:.0f} GiB" if g.memory_bytes else "")
        + (f" (limit {_mhz(g.limit_min_hz, g.limit_max_hz, 1_000_000)})"
           if g.limit_max_hz and g.limit_max_hz != g.max_hz else "")
        + (f" {g.governor}" if g.governor else "") for g in topology.gpus] or ["none"]))
    rows.append(("NPU", [
        f"{n.name} ({n.vendor or n.driver})"
        + (f" {n.cores} core{'s' if n.cores > 1 else ''}" if n.cores else "")
        + (f" {n.device}" if n.device else "")
        + (f" {_mhz(n.min_hz, n.max_hz, 1_000_000)}" if n.max_hz else "")
        + (f" load {'/'.join(map(str, n.load_pct))} %" if n.load_pct else "")
        for n in topology.npus] or ["none"]))
    runtimes = [f"{name} {found.version or '?'}" for name, found in (
        ("librknnrt", topology.runtimes.librknnrt), ("TensorRT", topology.runtimes.tensorrt),
        ("CUDA", topology.runtimes.cuda), ("OpenVINO", topology.runtimes.openvino),
        ("onnxruntime", topology.runtimes.onnxruntime)) if found is not None]
    rows.append(("Runtimes", [" · ".join(runtimes) or "none"]))
    rows.append(("Thermal", [" · ".join(
        f"{z.name} {z.temp_c:.1f} °C" if z.temp_c is not None else f"{z.name} off"
        for z in topology.thermal) or "none"]))
    rows.append(("Power", [_rail(r) for r in topology.power_rails] or ["none"]))
    rows.append(("Fans", [f.name + (f" pwm {f.pwm}/255" if f.pwm is not None else "")
                          + (f" {f.rpm} rpm" if f.rpm is not None else "")
                          for f in topology.fans] or ["none"]))
    rows.append(("Block", [
        f"{b.name} {b.model or ''} [{b.scheduler}] nr_requests {b.nr_requests}"
        f"{f' of {b.tag_depth} tags' if b.tag_depth else ''} read-ahead {b.read_ahead_kb} KiB"
        f"{f', {b.poll_queues} poll queues' if b.poll_queues else ''}"
        for b in topology.block] or ["none"]))
    rows.append(("PCI", [f"{len(topology.pci)} devices"]))
    if topology.warnings:
        rows.append(("Warnings", topology.warnings))
    lines = []
    for label, values in rows:
        for index, value in enumerate(values):
            lines.append(f"{label if index == 0 else '':<9} {value}".rstrip())
    return "\n".join(lines)
