"""NPUs: RK3588 rknpu (vendor) and Rocket (mainline), Jetson DLA, Intel NPU, Hailo, Coral.

Devices are found by the driver bound to them (``/sys/bus/<bus>/drivers/<driver>/<device>``
links), wherever they sit in /sys/devices, and then by what their driver exposes: rknpu's
devfreq node and debugfs/procfs status, /sys/class/accel (Rocket, intel_vpu;
https://docs.kernel.org/accel/introduction.html), host1x's ``nvdla`` children,
/sys/class/hailo_chardev, /sys/class/apex.  Mainline Rocket binds one platform device per
NPU core (``rockchip,rk3588-rknn-core``) and hangs its one accel node on a driverless
facade platform device (``rknn``, drivers/accel/rocket/rocket_drv.c), so the cores are
counted from the driver, never from the accel node's parent.  All of them tolerate the
device vanishing (runtime PM, driver reload) between two reads.
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
RKNPU_DRIVERS = ("RKNPU", "rknpu")  # the vendor driver registers "RKNPU"
ROCKET_DRIVER = "rocket"
DLA_DRIVERS = ("nvdla", "NVDLA")  # L4T nvhost "nvdla"; the open-source port "NVDLA"
INTEL_NPU_DRIVER = "intel_vpu"
HOST1X_GLOBS = ("/sys/devices/platform/*host1x/*.nvdla*",
                "/sys/devices/platform/bus@0/*host1x/*.nvdla*")
CORAL_USB_IDS = {("1a6e", "089a"), ("18d1", "9302")}  # before / after firmware load
_DRIVER_FILES = {"bind", "unbind", "uevent", "new_id", "remove_id", "module"}


def bound_devices(reader: SysReader, bus: str, *drivers: str) -> list[str]:
    """The sysfs device directories bound to any of ``drivers`` on ``bus``, resolved,
    sorted and without duplicates: where the device sits in /sys/devices does not matter."""
    found: set[str] = set()
    for driver in drivers:
        base = f"/sys/bus/{bus}/drivers/{driver}"
        if not reader.exists(base):
            continue
        for name in reader.listdir(base):
            if name in _DRIVER_FILES:
                continue
            path = reader.realpath(f"{base}/{name}")
            if path is not None and path.startswith("/sys/devices/"):
                found.add(path)
    return sorted(found)


def _drm_render_node(reader: SysReader, device: str | None) -> str | None:
    """The /dev/dri render node whose sysfs device is ``device`` (rknpu is a DRM driver)."""
    if device is None:
        return None
    for node in reader.glob("/sys/class/drm/renderD*"):
        if reader.realpath(f"{node}/device") == device:
            return f"/dev/dri/{os.path.basename(node)}"
    return None


def _devfreq_of(reader: SysReader, device: str) -> str | None:
    """The devfreq node whose device is ``device``, or None."""
    for node in reader.listdir(DEVFREQ):
        if reader.realpath(f"{DEVFREQ}/{node}/device") == device:
            return node
    return None


def _is_rknpu_devfreq(reader: SysReader, node: str) -> bool:
    device_link = f"{DEVFREQ}/{node}/device"
    compatible = reader.dt_strings(f"{device_link}/of_node/compatible") or []
    mainline_core = any("rknn-core" in entry for entry in compatible)  # Rocket's, not ours
    return (reader.of_node_name(device_link) == "npu" and not mainline_core) or any(
        "rknpu" in entry for entry in compatible)


def _rknpu(reader: SysReader, soc: str | None) -> list[Npu]:
    """Vendor rknpu devices: bound to RKNPU, plus any rknpu devfreq node (an unbound one
    still says the NPU is there)."""
    devices: dict[str, str | None] = {d: _devfreq_of(reader, d) for d in bound_devices(
        reader, "platform", *RKNPU_DRIVERS)}
    for name in reader.listdir(DEVFREQ):
        found = reader.realpath(f"{DEVFREQ}/{name}/device")
        if found is not None and found not in devices and _is_rknpu_devfreq(reader, name):
            devices[found] = name
    npus = []
    for device, node in sorted(devices.items()):
        npu = Npu(name="rknpu", driver=(reader.driver(device) or "rknpu").lower(),
                  cores=RKNPU_CORES_BY_SOC.get(soc or ""), devfreq=node,
                  device=_drm_render_node(reader, device), vendor="rockchip", sysfs=device)
        if node is not None:
            freq = read_devfreq(reader, f"{DEVFREQ}/{node}")
            npu.min_hz, npu.max_hz, npu.available_hz = freq.min_hz, freq.max_hz, freq.available_hz
            npu.governor, npu.cur_hz = freq.governor, freq.cur_hz
            npu.limit_min_hz, npu.limit_max_hz = freq.limit_min_hz, freq.limit_max_hz
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


def _rocket(reader: SysReader, devnode: str | None, facade: str | None) -> Npu | None:
    cores = bound_devices(reader, "platform", ROCKET_DRIVER)
    if not cores:
        return None
    return Npu(name="rocket", driver=ROCKET_DRIVER, vendor="rockchip", device=devnode,
               cores=len(cores), sysfs=facade or cores[0], core_sysfs=cores)


def _intel_npu(reader: SysReader, device: str, devnode: str | None) -> Npu:
    mhz = reader.integer(f"{device}/npu_max_frequency_mhz")
    return Npu(name="intel-npu", driver=INTEL_NPU_DRIVER, vendor="intel", cores=None,
               device=devnode, max_hz=mhz * 1_000_000 if mhz else None, sysfs=device)


def _accel(reader: SysReader, known: list[Npu]) -> list[Npu]:
    """One entry per /sys/class/accel node; a driverless parent is Rocket's facade when
    Rocket has cores bound.  Rocket cores and Intel NPUs without an accel node (an older
    kernel, a node gone on a driver reload) are still reported from their driver."""
    npus: list[Npu] = []
    for name in reader.listdir("/sys/class/accel"):
        device = reader.realpath(f"/sys/class/accel/{name}/device")
        driver = reader.driver(device) if device else None
        devnode = f"/dev/accel/{name}"
        existing = next((n for n in known + npus if n.sysfs and n.sysfs == device), None)
        if existing is not None:
            existing.device = devnode
            continue
        rocket = _rocket(reader, devnode, device) if driver in (None, ROCKET_DRIVER) else None
        if rocket is not None and not any(n.name == "rocket" for n in npus):
            npus.append(rocket)
        elif driver == INTEL_NPU_DRIVER and device is not None:
            npus.append(_intel_npu(reader, device, devnode))
        else:
            npus.append(Npu(name=driver or name, driver=driver, cores=None, device=devnode,
                            sysfs=device))
    if not any(n.name == "rocket" for n in npus):
        rocket = _rocket(reader, None, None)
        npus += [rocket] if rocket is not None else []
    reported = {n.sysfs for n in known + npus}
    npus += [_intel_npu(reader, device, None) for device in bound_devices(
        reader, "pci", INTEL_NPU_DRIVER) if device not in reported]
    return npus


def _jetson_dla(reader: SysReader) -> list[Npu]:
    """DLA cores bound to nvdla wherever host1x sits, plus unbound host1x children."""
    globbed = {reader.realpath(p) for pattern in HOST1X_GLOBS for p in reader.glob(pattern)}
    paths = sorted(set(bound_devices(reader, "platform", *DLA_DRIVERS)) | {
        p for p in globbed if p is not None})
    npus = []
    for ordinal, path in enumerate(paths):
        match = re.search(r"nvdla(\d+)$", path)
        index = match.group(1) if match else str(ordinal)
        # nvpmodel caps the DLA clocks through <dev>/acm/clk_cap/<clock> (Hz): the limit of
        # the active power mode, as limit_max_hz is for a devfreq node; u64 max: no cap
        cap = reader.integer(f"{path}/acm/clk_cap/dla{index}_core")
        cap = None if cap is not None and cap >= 2**63 else cap
        npus.append(Npu(name=f"dla{index}", driver=reader.driver(path) or "nvdla",
                        cores=1, vendor="nvidia", sysfs=path,
                        limit_max_hz=cap if cap is not None and cap > 0 else None))
    return npus


HAILO_VENDOR = "0x1e60"
HAILO_NAMES = {"2864": "hailo8", "45c4": "hailo10h", "43a2": "hailo15l"}  # 8 and 8L share 2864


def _hailo_function(reader: SysReader, base: str, functions: dict[str, PciDevice]) -> str | None:
    """The PCI function (bdf) behind ``/sys/class/hailo_chardev/<node>``.

    hailort's driver creates the node without a parent (``device_create(class, NULL, ...)``
    in linux/pcie/src/pcie.c), so there is no ``device`` link to follow: the node's
    ``board_location`` names the function; failing that, the node's major is the driver's
    (``register_chrdev`` with the driver's name, /proc/devices) and its minor the board
    index, which counts that driver's functions in probe (bus) order."""
    device = reader.realpath(f"{base}/device")
    if device is not None:
        return os.path.basename(device)
    location = reader.text(f"{base}/board_location")
    if location in functions:
        return location
    dev = (reader.text(f"{base}/dev") or "").partition(":")
    majors = reader.parsed("/proc/devices", parsers.parse_char_majors) if reader.exists(
        "/proc/devices") else None
    owner = majors.get(int(dev[0])) if majors and dev[0].isdigit() else None
    bound = sorted(bdf for bdf, fn in functions.items() if owner and fn.driver == owner)
    index = int(dev[2]) if dev[2].isdigit() else len(bound)
    return bound[index] if index < len(bound) else None


def _hailo_name(kind: str | None, device_id: str | None) -> str:
    """``accelerator_type`` is a number in hailort's driver (0 NNC, 1 SoC); some builds
    print the chip: use the chip's name from its PCI device id then."""
    if kind and not kind.isdigit():
        return kind.lower()
    chip = (device_id or "").removeprefix("0x")
    return HAILO_NAMES.get(chip, f"hailo-{chip}")


def _hailo(reader: SysReader, pci: list[PciDevice]) -> list[Npu]:
    """One NPU per Hailo PCI function: its character device, where it has one, is matched
    to the function by driver and device number, never listed beside it."""
    functions = {dev.bdf: dev for dev in pci if dev.vendor_id == HAILO_VENDOR}
    npus = []
    seen: set[str] = set()
    for name in reader.listdir("/sys/class/hailo_chardev"):
        base = f"/sys/class/hailo_chardev/{name}"
        bdf = _hailo_function(reader, base, functions)
        function = functions.get(bdf or "")
        if bdf is not None:
            seen.add(bdf)
        npus.append(Npu(
            name=_hailo_name(reader.text(f"{base}/accelerator_type"),
                             function.device_id if function else None),
            driver=(function.driver if function else None) or reader.driver(
                f"{base}/device") or "hailo", cores=None, vendor="hailo", device=f"/dev/{name}",
            sysfs=reader.realpath(f"{base}/device") or (
                reader.realpath(f"/sys/bus/pci/devices/{bdf}") if bdf else None)))
    for dev in functions.values():  # Hailo-10H/15 (hailo1x_pci) and unbound Hailo-8 cards
        if dev.bdf not in seen:
            npus.append(Npu(name=_hailo_name(None, dev.device_id), driver=dev.driver,
                            cores=None, vendor="hailo",
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
