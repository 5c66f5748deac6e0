"""IRQs as /proc/interrupts shows them, which of them the kernel never lets user space move,
and the hex CPU masks of /proc/irq (Documentation/core-api/irq/irq-affinity.rst).

A write to ``/proc/irq/N/smp_affinity[_list]`` fails with EIO unless the IRQ can be moved
(kernel/irq/proc.c ``write_irq_affinity`` -> ``irq_can_set_affinity_usr``):

- **per-CPU IRQs** (``IRQD_PER_CPU``): one interrupt line per CPU, such as the arm64 generic
  timer or the PMU.  On a GIC they are the PPIs, hwirq 16-31 (and the GICv3.1 extended PPIs,
  1056-1119); /proc/interrupts shows the chip and hwirq on every row, as does
  /sys/kernel/irq/N/{chip_name,hwirq}.  A RISC-V hart's local interrupts are per CPU too.
  x86's per-CPU vectors (LOC, RES, CAL...) are named rows with no /proc/irq directory.
  They are recognised when planning and skipped with a note.
- **managed IRQs** (``IRQD_AFFINITY_MANAGED``): the kernel spreads a multi-queue device's
  vectors over the CPUs itself (NVMe I/O queues, virtio-blk request queues; the queue
  ``nvme0q0`` is the admin queue and is not managed).  Nothing in procfs or sysfs says which
  IRQ is managed (only debugfs, where the kernel has GENERIC_IRQ_DEBUGFS), so they are found
  when applying: the EIO of an IRQ that is not per-CPU.  ``isolcpus=managed_irq,...`` keeps
  them off isolated CPUs at boot.

A write the chip itself refuses fails later, in the chip's ``irq_set_affinity``: MSI
controllers that demultiplex every vector from one parent interrupt cannot send a vector to
another CPU, and say so with EINVAL (DesignWare PCIe on the Jetsons, brcmstb on the Pis), or
have no ``irq_set_affinity`` at all, which is EIO again (``MSI_FLAG_NO_AFFINITY``).  They are
recognised by the chip column when planning (:func:`chip_refusal`) and skipped with a note;
docs/kernel-facts/rt-irqs.md has the sources.
"""

from __future__ import annotations

import errno
import fnmatch
import os
import re
from dataclasses import dataclass
from pathlib import Path

from agent.kernel.parsers import parse_cpulist

DEFAULT_AFFINITY = "/proc/irq/default_smp_affinity"
WORKQUEUE_CPUMASK = "/sys/devices/virtual/workqueue/cpumask"
_IRQ_LINE = re.compile(r"\s*(\d+):(.*)")
_TOKEN = re.compile(r"\S+")
_HWIRQ = re.compile(r"(\d+)(-\S+)?")  # x86 glues the flow name on: "2-edge"
# After the hwirq, each optional, in the kernel's order (show_interrupts): the arm
# "Level"/"Edge" type, and a detached "-name" when there is no hwirq.
_CHIP_FIELDS = (re.compile(r"Level|Edge"), re.compile(r"-\S+"))
_GIC = re.compile(r"GIC(v\d)?(-\d+)?")
_PPI_HWIRQS = (range(16, 32), range(1056, 1120))
_PER_CPU_CHIPS = ("RISC-V INTC", "xen-percpu-virq", "xen-percpu-ipi")
_SPACED_CHIPS = ("RISC-V INTC", "BRCM STB PCIe MSI")
# Chained MSI controllers, by the top chip's name (/proc/interrupts' chip column): the errno
# of an affinity write and why.  "PCI-MSI" is DesignWare's only beside a GIC (on x86 it is
# the vector domain's, which moves); "DW-" is its per-device-domain prefix (6.x msi-lib).
_CHAINED_MSI = (
    ("BRCM STB PCIe MSI", errno.EINVAL, "brcmstb PCIe MSI (pcie-brcmstb.c: "
     "brcm_msi_set_affinity returns -EINVAL)"),
    ("DW-PCI-MSI*", errno.EIO, "DesignWare PCIe MSI (MSI_FLAG_NO_AFFINITY: the chip has no "
     "irq_set_affinity)"),
    ("PCI-MSI", errno.EINVAL, "DesignWare PCIe MSI (pcie-designware-host.c: "
     "dw_pci_msi_set_affinity returns -EINVAL)"))
# Fixture roots: the managed vectors of the drivers the boards carry (see _fixture_managed).
_MANAGED_ACTIONS = ("nvme*q[1-9]*", "virtio*-req.*")


@dataclass(frozen=True)
class IrqRow:
    """One numbered row of /proc/interrupts: its chip, hardware IRQ number and actions."""

    irq: int
    chip: str
    hwirq: int | None
    actions: list[str]


def parse_rows(text: str) -> dict[int, IrqRow]:
    """/proc/interrupts -> {irq: IrqRow}; NMI/LOC-style rows are not IRQs.

    Action names may hold spaces (arm64 "kvm guest vtimer"), so they are the raw text after
    the per-CPU counts, the chip name and its optional fields, split at commas.
    """
    rows: dict[int, IrqRow] = {}
    for line in text.splitlines():
        match = _IRQ_LINE.fullmatch(line)
        if match is not None:
            irq = int(match.group(1))
            rows[irq] = _row(irq, match.group(2))
    return rows


def _row(irq: int, rest: str) -> IrqRow:
    tokens = list(_TOKEN.finditer(rest))
    index = 0
    while index < len(tokens) and tokens[index].group().isdigit():
        index += 1  # per-CPU counts, one per online CPU
    chip = tokens[index].group() if index < len(tokens) else ""
    index += 1
    for spaced in _SPACED_CHIPS:  # a chip name with a space: the words after it follow
        words = spaced.split()
        if chip == words[0] and [t.group() for t in tokens[index:index + len(words) - 1]] \
                == words[1:]:
            chip, index = spaced, index + len(words) - 1
    hwirq = None
    if index < len(tokens) and (number := _HWIRQ.fullmatch(tokens[index].group())):
        hwirq, index = int(number.group(1)), index + 1
    for field in _CHIP_FIELDS:
        if index < len(tokens) and field.fullmatch(tokens[index].group()):
            index += 1
    actions = [] if index >= len(tokens) else [
        name.strip() for name in rest[tokens[index].start():].split(",") if name.strip()]
    return IrqRow(irq, chip, hwirq, actions)


def per_cpu_reason(row: IrqRow) -> str | None:
    """Why an IRQ is per-CPU (the kernel refuses to move it), or None."""
    if _GIC.fullmatch(row.chip) and row.hwirq is not None and any(
            row.hwirq in ppis for ppis in _PPI_HWIRQS):
        return f"per-CPU IRQ ({row.chip} PPI, hwirq {row.hwirq}): its affinity cannot be set"
    if row.chip in _PER_CPU_CHIPS:
        return f"per-CPU IRQ ({row.chip}): its affinity cannot be set"
    return None


def has_gic(rows: dict[int, IrqRow]) -> bool:
    """Whether the IRQs hang off an arm GIC (where a bare "PCI-MSI" chip is a host bridge's
    own MSI controller, not the CPU's)."""
    return any(_GIC.fullmatch(row.chip) for row in rows.values())


def chip_refusal(row: IrqRow, gic: bool) -> tuple[int, str] | None:
    """(errno, why) when the IRQ's MSI chip refuses every affinity change, else None: all of
    its vectors arrive through one parent interrupt, on that interrupt's CPU."""
    for pattern, code, why in _CHAINED_MSI:
        if fnmatch.fnmatchcase(row.chip, pattern) and (pattern != "PCI-MSI" or gic):
            return code, (f"its MSI chip cannot move it ({why}; every vector arrives "
                          "through one parent interrupt): the kernel answers "
                          f"{errno.errorcode[code]}")
    return None


def affinity_irq(path: str) -> int | None:
    """The IRQ number of a per-IRQ affinity file, else None."""
    match = re.fullmatch(r"/proc/irq/(\d+)/smp_affinity(_list)?", path)
    return int(match.group(1)) if match else None


MANAGED = ("managed IRQ (kernel-managed affinity, e.g. NVMe/multiqueue queues): the kernel "
           "refuses affinity changes (EIO); isolcpus=managed_irq,... moves them at boot")


# -- hex CPU masks -----------------------------------------------------------------------------


def format_mask(cpus: list[int], nr_cpu_ids: int | None = None) -> str:
    """A CPU set as the kernel prints a cpumask (``%*pb``): hex in 32-bit words separated by
    commas, most significant first.  With ``nr_cpu_ids`` the words are padded as the kernel
    pads them (the first to the digits its bits need, the rest to 8); without, the shortest
    form, which the kernel accepts on write."""
    value = sum(1 << cpu for cpu in set(cpus))
    bits = nr_cpu_ids if nr_cpu_ids is not None else max(value.bit_length(), 1)
    words: list[str] = []
    for low in range(((bits + 31) // 32 - 1) * 32, -1, -32):
        first = (min(bits - low, 32) + 3) // 4 if nr_cpu_ids is not None else 1
        words.append(f"{(value >> low) & 0xFFFFFFFF:0{8 if words else first}x}")
    return ",".join(words)


def parse_mask(text: str) -> list[int]:
    """``ff,00000001`` -> CPU numbers; ValueError for anything else (as the kernel's
    bitmap_parse refuses it)."""
    words = text.strip().split(",")
    if not all(re.fullmatch(r"[0-9a-fA-F]{1,8}", word) for word in words):
        raise ValueError(f"{text.strip()!r} is not a hex CPU mask (32-bit words, "
                         "comma-separated)")
    value = 0
    for word in words:
        value = (value << 32) | int(word, 16)
    return [cpu for cpu in range(value.bit_length()) if value >> cpu & 1]


# -- fixture roots -----------------------------------------------------------------------------


def _fixture_managed(row: IrqRow) -> bool:
    """The fixture model's managed IRQs: the queue vectors NVMe and virtio-blk allocate with
    PCI_IRQ_AFFINITY (the kernel knows this from the driver; a tree has no file saying it)."""
    return any(fnmatch.fnmatchcase(name, pattern) for name in row.actions
               for pattern in _MANAGED_ACTIONS)


def fixture_affinity_write(base: Path, path: str, value: str) -> bytes | None:
    """What the kernel does with a write below /proc/irq on a fixture tree: EIO for a per-CPU
    or managed IRQ, the chip's errno for a chained MSI one (EINVAL from DesignWare and
    brcmstb), EINVAL for a default mask with no online CPU; the bytes the default mask then
    reads; None for any other file (the plain attribute rules apply)."""
    irq = affinity_irq(path)
    if irq is not None:
        rows = parse_rows((base / "proc/interrupts").read_text())
        row = rows.get(irq)
        if row is not None and (per_cpu_reason(row) or _fixture_managed(row)):
            raise OSError(errno.EIO, "Input/output error", path)  # before the chip is asked
        refusal = chip_refusal(row, has_gic(rows)) if row is not None else None
        if refusal is not None:
            raise OSError(refusal[0], os.strerror(refusal[0]), path)
        return None
    if path != DEFAULT_AFFINITY:
        return None
    cpus, possible = _fixture_mask(base, path, value)
    online = parse_cpulist((base / "sys/devices/system/cpu/online").read_text())
    if not set(cpus) & set(online):
        raise OSError(errno.EINVAL, "Invalid argument: no online CPU in the mask", path)
    return (format_mask(cpus, max(possible) + 1) + "\n").encode()


def _fixture_mask(base: Path, path: str, value: str) -> tuple[list[int], list[int]]:
    """A written cpumask as cpumask_parse takes it (EINVAL when malformed, EOVERFLOW beyond
    nr_cpu_ids), with the tree's possible CPUs."""
    try:
        cpus = parse_mask(value)
    except ValueError:
        raise OSError(errno.EINVAL, "Invalid argument", path) from None
    possible = parse_cpulist((base / "sys/devices/system/cpu/possible").read_text())
    if cpus and max(cpus) > max(possible):
        raise OSError(errno.EOVERFLOW, "Value too large for defined data type", path)
    return cpus, possible


def fixture_workqueue_write(base: Path, path: str, value: str) -> bytes:
    """kernel/workqueue.c wq_unbound_cpumask_store on a fixture tree: the mask is parsed
    (EINVAL for a malformed one, EOVERFLOW beyond nr_cpu_ids), cut to the possible CPUs, and
    refused with EINVAL when none is left (workqueue_set_unbound_cpumask); possible but
    offline CPUs are accepted.  Returns what the file then reads (%*pb)."""
    cpus, possible = _fixture_mask(base, path, value)
    kept = sorted(set(cpus) & set(possible))
    if not kept:
        raise OSError(errno.EINVAL, "Invalid argument: no possible CPU in the mask", path)
    return (format_mask(kept, max(possible) + 1) + "\n").encode()
