"""NPUs: RK3588 rknpu (vendor) and Rocket (mainline), Jetson DLA, Intel NPU, Hailo, Coral.

Each kind has its own small finder, reading what its driver exposes: rknpu's devfreq node
and debugfs/procfs status, /sys/class/accel (Rocket, intel_vpu;
https://docs.kernel.org/accel/introduction.html), host1x's ``nvdla`` children,
/sys/class/hailo_chardev, /sys/class/apex.  All of them tolerate the device vanishing
(runtime PM, driver reload) between two reads.
"""

from __future__ import annotations

import os
import re

from agent.discovery.gpu import DEVFREQ, read_devfreq
from agent.discovery.model import Npu, PciDevice
from agent.kernel import parsers
from agent.kernel.reader import SysReader

RKNPU_DIRS = ("/sys/kernel/debug/rknpu", "/proc/rknpu")
RKNPU_CORES_BY_SOC = {"rk3588": 3, "rk3588s": 3, "rk3576": 2, "rk3568": 1, "rk3566": 1}
HOST1X_GLOBS = ("/sys/devices/platform/*host1x/*.nvdla*",
                "/sys/devices/platform/bus@0/*host1x/*.nvdla*")
CORAL_USB_IDS = {("1a6e", "089a"), ("18d1", "9302")}  # before / after firmware load
_PLATFORM_DEVICE = re.compile(r"^[0-9a-f]+\.\w+$")


def _drm_render_node(reader: SysReader, device: str | None) -> str | None:
    """The /dev/dri render node whose sysfs device is ``device`` (rknpu is a DRM driver)."""
    if device is None:
        return None
    for node in reader.glob("/sys/class/drm/renderD*"):
        if reader.realpath(f"{node}/device") == device:
            return f"/dev/dri/{os.path.basename(node)}"
    return None


def _rknpu(reader: SysReader, soc: str | None) -> list[Npu]:
    npus = []
    for node in reader.listdir(DEVFREQ):
        device_link = f"{DEVFREQ}/{node}/device"
        compatible = reader.dt_strings(f"{device_link}/of_node/compatible") or []
        if reader.of_node_name(device_link) != "npu" and not any(
                "rknpu" in entry for entry in compatible):
            continue
        device = reader.realpath(device_link)
        freq = read_devfreq(reader, f"{DEVFREQ}/{node}")
        npu = Npu(name="rknpu", driver=(reader.driver(device_link) or "rknpu").lower(),
                  cores=RKNPU_CORES_BY_SOC.get(soc or ""), devfreq=node,
                  device=_drm_render_node(reader, device), min_hz=freq.min_hz,
                  max_hz=freq.max_hz, vendor="rockchip", available_hz=freq.available_hz,
                  governor=freq.governor, limit_min_hz=freq.limit_min_hz,
                  limit_max_hz=freq.limit_max_hz, cur_hz=freq.cur_hz, sysfs=device)
        _read_rknpu_status(reader, npu)
        npus.append(npu)
    return npus


def _read_rknpu_status(reader: SysReader, npu: Npu) -> None:
    """Driver version and per-core load from debugfs (root) or procfs, whichever exists."""
    for directory in RKNPU_DIRS:
        if not reader.exists(f"{directory}/load"):
            continue
        npu.load_pct = reader.parsed(f"{directory}/load", parsers.parse_rknpu_load)
        version = reader.text(f"{directory}/version")
        npu.version = version.rsplit(":", 1)[-1].strip() if version else None
        if npu.load_pct:
            npu.cores = len(npu.load_pct)
        return
    if reader.exists("/sys/kernel/debug") and not reader.exists(RKNPU_DIRS[0]):
        reader.warn(f"{RKNPU_DIRS[0]}: not readable (needs root and debugfs); "
                    "NPU load unavailable")


def _accel(reader: SysReader, known: list[Npu]) -> list[Npu]:
    npus = []
    for name in reader.listdir("/sys/class/accel"):
        device_link = f"/sys/class/accel/{name}/device"
        device = reader.realpath(device_link)
        driver = reader.driver(device_link)
        devnode = f"/dev/accel/{name}"
        existing = next((n for n in known if n.sysfs and n.sysfs == device), None)
        if existing is not None:
            existing.device = devnode
            continue
        if driver == "rocket":
            npus.append(Npu(name="rocket", driver=driver, vendor="rockchip", device=devnode,
                            cores=_rocket_cores(reader), sysfs=device))
        elif driver == "intel_vpu":
            mhz = reader.integer(f"{device_link}/npu_max_frequency_mhz")
            npus.append(Npu(name="intel-npu", driver=driver, vendor="intel", cores=None,
                            device=devnode, max_hz=mhz * 1_000_000 if mhz else None,
                            sysfs=device))
        else:
            npus.append(Npu(name=driver or name, driver=driver, cores=None, device=devnode,
                            sysfs=device))
    return npus


def _rocket_cores(reader: SysReader) -> int | None:
    """Rocket binds one platform device per NPU core (three on RK3588)."""
    bound = [n for n in reader.listdir("/sys/bus/platform/drivers/rocket")
             if _PLATFORM_DEVICE.match(n)]
    return len(bound) or None


def _jetson_dla(reader: SysReader) -> list[Npu]:
    paths = sorted({p for pattern in HOST1X_GLOBS for p in reader.glob(pattern)})
    npus = []
    for path in paths:
        match = re.search(r"\.nvdla(\d+)$", path)
        if match is None:
            continue
        # nvpmodel caps the DLA clocks through <dev>/acm/clk_cap/<clock> (Hz): the limit of
        # the active power mode, as limit_max_hz is for a devfreq node; u64 max: no cap
        cap = reader.integer(f"{path}/acm/clk_cap/dla{match.group(1)}_core")
        cap = None if cap is not None and cap >= 2**63 else cap
        npus.append(Npu(name=f"dla{match.group(1)}", driver=reader.driver(path) or "nvdla",
                        cores=1, vendor="nvidia", sysfs=path,
                        limit_max_hz=cap if cap is not None and cap > 0 else None))
    return npus


def _hailo(reader: SysReader, pci: list[PciDevice]) -> list[Npu]:
    npus = []
    seen: set[str] = set()
    for name in reader.listdir("/sys/class/hailo_chardev"):
        base = f"/sys/class/hailo_chardev/{name}"
        device = reader.realpath(f"{base}/device")
        if device:
            seen.add(os.path.basename(device))
        kind = reader.text(f"{base}/accelerator_type")
        npus.append(Npu(name=kind.lower() if kind else "hailo",
                        driver=reader.driver(f"{base}/device") or "hailo_pci", cores=None,
                        vendor="hailo", device=f"/dev/{name}", sysfs=device))
    for dev in pci:  # Hailo-10H/15 (hailo1x_pci) and unbound Hailo-8 cards
        if dev.vendor_id == "0x1e60" and dev.bdf not in seen:
            npus.append(Npu(name=f"hailo-{(dev.device_id or '').removeprefix('0x')}",
                            driver=dev.driver, cores=None, vendor="hailo",
                            sysfs=f"/sys/bus/pci/devices/{dev.bdf}"))
    return npus


def _coral(reader: SysReader, pci: list[PciDevice]) -> list[Npu]:
    npus = []
    seen: set[str] = set()
    for name in reader.listdir("/sys/class/apex"):
        device = reader.realpath(f"/sys/class/apex/{name}/device")
        if device:
            seen.add(os.path.basename(device))
        npus.append(Npu(name="coral-edgetpu-pcie", driver="apex", cores=1, vendor="google",
                        device=f"/dev/{name}", sysfs=device))
    for dev in pci:
        if (dev.vendor_id, dev.device_id) == ("0x1ac1", "0x089a") and dev.bdf not in seen:
            npus.append(Npu(name="coral-edgetpu-pcie", driver=dev.driver, cores=1,
                            vendor="google", sysfs=f"/sys/bus/pci/devices/{dev.bdf}"))
    for usb in reader.glob("/sys/bus/usb/devices/*"):
        ids = (reader.text(f"{usb}/idVendor"), reader.text(f"{usb}/idProduct"))
        if ids in CORAL_USB_IDS:
            bus, dev_no = reader.integer(f"{usb}/busnum"), reader.integer(f"{usb}/devnum")
            npus.append(Npu(
                name="coral-edgetpu-usb", driver=None, cores=1, vendor="google",
                device=f"/dev/bus/usb/{bus:03d}/{dev_no:03d}" if bus and dev_no else None,
                sysfs=usb))
    return npus


def discover_npus(reader: SysReader, soc: str | None, pci: list[PciDevice]) -> list[Npu]:
    npus = _rknpu(reader, soc)
    npus += _accel(reader, npus)
    npus += _jetson_dla(reader)
    npus += _hailo(reader, pci)
    npus += _coral(reader, pci)
    return npus
