"""GPU load and clocks: devfreq GPUs (Jetson, Mali/panthor) from sysfs, NVIDIA discrete GPUs
through NVML (https://docs.nvidia.com/deploy/nvml-api/), which does not cover the Jetson iGPU,
and every other GPU discovery found from its DRM driver's own files (agent/discovery/drm.py:
i915/xe MHz, amdgpu's current sclk level and busy percent, V3D's busiest queue between two
samples of its ``gpu_stats``; V3D has no clock file, so its ``freq_hz`` stays None).

Where a devfreq GPU's load lives is decided once: Rockchip's vendor Mali driver adds a
``load`` attribute to the devfreq node reading ``<pct>@<Hz>Hz``; a Jetson GPU keeps a
per-mille ``load`` in its device directory; panthor has neither, so only its frequency is
known.  Fields a source lacks are None.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from agent.discovery import drm
from agent.discovery.gpu import DEVFREQ
from agent.discovery.model import Gpu, Topology
from agent.kernel.fsroot import Root
from agent.kernel.parsers import parse_int, parse_mali_load
from agent.kernel.reader import SysReader
from agent.telemetry.collectors.base import resolved
from agent.telemetry.collectors.nvml import NvmlGpuSample, NvmlTelemetry, PynvmlTelemetry

FIELDS = ("name", "util_pct", "freq_hz", "memory_used_bytes", "memory_total_bytes", "temp_c",
          "power_mw", "graphics_clock_mhz", "memory_clock_mhz", "throttle_reasons")


def gpu_row(name: str, **values: Any) -> dict[str, Any]:
    """One ``gpus`` entry with every field, None where the source has no value."""
    return {**dict.fromkeys(FIELDS), "name": name, **values}


def parse_permille_load(text: str) -> tuple[float, None]:
    """Jetson ``load``: 0..1000 -> (percent, no frequency)."""
    return parse_int(text) / 10, None


def _mali_load(text: str) -> tuple[float, int]:
    percent, hz = parse_mali_load(text)
    return float(percent), hz


LoadParser = Callable[[str], tuple[float, int | None]]  # -> (percent, Hz if it says)


class DevfreqGpu(NamedTuple):
    name: str
    cur_freq: str
    load: str | None = None
    parse_load: LoadParser = parse_permille_load


def devfreq_gpu(reader: SysReader, name: str, node: str) -> DevfreqGpu:
    base = resolved(reader, f"{DEVFREQ}/{node}")
    device = reader.realpath(f"{base}/device")
    if reader.exists(f"{base}/load"):
        return DevfreqGpu(name, f"{base}/cur_freq", f"{base}/load", _mali_load)
    if device is not None and reader.exists(f"{device}/load"):
        return DevfreqGpu(name, f"{base}/cur_freq", f"{device}/load")
    return DevfreqGpu(name, f"{base}/cur_freq")


class DrmGpu(NamedTuple):
    name: str
    files: drm.DrmFiles


def drm_gpu(reader: SysReader, gpu: Gpu) -> DrmGpu:
    """Where a GPU without devfreq or NVML is sampled: its DRM driver's files, if any."""
    if gpu.drm_card and gpu.sysfs and gpu.driver:
        card = drm.DrmCard(gpu.drm_card, gpu.sysfs, gpu.driver, gpu.vendor)
        return DrmGpu(gpu.name, drm.files(reader, card))
    return DrmGpu(gpu.name, drm.DrmFiles())


def _is_nvidia_discrete(gpu: Gpu) -> bool:
    return gpu.vendor == "nvidia" and gpu.kind == "discrete"


def nvidia_discrete(topology: Topology) -> list[str]:
    """Names of the NVIDIA discrete GPUs, the only ones NVML is asked about."""
    return [gpu.name for gpu in topology.gpus if _is_nvidia_discrete(gpu)]


def default_nvml(root: Root, topology: Topology) -> NvmlTelemetry | None:
    """The real driver, on the host root only: a fixture tree must not get the host's GPUs."""
    return PynvmlTelemetry() if root.is_host and nvidia_discrete(topology) else None


class GpuCollector:
    key = "gpus"

    def __init__(self, reader: SysReader, topology: Topology,
                 nvml: NvmlTelemetry | None) -> None:
        self._reader = reader
        self._devfreq = [devfreq_gpu(reader, gpu.name, gpu.devfreq)
                         for gpu in topology.gpus if gpu.devfreq]
        self._drm = [drm_gpu(reader, gpu) for gpu in topology.gpus
                     if not gpu.devfreq and not _is_nvidia_discrete(gpu)]
        self._nvidia = nvidia_discrete(topology)
        self._gpu_stats: dict[str, drm.GpuStats] = {}
        self._nvml = nvml if self._nvidia else None

    def _devfreq_row(self, gpu: DevfreqGpu) -> dict[str, Any]:
        load = self._reader.parsed(gpu.load, gpu.parse_load) if gpu.load else None
        util, hz = load if load is not None else (None, None)
        if hz is None:
            hz = self._reader.integer(gpu.cur_freq)
        return gpu_row(gpu.name, util_pct=util, freq_hz=hz)

    def _drm_row(self, gpu: DrmGpu) -> dict[str, Any]:
        files, mhz = gpu.files, None
        if files.freq_mhz:
            mhz = self._reader.integer(files.freq_mhz)
        elif files.sclk_table:
            levels = self._reader.parsed(files.sclk_table, drm.parse_sclk)
            mhz = levels[1] if levels else None
        busy = self._reader.integer(files.busy_pct) if files.busy_pct else None
        util = float(busy) if busy is not None else None
        if files.gpu_stats:
            util = self._v3d_busy(files.gpu_stats)
        return gpu_row(gpu.name, util_pct=util, freq_hz=mhz * drm.MHZ if mhz is not None else None)

    def _v3d_busy(self, path: str) -> float | None:
        """V3D counts busy time itself: the first sample has no value, later ones the share
        since the one before."""
        stats = self._reader.parsed(path, drm.parse_gpu_stats)
        before = self._gpu_stats.pop(path, None)
        if stats is None:
            return None
        self._gpu_stats[path] = stats
        return drm.busy_between(before, stats) if before is not None else None

    def _nvml_rows(self) -> list[dict[str, Any]]:
        if self._nvml is None:
            return [gpu_row(name) for name in self._nvidia]
        try:
            samples = self._nvml.sample()
        except Exception:  # NVML missing or broken: the GPUs are still there, values unknown
            return [gpu_row(name) for name in self._nvidia]
        return [_nvml_row(sample) for sample in samples]

    def collect(self) -> list[dict[str, Any]]:
        return ([self._devfreq_row(gpu) for gpu in self._devfreq]
                + [self._drm_row(gpu) for gpu in self._drm] + self._nvml_rows())


def _nvml_row(sample: NvmlGpuSample) -> dict[str, Any]:
    mhz = sample.graphics_clock_mhz
    return gpu_row(sample.name, util_pct=sample.util_pct,
                   freq_hz=mhz * 1_000_000 if mhz is not None else None,
                   memory_used_bytes=sample.memory_used_bytes,
                   memory_total_bytes=sample.memory_total_bytes, temp_c=sample.temp_c,
                   power_mw=sample.power_mw, graphics_clock_mhz=mhz,
                   memory_clock_mhz=sample.memory_clock_mhz,
                   throttle_reasons=sample.throttle_reasons)
