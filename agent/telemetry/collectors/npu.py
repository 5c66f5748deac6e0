"""NPU load and engine activity: rknpu per-core load (vendor RK3588 kernel), Intel NPU busy
time, Jetson DLA clock state.

rknpu prints ``NPU load:  Core0: 12%, Core1:  0%, Core2:  0%,`` in debugfs (root) or procfs,
refreshed every second (``"%2.d%%,"`` per core, so a value is padded to two columns).  The
drivers that clamp print at most 100; older ones and a busy time counted across the
refresh window print more: such a core is reported as None (a warning names the file),
never clamped into a plausible 100, and ``util_pct`` is the mean of the cores that are left.
The Intel NPU counts busy microseconds, so its utilisation is the busy time over the wall
time between two samples; ``active`` is its runtime-PM state (rknpu: its ``power`` file).
A Jetson DLA has no load counter: ``active`` is its runtime-PM state, or, where debugfs
shows its clock (``/sys/kernel/debug/clk/dla<N>_core/{clk_enable_count,clk_rate}``),
whether the engine is clocked, with the rate; BPMP's ``bpmp/debug/clk/dla<N>_core/rate``
(Orin) gives the rate alone.  Other NPUs (Hailo, Coral, Rocket)
expose no load: their values are None.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

from agent.discovery.gpu import DEVFREQ
from agent.discovery.model import Npu, Topology
from agent.discovery.npu import RKNPU_DIRS
from agent.kernel.parsers import parse_rknpu_load
from agent.kernel.reader import SysReader
from agent.telemetry.collectors.base import Clock, Interval, percent, rate, resolved, rounded

FIELDS = ("name", "util_pct", "core_util_pct", "freq_hz", "active")
DEBUGFS_CLK = "/sys/kernel/debug/clk"
BPMP_CLK = "/sys/kernel/debug/bpmp/debug/clk"
MAX_CORE_PCT = 100
# rknpu's debugfs ``power`` and runtime PM's ``runtime_status`` words; others (resuming,
# error, unsupported, garbage) say nothing about whether the engine is up: None.
POWER_STATES = {"on": True, "off": False, "active": True, "suspended": False,
                "suspending": False}


def npu_row(name: str, **values: Any) -> dict[str, Any]:
    """One ``npus`` entry with every field, None where the source has no value."""
    return {**dict.fromkeys(FIELDS), "name": name, **values}


def rknpu_load_file(reader: SysReader) -> str | None:
    """The first rknpu directory with a ``load`` file, as discovery chose it."""
    return next((f"{d}/load" for d in RKNPU_DIRS if reader.exists(f"{d}/load")), None)


def core_loads(load: list[int]) -> list[float | None]:
    """Per-core percentages with the impossible ones (above 100 %, below 0) as None."""
    return [float(pct) if 0 <= pct <= MAX_CORE_PCT else None for pct in load]


class _Sources(NamedTuple):
    """Where one NPU's values are read; None: that source does not exist for it."""
    name: str
    load: str | None = None  # rknpu load line
    busy: str | None = None  # Intel NPU busy microseconds
    freq: str | None = None  # Hz (devfreq cur_freq, debugfs clk_rate) or MHz (Intel)
    freq_scale: int = 1
    clk_enables: str | None = None  # debugfs clk_enable_count
    power: str | None = None  # rknpu ``power`` (on/off) or runtime PM's runtime_status


def _sources(reader: SysReader, npu: Npu, rknpu_load: str | None) -> _Sources:
    if npu.driver == "rknpu":
        freq = f"{resolved(reader, f'{DEVFREQ}/{npu.devfreq}')}/cur_freq" if npu.devfreq else None
        power = f"{rknpu_load.rsplit('/', 1)[0]}/power" if rknpu_load else None
        return _Sources(npu.name, load=rknpu_load, freq=freq, power=power)
    if npu.driver == "intel_vpu" and npu.sysfs:
        return _Sources(npu.name, busy=f"{npu.sysfs}/npu_busy_time_us",
                        freq=f"{npu.sysfs}/npu_current_frequency_mhz", freq_scale=1_000_000,
                        power=f"{npu.sysfs}/power/runtime_status")
    if npu.vendor != "nvidia" or not npu.sysfs:
        return _Sources(npu.name)
    power = f"{npu.sysfs}/power/runtime_status"  # nvhost powers a DLA up while it runs
    clk = f"{DEBUGFS_CLK}/{npu.name}_core"  # dla0 -> dla0_core (dla0_falcon is its MCU)
    if reader.exists(clk):
        return _Sources(npu.name, freq=f"{clk}/clk_rate", clk_enables=f"{clk}/clk_enable_count",
                        power=power)
    bpmp = f"{BPMP_CLK}/{npu.name}_core/rate"  # Orin: the clock is BPMP's, not the kernel's
    return _Sources(npu.name, freq=bpmp if reader.exists(bpmp) else None, power=power)


class NpuCollector:
    key = "npus"

    def __init__(self, reader: SysReader, topology: Topology,
                 clock: Clock = time.monotonic) -> None:
        self._reader = reader
        self._interval = Interval(clock)
        rknpu_load = rknpu_load_file(reader) if any(
            npu.driver == "rknpu" for npu in topology.npus) else None
        self._npus = [_sources(reader, npu, rknpu_load) for npu in topology.npus]
        self._busy_us: dict[str, int | None] = {}

    def _rknpu(self, path: str) -> dict[str, Any]:
        load = self._reader.parsed(path, parse_rknpu_load)
        if not load:
            return {}
        cores = core_loads(load)
        if None in cores:
            self._reader.warn(f"{path}: a core load outside 0..100 % is reported as null "
                              "(a driver glitch, not a measurement)")
        valid = [pct for pct in cores if pct is not None]
        return {"util_pct": rounded(sum(valid) / len(valid)) if valid else None,
                "core_util_pct": cores}

    def _busy(self, path: str, seconds: float | None) -> float | None:
        busy = self._reader.integer(path)
        busy_per_s = rate(self._busy_us.get(path), busy, seconds)
        self._busy_us[path] = busy
        return percent(busy_per_s, 1_000_000) if busy_per_s is not None else None

    def collect(self) -> list[dict[str, Any]]:
        seconds = self._interval.elapsed()
        rows: list[dict[str, Any]] = []
        for npu in self._npus:
            values: dict[str, Any] = {}
            if npu.load is not None:
                values.update(self._rknpu(npu.load))
            elif npu.busy is not None:
                values["util_pct"] = self._busy(npu.busy, seconds)
            if npu.freq is not None:
                freq = self._reader.integer(npu.freq)
                values["freq_hz"] = freq * npu.freq_scale if freq is not None else None
            if npu.clk_enables is not None:
                enables = self._reader.integer(npu.clk_enables)
                values["active"] = enables > 0 if enables is not None else None
            elif npu.power is not None:
                values["active"] = POWER_STATES.get(self._reader.text(npu.power) or "")
            rows.append(npu_row(npu.name, **values))
        return rows
