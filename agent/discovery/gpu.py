"""GPUs: Jetson iGPU and Mali through devfreq, discrete GPUs through PCI and NVML, and any
GPU with a DRM card through the driver bound to it (drm.py: the Pi 5's V3D, i915/xe/amdgpu
clocks).  One device is one GPU, whichever of these found it first.

devfreq nodes are recognised by their device-tree node name, never by the devfreq name, which
changes between releases (gv11b -> ga10b -> gpu); the memory controller (``dmc``) is skipped.
"""

from __future__ import annotations

from typing import NamedTuple

from agent.discovery import drm
from agent.discovery.model import Gpu, PciDevice
from agent.discovery.nvml import NvmlSource, sysfs_bdf
from agent.kernel.reader import SysReader

DEVFREQ = "/sys/class/devfreq"
GPU_NODE_NAMES = {"gp10b", "gv11b", "ga10b", "gb10b", "gpu"}
PCI_GPU_VENDORS = {"0x10de": "nvidia", "0x1002": "amd", "0x8086": "intel"}


def is_gpu_node(of_name: str | None) -> bool:
    return of_name is not None and (of_name in GPU_NODE_NAMES or "gpu" in of_name)


class Devfreq(NamedTuple):
    min_hz: int | None
    max_hz: int | None
    available_hz: list[int] | None
    governor: str | None
    limit_min_hz: int | None
    limit_max_hz: int | None
    cur_hz: int | None


def read_devfreq(reader: SysReader, path: str) -> Devfreq:
    """Common devfreq fields.  min/max are the offered range (falling back to the limits
    when there is no frequency table); ``limit_*`` are what nvpmodel or a tuner set."""
    available = reader.integers(f"{path}/available_frequencies")
    available = sorted(available) if available else None
    limit_min, limit_max = reader.integer(f"{path}/min_freq"), reader.integer(f"{path}/max_freq")
    return Devfreq(
        min_hz=available[0] if available else limit_min,
        max_hz=available[-1] if available else limit_max,
        available_hz=available, governor=reader.text(f"{path}/governor"),
        limit_min_hz=limit_min, limit_max_hz=limit_max,
        cur_hz=reader.integer(f"{path}/cur_freq"))


def _devfreq_gpus(reader: SysReader, drm_gpus: set[str]) -> list[Gpu]:
    """devfreq nodes of a GPU: by device-tree node name, or because a GPU's DRM driver
    (panfrost, lima, msm... on a node named otherwise) is bound to the device."""
    gpus = []
    for node in reader.listdir(DEVFREQ):
        device = f"{DEVFREQ}/{node}/device"
        of_name = reader.of_node_name(device)
        if not is_gpu_node(of_name) and reader.realpath(device) not in drm_gpus:
            continue
        compatible = reader.dt_strings(f"{device}/of_node/compatible") or []
        vendor = "arm" if any("mali" in entry for entry in compatible) else (
            compatible[0].split(",")[0] if compatible else "unknown")
        name = compatible[-1].split(",")[-1] if compatible else (of_name or node)
        freq = read_devfreq(reader, f"{DEVFREQ}/{node}")
        gpus.append(Gpu(
            name=name, vendor=vendor, kind="integrated", devfreq=node, min_hz=freq.min_hz,
            max_hz=freq.max_hz, available_hz=freq.available_hz, governor=freq.governor,
            limit_min_hz=freq.limit_min_hz, limit_max_hz=freq.limit_max_hz, cur_hz=freq.cur_hz,
            available_governors=reader.words(f"{DEVFREQ}/{node}/available_governors"),
            driver=reader.driver(device), source="devfreq", sysfs=reader.realpath(device)))
    return gpus


def _pci_gpus(reader: SysReader, pci: list[PciDevice]) -> list[Gpu]:
    gpus = []
    for device in pci:
        vendor = PCI_GPU_VENDORS.get(device.vendor_id or "")
        if vendor is None or not (device.class_ or "").startswith("0x03"):
            continue  # emulated VGA (bochs, virtio, qxl) is no compute GPU
        gpus.append(Gpu(name=f"{vendor.upper() if vendor != 'intel' else 'Intel'} GPU "
                        f"{device.device_id}", vendor=vendor,
                        kind="integrated" if vendor == "intel" else "discrete",
                        pci_bdf=device.bdf, numa_node=device.numa_node, driver=device.driver,
                        source="pci",
                        sysfs=reader.realpath(f"/sys/bus/pci/devices/{device.bdf}")))
    return gpus


def _platform_name(reader: SysReader, card: drm.DrmCard) -> tuple[str, str]:
    """(name, vendor) of a DRM GPU: the device-tree model, as for a devfreq GPU, and the
    driver's vendor."""
    compatible = reader.dt_strings(f"{card.device}/of_node/compatible") or []
    return (compatible[-1].split(",")[-1] if compatible else f"{card.driver} GPU"), card.vendor


def _merge_drm(reader: SysReader, gpus: list[Gpu], cards: list[drm.DrmCard]) -> None:
    """Add the GPUs only a DRM card shows, and give every GPU its card and, where the
    devfreq/PCI entry has none, the clock its driver's own files report."""
    by_device = {gpu.sysfs: gpu for gpu in gpus if gpu.sysfs}
    by_bdf = {gpu.pci_bdf: gpu for gpu in gpus if gpu.pci_bdf}
    for card in cards:
        pci = card.device.rsplit("/", 1)[-1] if reader.exists(f"{card.device}/vendor") else None
        gpu = by_device.get(card.device) or by_bdf.get(pci or "")
        if gpu is None:
            name, vendor = _platform_name(reader, card)
            gpu = Gpu(name=name, vendor=vendor, kind="discrete" if pci and vendor not in (
                "intel",) else "integrated", pci_bdf=pci, driver=card.driver, source="drm",
                sysfs=card.device)
            gpus.append(gpu)
            by_device[card.device] = gpu
        gpu.drm_card = gpu.drm_card or card.card
        if gpu.devfreq is None:
            _fill_clock(gpu, drm.clock(reader, card))


def _fill_clock(gpu: Gpu, clock: drm.DrmClock) -> None:
    gpu.min_hz = gpu.min_hz if gpu.min_hz is not None else clock.min_hz
    gpu.max_hz = gpu.max_hz if gpu.max_hz is not None else clock.max_hz
    gpu.available_hz = gpu.available_hz or clock.available_hz
    gpu.limit_min_hz = gpu.limit_min_hz if gpu.limit_min_hz is not None else clock.limit_min_hz
    gpu.limit_max_hz = gpu.limit_max_hz if gpu.limit_max_hz is not None else clock.limit_max_hz
    gpu.cur_hz = gpu.cur_hz if gpu.cur_hz is not None else clock.cur_hz


def _merge_nvml(reader: SysReader, gpus: list[Gpu], nvml: NvmlSource) -> None:
    try:
        found = nvml.gpus()
    except Exception as error:  # any NVML failure degrades to PCI-only facts
        reader.warn(f"NVML unavailable ({type(error).__name__}: {error}); "
                    "NVIDIA GPU details come from PCI sysfs only")
        return
    by_bdf = {gpu.pci_bdf: gpu for gpu in gpus if gpu.vendor == "nvidia"}
    for entry in found:
        bdf = sysfs_bdf(entry.pci_bus_id)
        gpu = by_bdf.get(bdf)
        if gpu is None:
            gpu = Gpu(name=entry.name, vendor="nvidia", kind="discrete", pci_bdf=bdf)
            gpus.append(gpu)
        gpu.name = entry.name
        gpu.memory_bytes = entry.memory_total_bytes
        gpu.uuid = entry.uuid
        gpu.source = "nvml"
        if entry.max_graphics_clock_mhz:
            gpu.max_hz = entry.max_graphics_clock_mhz * 1_000_000


def discover_gpus(reader: SysReader, pci: list[PciDevice], nvml: NvmlSource | None) -> list[Gpu]:
    cards = drm.gpu_cards(reader)
    gpus = _devfreq_gpus(reader, {card.device for card in cards}) + _pci_gpus(reader, pci)
    _merge_drm(reader, gpus, cards)
    if any(gpu.vendor == "nvidia" and gpu.kind == "discrete" for gpu in gpus):
        if nvml is None:
            reader.warn("NVML not queried (fixture root); NVIDIA GPU details from PCI sysfs only")
        else:
            _merge_nvml(reader, gpus, nvml)
    return gpus
