"""NVIDIA discrete GPUs: PCI facts merged with NVML, and NVML failures as warnings."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from agent.discovery.gpu import discover_gpus
from agent.discovery.model import PciDevice
from agent.discovery.nvml import NvmlGpu, PynvmlSource, sysfs_bdf
from agent.kernel.fsroot import Root
from agent.kernel.reader import SysReader

L4 = PciDevice(bdf="0000:ca:00.0", vendor_id="0x10de", device_id="0x27b8", class_="0x030200",
               driver="nvidia", numa_node=1, link_speed="16.0 GT/s PCIe", link_width=16)


class FakeNvmlModule:
    """Stands in for the pynvml module: the NVIDIA driver is not on this machine."""

    NVML_CLOCK_GRAPHICS = 0

    def __init__(self, fail_init: bool = False) -> None:
        self.fail_init = fail_init
        self.shutdown_calls = 0

    def nvmlInit(self) -> None:
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlShutdown(self) -> None:
        self.shutdown_calls += 1

    def nvmlDeviceGetCount(self) -> int:
        return 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetName(self, handle: int) -> bytes:
        return b"NVIDIA L4"  # older bindings return bytes

    def nvmlDeviceGetPciInfo(self, handle: int) -> Any:
        return SimpleNamespace(busId="00000000:CA:00.0")

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:
        return SimpleNamespace(total=24_152_899_584)

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return "GPU-3f1c2a9e-0000-4000-8000-000000000001"

    def nvmlDeviceGetMaxClockInfo(self, handle: int, clock: int) -> int:
        return 2040


class FailingSource:
    def gpus(self) -> list[NvmlGpu]:
        raise RuntimeError("NVML Shared Library Not Found")


@pytest.fixture()
def reader(tmp_path: Path) -> SysReader:
    return SysReader(Root(tmp_path))


def test_nvml_bus_id_maps_to_sysfs_bdf() -> None:
    assert sysfs_bdf("00000000:CA:00.0") == "0000:ca:00.0"
    assert sysfs_bdf("00000001:01:00.0") == "0001:01:00.0"


def test_pynvml_source_translates_and_shuts_down() -> None:
    module = FakeNvmlModule()
    gpus = PynvmlSource(module).gpus()  # type: ignore[arg-type]
    assert gpus == [NvmlGpu(index=0, name="NVIDIA L4", pci_bus_id="00000000:CA:00.0",
                            memory_total_bytes=24_152_899_584,
                            uuid="GPU-3f1c2a9e-0000-4000-8000-000000000001",
                            max_graphics_clock_mhz=2040)]
    assert module.shutdown_calls == 1


def test_pci_gpu_is_enriched_by_nvml(reader: SysReader) -> None:
    gpus = discover_gpus(reader, [L4], PynvmlSource(FakeNvmlModule()))  # type: ignore[arg-type]
    assert len(gpus) == 1
    gpu = gpus[0]
    assert (gpu.name, gpu.vendor, gpu.kind, gpu.source) == ("NVIDIA L4", "nvidia", "discrete",
                                                           "nvml")
    assert (gpu.pci_bdf, gpu.numa_node, gpu.memory_bytes) == ("0000:ca:00.0", 1, 24_152_899_584)
    assert gpu.max_hz == 2_040_000_000
    assert reader.warnings == []


def test_failing_nvml_is_a_warning_not_a_crash(reader: SysReader) -> None:
    gpus = discover_gpus(reader, [L4], FailingSource())
    assert [(g.pci_bdf, g.source, g.memory_bytes) for g in gpus] == [
        ("0000:ca:00.0", "pci", None)]
    assert len(reader.warnings) == 1
    assert reader.warnings[0].startswith("NVML unavailable (RuntimeError: NVML Shared Library")


def test_real_pynvml_without_driver_is_a_warning(reader: SysReader) -> None:
    pytest.importorskip("pynvml")
    if Path("/proc/driver/nvidia/version").exists():
        pytest.skip("an NVIDIA driver is loaded here; this test covers its absence")
    gpus = discover_gpus(reader, [L4], PynvmlSource())
    assert gpus[0].source == "pci"
    assert any(w.startswith("NVML unavailable") for w in reader.warnings)


def test_no_nvml_query_without_an_nvidia_gpu(reader: SysReader) -> None:
    vga = PciDevice(bdf="0000:00:02.0", vendor_id="0x1234", device_id="0x1111",
                    class_="0x030000", driver="bochs-drm", numa_node=None, link_speed=None,
                    link_width=None)
    assert discover_gpus(reader, [vga], FailingSource()) == []
    assert reader.warnings == []
