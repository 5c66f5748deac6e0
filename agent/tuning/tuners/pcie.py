"""PCIe ASPM policy: /sys/module/pcie_aspm/parameters/policy.

The file is a selection (``[default] performance powersave powersupersave``) and exists only
with CONFIG_PCIEASPM.  drivers/pci/pcie/aspm.c (pcie_aspm_set_policy) refuses every write
with EPERM while ASPM is disabled (``pcie_aspm=off``, or firmware that does not grant the OS
ASPM control), and unknown words with EINVAL.  The plan foresees the command line and the
FADT's flag (agent/kernel/pcie_aspm.py); an _OSC refusal meets the apply, where an optional
``pcie`` section is skipped (agent/tuning/refusals.py).  ``performance`` keeps links out of
L0s/L1, so a NVMe or NIC request does not pay the L1 exit latency (up to tens of µs).
"""

from __future__ import annotations

from typing import Any

from agent.kernel import pcie_aspm
from agent.tuning.plan import PlanContext

POLICY = pcie_aspm.POLICY
ALLOWED = "default, performance, powersave, powersupersave"


def plan(section: dict[str, Any], ctx: PlanContext) -> None:
    if "aspm_policy" not in section:
        return
    key = "pcie.aspm_policy"
    cmdline = ctx.root.read_text("/proc/cmdline").split() if ctx.root.exists(
        "/proc/cmdline") else []
    if "pcie_aspm=off" in cmdline:
        ctx.lacking(key, "ASPM is disabled by pcie_aspm=off on the kernel command line (the "
                    "kernel refuses policy writes with EPERM)", ALLOWED + " with ASPM enabled")
        return
    if pcie_aspm.firmware_keeps_aspm(ctx.root.read_bytes):
        ctx.lacking(key, f"the firmware keeps ASPM control ({pcie_aspm.FADT}: ACPI_FADT_NO_ASPM; "
                    "the kernel refuses policy writes with EPERM)", ALLOWED + " where the "
                    "firmware grants the OS ASPM control")
        return
    ctx.want("pcie", POLICY, section["aspm_policy"], key, compare="selection",
             lacking=(" (the kernel is built without CONFIG_PCIEASPM)", ALLOWED))
