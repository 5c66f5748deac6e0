"""Who controls PCIe ASPM: the kernel's answer to a policy write, from what it and the firmware
expose (docs/kernel-facts/refusals.md).

drivers/pci/pcie/aspm.c ``pcie_aspm_set_policy`` answers EPERM while ``aspm_disabled`` is set.
``pcie_no_aspm()`` sets it (unless ``pcie_aspm=force``) for ``pcie_aspm=off``, and
drivers/acpi/pci_root.c ``negotiate_os_control`` calls it when the FADT's IAPC_BOOT_ARCH flags
carry ``ACPI_FADT_NO_ASPM`` (bit 4, include/acpi/actbl.h) or when the firmware's ``_OSC`` does
not hand the OS control of PCIe ("platform retains control").  The FADT is readable (as root)
at /sys/firmware/acpi/tables/FACP, so a plan can foresee that case; the _OSC outcome is only in
the kernel log, so a plan cannot, and the refusal meets the apply (agent/tuning/refusals.py).
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from pathlib import Path

POLICY = "/sys/module/pcie_aspm/parameters/policy"
FADT = "/sys/firmware/acpi/tables/FACP"
BOOT_FLAGS = 109  # offset of the u16 boot_flags (IAPC_BOOT_ARCH) in struct acpi_table_fadt
NO_ASPM = 1 << 4  # ACPI_FADT_NO_ASPM: "PCIe ASPM control must not be enabled"
# the boot log a fixture tree records the _OSC outcome in (the kernel prints it at boot)
BOOT_LOG = "/var/log/dmesg"
OSC_RETAINED = "_OSC: platform retains control of PCIe features"


def fadt_forbids_aspm(table: bytes) -> bool:
    """Whether a FADT (the FACP table's bytes) tells the OS to leave ASPM alone."""
    if table[:4] != b"FACP" or len(table) < BOOT_FLAGS + 2:
        return False
    return bool(int.from_bytes(table[BOOT_FLAGS:BOOT_FLAGS + 2], "little") & NO_ASPM)


def firmware_keeps_aspm(read_bytes: Callable[[str], bytes]) -> bool:
    """The FADT's answer; False when the table is absent or unreadable (not root, no ACPI)."""
    try:
        return fadt_forbids_aspm(read_bytes(FADT))
    except OSError:
        return False


def fixture_refusal(base: Path, path: str) -> OSError | None:
    """EPERM for a policy write below a fixture root whose firmware keeps ASPM control (its
    FADT flag, or the _OSC outcome in its boot log), as aspm.c answers; else None."""
    if path != POLICY:
        return None

    def read(name: str) -> bytes:
        return (base / name.lstrip("/")).read_bytes()

    if firmware_keeps_aspm(read):
        return OSError(errno.EPERM, f"{path}: the FADT says the firmware keeps ASPM control")
    try:
        log = read(BOOT_LOG).decode(errors="replace")
    except OSError:
        return None
    if OSC_RETAINED in log:
        return OSError(errno.EPERM, f"{path}: _OSC left ASPM control with the firmware")
    return None
