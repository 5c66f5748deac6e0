"""NVIDIA discrete GPU telemetry through NVML (https://docs.nvidia.com/deploy/nvml-api/).

NVML is initialised once and its handles are kept, since ``nvmlInit`` costs far more than a
sample.  A query a GPU does not support (power on some boards, event reasons on an old
driver) is None for that field only; if NVML cannot start at all, ``sample`` raises and the
GPU collector reports every NVIDIA GPU with None values, trying again next sample.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

# nvmlClocksEventReason* bits (the same bits as the older nvmlClocksThrottleReason*)
CLOCK_EVENT_REASONS = (
    (0x1, "gpu_idle"), (0x2, "applications_clocks_setting"), (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"), (0x10, "sync_boost"), (0x20, "sw_thermal_slowdown"),
    (0x40, "hw_thermal_slowdown"), (0x80, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"))
# newest name first: the older one is deprecated, the newer one missing from old drivers
REASON_QUERIES = ("nvmlDeviceGetCurrentClocksEventReasons",
                  "nvmlDeviceGetCurrentClocksThrottleReasons")


def decode_clock_reasons(mask: int) -> list[str]:
    """Why clocks are held below their maximum; unknown bits are kept as hex."""
    names = [name for bit, name in CLOCK_EVENT_REASONS if mask & bit]
    unknown = mask & ~sum(bit for bit, _ in CLOCK_EVENT_REASONS)
    names += [hex(1 << bit) for bit in range(unknown.bit_length()) if unknown >> bit & 1]
    return names


@dataclass(frozen=True)
class NvmlGpuSample:
    name: str
    util_pct: float | None
    memory_used_bytes: int | None
    memory_total_bytes: int | None
    temp_c: float | None
    power_mw: float | None
    graphics_clock_mhz: int | None
    memory_clock_mhz: int | None
    throttle_reasons: list[str] | None


class NvmlTelemetry(Protocol):
    def sample(self) -> list[NvmlGpuSample]:
        """One reading of every GPU NVML sees; raises when NVML is unavailable."""
        ...


def _query(call: Callable[..., Any], *args: Any) -> Any:
    """One NVML query; any NVML error (not supported, GPU lost) is None for this field."""
    try:
        return call(*args)
    except Exception:  # pynvml raises NVMLError subclasses, fakes and old bindings others
        return None


def _clock_reasons(nvml: Any, handle: Any) -> list[str] | None:
    for query in REASON_QUERIES:
        mask = _query(getattr(nvml, query), handle) if hasattr(nvml, query) else None
        if mask is not None:
            return decode_clock_reasons(mask)
    return None


class PynvmlTelemetry:
    """Samples GPUs through pynvml (nvidia-ml-py); queries need no root."""

    def __init__(self, module: ModuleType | None = None) -> None:
        self._module = module
        self._nvml: Any = None
        self._gpus: list[tuple[Any, str]] = []  # (handle, name)

    def _start(self) -> Any:
        nvml = self._module or importlib.import_module("pynvml")
        nvml.nvmlInit()
        try:
            handles = [nvml.nvmlDeviceGetHandleByIndex(i)
                       for i in range(nvml.nvmlDeviceGetCount())]
            names = [nvml.nvmlDeviceGetName(handle) for handle in handles]
        except Exception:
            nvml.nvmlShutdown()  # balance nvmlInit's reference count before retrying
            raise
        # older bindings return bytes
        self._gpus = [(handle, name.decode() if isinstance(name, bytes) else str(name))
                      for handle, name in zip(handles, names, strict=True)]
        return nvml

    def sample(self) -> list[NvmlGpuSample]:
        if self._nvml is None:
            self._nvml = self._start()
        nvml = self._nvml
        return [self._read(nvml, handle, name) for handle, name in self._gpus]

    @staticmethod
    def _read(nvml: Any, handle: Any, name: str) -> NvmlGpuSample:
        rates = _query(nvml.nvmlDeviceGetUtilizationRates, handle)
        memory = _query(nvml.nvmlDeviceGetMemoryInfo, handle)
        temp = _query(nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU)
        milliwatts = _query(nvml.nvmlDeviceGetPowerUsage, handle)
        return NvmlGpuSample(
            name=name, util_pct=float(rates.gpu) if rates is not None else None,
            memory_used_bytes=int(memory.used) if memory is not None else None,
            memory_total_bytes=int(memory.total) if memory is not None else None,
            temp_c=float(temp) if temp is not None else None,
            power_mw=float(milliwatts) if milliwatts is not None else None,
            graphics_clock_mhz=_query(nvml.nvmlDeviceGetClockInfo, handle,
                                      nvml.NVML_CLOCK_GRAPHICS),
            memory_clock_mhz=_query(nvml.nvmlDeviceGetClockInfo, handle, nvml.NVML_CLOCK_MEM),
            throttle_reasons=_clock_reasons(nvml, handle))
