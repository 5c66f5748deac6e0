"""PCI devices: ids, class, driver, NUMA node and link.

From /sys/bus/pci/devices/<bdf>/ (https://docs.kernel.org/PCI/sysfs-pci.html).
"""

from __future__ import annotations

from agent.discovery.model import PciDevice
from agent.kernel import parsers
from agent.kernel.reader import SysReader

PCI_DEVICES = "/sys/bus/pci/devices"


def discover_pci(reader: SysReader) -> list[PciDevice]:
    devices = []
    for bdf in reader.listdir(PCI_DEVICES):
        path = f"{PCI_DEVICES}/{bdf}"
        numa = reader.integer(f"{path}/numa_node")
        speed = reader.text(f"{path}/current_link_speed")
        gts = parsers.parse_link_speed_gts(speed) if speed and "GT/s" in speed else None
        width = reader.integer(f"{path}/current_link_width")
        devices.append(PciDevice(
            bdf=bdf, vendor_id=reader.text(f"{path}/vendor"),
            device_id=reader.text(f"{path}/device"), class_=reader.text(f"{path}/class"),
            driver=reader.driver(path),
            numa_node=numa if numa is not None and numa >= 0 else None,
            link_speed=speed if gts is not None else None,
            link_width=width if width else None, link_speed_gts=gts))
    return devices
