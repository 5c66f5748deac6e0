"""A small interface over NVML so discovery can list NVIDIA discrete GPUs.

The real source loads ``pynvml`` (nvidia-ml-py) lazily: it is only touched when PCI shows an
NVIDIA display controller, so `discover` stays fast on boards without one.  Tests pass a fake
source, since this machine has no NVIDIA driver.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol


@dataclass(frozen=True)
class NvmlGpu:
    index: int
    name: str
    pci_bus_id: str  # as NVML reports it: 8-digit domain, e.g. 00000000:01:00.0
    memory_total_bytes: int | None
    uuid: str | None = None
    max_graphics_clock_mhz: int | None = None


class NvmlSource(Protocol):
    def gpus(self) -> list[NvmlGpu]:
        """Every GPU NVML sees; raises on any NVML failure (caller records a warning)."""
        ...


def sysfs_bdf(bus_id: str) -> str:
    """NVML bus id (8-digit domain, upper case) -> sysfs BDF (4-digit domain, lower case)."""
    domain, _, rest = bus_id.strip().lower().partition(":")
    return f"{int(domain, 16):04x}:{rest}" if rest else bus_id.lower()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class PynvmlSource:
    """Queries the installed NVIDIA driver through pynvml (no root needed for queries)."""

    def __init__(self, module: ModuleType | None = None) -> None:
        self._module = module

    def gpus(self) -> list[NvmlGpu]:
        nvml = self._module or importlib.import_module("pynvml")
        nvml.nvmlInit()
        try:
            found = []
            for index in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                found.append(NvmlGpu(
                    index=index, name=_text(nvml.nvmlDeviceGetName(handle)),
                    pci_bus_id=_text(nvml.nvmlDeviceGetPciInfo(handle).busId),
                    memory_total_bytes=int(nvml.nvmlDeviceGetMemoryInfo(handle).total),
                    uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
                    max_graphics_clock_mhz=int(nvml.nvmlDeviceGetMaxClockInfo(
                        handle, nvml.NVML_CLOCK_GRAPHICS))))
            return found
        finally:
            nvml.nvmlShutdown()
