"""NPU load: rknpu per-core load (vendor RK3588 kernel) and Intel NPU busy time.

rknpu prints ``NPU load:  Core0: 12%, Core1:  0%, Core2:  0%,`` in debugfs (root) or procfs,
refreshed every second; the Intel NPU counts busy microseconds, so its utilisation is the
busy time over the wall time between two samples.  Other NPUs (Jetson DLA, Hailo, Coral,
Rocket) expose no load: their values are None.
"""

from __future__ import annotations

import time
from typing import Any

from agent.discovery.model import Npu, Topology
from agent.discovery.npu import RKNPU_DIRS
from agent.kernel.parsers import parse_rknpu_load
from agent.kernel.reader import SysReader
from agent.telemetry.collectors.base import Clock, Interval, percent, rate, rounded


def rknpu_load_file(reader: SysReader) -> str | None:
    """The first rknpu directory with a ``load`` file, as discovery chose it."""
    return next((f"{d}/load" for d in RKNPU_DIRS if reader.exists(f"{d}/load")), None)


class NpuCollector:
    key = "npus"

    def __init__(self, reader: SysReader, topology: Topology,
                 clock: Clock = time.monotonic) -> None:
        self._reader = reader
        self._interval = Interval(clock)
        rknpu_load = rknpu_load_file(reader) if any(
            npu.driver == "rknpu" for npu in topology.npus) else None
        # (name, rknpu load file, Intel NPU busy-time file)
        self._npus = [(npu.name, rknpu_load if npu.driver == "rknpu" else None,
                       _busy_time_file(npu)) for npu in topology.npus]
        self._busy_us: dict[str, int | None] = {}

    def collect(self) -> list[dict[str, Any]]:
        seconds = self._interval.elapsed()
        rows: list[dict[str, Any]] = []
        for name, load_file, busy_file in self._npus:
            util: float | None = None
            cores: list[float] | None = None
            if load_file is not None:
                load = self._reader.parsed(load_file, parse_rknpu_load)
                if load:
                    cores = [float(pct) for pct in load]
                    util = rounded(sum(cores) / len(cores))
            elif busy_file is not None:
                busy = self._reader.integer(busy_file)
                busy_per_s = rate(self._busy_us.get(busy_file), busy, seconds)
                self._busy_us[busy_file] = busy
                util = percent(busy_per_s, 1_000_000) if busy_per_s is not None else None
            rows.append({"name": name, "util_pct": util, "core_util_pct": cores})
        return rows


def _busy_time_file(npu: Npu) -> str | None:
    if npu.driver == "intel_vpu" and npu.sysfs:
        return f"{npu.sysfs}/npu_busy_time_us"
    return None
