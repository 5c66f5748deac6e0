"""IRQs: per-CPU IRQs skipped when planning, managed ones reported when applying, and
/proc/irq/default_smp_affinity planned, applied, verified and rolled back byte-exact."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
from tuning_helpers import (
    BOARDS,
    FIXTURES,
    REPO_PROFILES,
    copy_board,
    engine_for,
    snapshot,
    write_profile,
)

from agent.kernel import irqs
from agent.kernel.fsroot import Root
from agent.kernel.parsers import format_cpulist
from agent.tuning.engine import Engine, TuningError
from agent.tuning.errors import ProfileError
from agent.tuning.journal import FILE_NAME

PROC_INTERRUPTS = """\
           CPU0       CPU1
 11:     912344     812344     GICv3  30 Level     arch_timer
 14:          0          0     GICv3  23 Level     arm-pmu
 15:          0          0     GICv3 1056 Level     eppi-thing
 37:      18211          0     GICv3 359 Level     fe2e0000.mmc
 41:     881234          0  IR-PCI-MSIX-0000:17:00.0    1-edge      nvme0q1
  5:         12         11  RISC-V INTC   5 Edge      riscv-timer
 NMI:         0          0  Non-maskable interrupts
"""


def test_rows_carry_chip_and_hwirq() -> None:
    rows = irqs.parse_rows(PROC_INTERRUPTS)
    assert rows[11] == irqs.IrqRow(11, "GICv3", 30, ["arch_timer"])
    assert rows[41] == irqs.IrqRow(41, "IR-PCI-MSIX-0000:17:00.0", 1, ["nvme0q1"])
    assert sorted(rows) == [5, 11, 14, 15, 37, 41]


def test_per_cpu_irqs_are_gic_ppis_and_local_interrupt_controllers() -> None:
    rows = irqs.parse_rows(PROC_INTERRUPTS)
    per_cpu = {irq for irq, row in rows.items() if irqs.per_cpu_reason(row)}
    assert per_cpu == {5, 11, 14, 15}  # PPIs 16-31, extended PPIs 1056-1119, RISC-V INTC
    assert irqs.per_cpu_reason(rows[11]) == ("per-CPU IRQ (GICv3 PPI, hwirq 30): its affinity "
                                             "cannot be set")


@pytest.mark.parametrize(("cpus", "nr_cpu_ids", "text"), [
    (range(8), 8, "ff"), (range(6), 6, "3f"), (range(12), 12, "fff"),
    ([0], 32, "00000001"), (range(40), 40, "ff,ffffffff"), ([0, 33], 64, "00000002,00000001"),
    ([0, 1, 2, 3], None, "f"), ([32], None, "1,00000000")])
def test_masks_are_printed_as_the_kernel_prints_them(cpus: range | list[int],
                                                      nr_cpu_ids: int | None,
                                                      text: str) -> None:
    assert irqs.format_mask(list(cpus), nr_cpu_ids) == text
    assert irqs.parse_mask(text) == list(cpus)


@pytest.mark.parametrize("text", ["", "0x3", "g", "123456789", "f,,f"])
def test_bad_masks_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="hex CPU mask"):
        irqs.parse_mask(text)


@pytest.mark.parametrize("board", BOARDS)
def test_every_board_has_the_all_cpu_default_mask(board: str) -> None:
    cpu = FIXTURES / board / "sys/devices/system/cpu"
    last = int((cpu / "possible").read_text().strip().split("-")[-1])
    text = (FIXTURES / board / "proc/irq/default_smp_affinity").read_text()
    assert irqs.parse_mask(text) == list(range(last + 1))
    assert text == irqs.format_mask(list(range(last + 1)), last + 1) + "\n"


@pytest.mark.parametrize(("board", "irq"), [
    ("rk3588-vendor", 11), ("rk3588-vendor", 87), ("jetson-agx-orin-jp6", 14),
    ("jetson-xavier-nx-jp5-rt", 301), ("x86-server-nvidia", 41), ("bare-vm", 25)])
def test_fixture_root_refuses_per_cpu_and_managed_irqs_with_eio(board: str, irq: int,
                                                               tmp_path: Path) -> None:
    root = Root(copy_board(board, tmp_path))
    for name in ("smp_affinity_list", "smp_affinity"):
        with pytest.raises(OSError) as error:
            root.write_text(f"/proc/irq/{irq}/{name}", "0")
        assert error.value.errno == errno.EIO


def test_fixture_root_moves_an_nvme_admin_queue(tmp_path: Path) -> None:
    tree = copy_board("x86-server-nvidia", tmp_path)
    Root(tree).write_text("/proc/irq/40/smp_affinity_list", "0-3")  # nvme0q0: not managed
    assert (tree / "proc/irq/40/smp_affinity_list").read_text() == "0-3\n"


@pytest.mark.parametrize(("value", "code"), [
    ("10000", errno.EINVAL),  # CPU 16: possible but offline, so no online CPU
    ("1,00000000", errno.EOVERFLOW),  # CPU 32 is beyond nr_cpu_ids
    ("0-3", errno.EINVAL)])  # a list, not a mask
def test_fixture_default_mask_refuses_like_the_kernel(value: str, code: int,
                                                      tmp_path: Path) -> None:
    tree = copy_board("x86-server-nvidia", tmp_path)
    with pytest.raises(OSError) as error:
        Root(tree).write_text(irqs.DEFAULT_AFFINITY, value)
    assert error.value.errno == code
    assert (tree / "proc/irq/default_smp_affinity").read_text() == "ffffffff\n"


def test_fixture_default_mask_reads_back_normalised(tmp_path: Path) -> None:
    tree = copy_board("x86-server-nvidia", tmp_path)
    Root(tree).write_text(irqs.DEFAULT_AFFINITY, "f")
    assert (tree / "proc/irq/default_smp_affinity").read_text() == "0000000f\n"


def _engine(board: str, tmp_path: Path, text: str) -> tuple[Path, Engine]:
    """A copy of the board and an engine whose profiles are the repository's plus ``irqs``."""
    tree = copy_board(board, tmp_path)
    profiles = tmp_path / "profiles"
    write_profile(profiles, "irqs", text)
    return tree, engine_for(tree, tmp_path / "state", [REPO_PROFILES, profiles])


@pytest.mark.parametrize("board", BOARDS)
def test_default_irq_affinity_plan_apply_verify_rollback(board: str, tmp_path: Path) -> None:
    tree, engine = _engine(board, tmp_path, "rt: {default_irq_affinity: housekeeping}\n")
    before = snapshot(tree)
    plan = engine.plan("irqs")
    (change,) = [c for c in plan.changes if c.path == irqs.DEFAULT_AFFINITY]
    housekeeping = plan.cpus["housekeeping"]
    assert change.desired == format_cpulist(housekeeping)
    assert change.write == irqs.format_mask(housekeeping)
    engine.apply("irqs")
    text = (tree / "proc/irq/default_smp_affinity").read_text()
    assert irqs.parse_mask(text) == housekeeping
    assert len(text.strip()) == len(before["proc/irq/default_smp_affinity"][1].strip())
    assert engine.verify() == []
    engine.rollback()
    assert snapshot(tree) == before


def test_default_irq_affinity_without_an_online_cpu_is_a_plan_error(tmp_path: Path) -> None:
    _tree, engine = _engine("jetson-agx-orin-jp6", tmp_path,
                            "rt: {default_irq_affinity: 'cpus:8-11'}\n")  # offline here
    with pytest.raises(ProfileError, match=r"rt\.default_irq_affinity: 8-11 holds no online "
                       r"CPU .*refuses a default IRQ mask"):
        engine.plan("irqs")


def test_switch_keeps_the_first_default_mask(tmp_path: Path) -> None:
    tree, engine = _engine("rk3588-vendor", tmp_path, "rt: {default_irq_affinity: 'cpus:0'}\n")
    write_profile(tmp_path / "profiles", "other", "rt: {default_irq_affinity: 'cpus:1-2'}\n")
    before = snapshot(tree)
    engine.apply("irqs")
    engine.apply("other")
    assert (tree / "proc/irq/default_smp_affinity").read_text() == "06\n"
    assert engine.verify() == []
    engine.apply("balanced")  # leaves it alone: the original comes back
    assert (tree / "proc/irq/default_smp_affinity").read_text() == "ff\n"
    engine.rollback()
    assert snapshot(tree) == before


def test_per_cpu_irqs_are_skipped_with_a_note(tmp_path: Path) -> None:
    _tree, engine = _engine("jetson-agx-orin-jp6", tmp_path,
                            "rt: {irq_affinity: {'arch_timer': 'cpus:0', 'arm-pmu': 'cpus:0'}}\n")
    plan = engine.plan("irqs")
    assert plan.changes == []
    assert "rt.irq_affinity.arch_timer: IRQ 11 (arch_timer) skipped: per-CPU IRQ (GICv3 PPI, " \
        "hwirq 30): its affinity cannot be set" in plan.warnings
    assert any(w.startswith("rt.irq_affinity.arm-pmu: IRQ 14 (arm-pmu) skipped: per-CPU")
               for w in plan.warnings)
    assert "irqs" not in plan.cpus


@pytest.mark.parametrize(("board", "managed"), [
    ("rk3588-vendor", [87]), ("x86-edge-npu", [131]),
    ("x86-server-nvidia", [41, 90])])
def test_managed_irqs_are_reported_as_managed(board: str, managed: list[int],
                                              tmp_path: Path) -> None:
    tree, engine = _engine(board, tmp_path, "rt: {irq_affinity: {'nvme*': 'cpus:0-1'}}\n")
    before = snapshot(tree)
    result = engine.apply("irqs")
    assert result.skipped == [f"/proc/irq/{irq}/smp_affinity_list: managed IRQ (kernel-managed "
                              "affinity, e.g. NVMe/multiqueue queues): the kernel refuses "
                              "affinity changes (EIO); isolcpus=managed_irq,... moves them at "
                              "boot" for irq in managed]
    assert engine.verify() == []
    engine.rollback()
    assert snapshot(tree) == before


class EioRoot(Root):
    """A fixture root where one more file fails with EIO."""

    def __init__(self, base: Path, refuse: str) -> None:
        super().__init__(base)
        self.refuse = refuse

    def write_text(self, path: str, value: str) -> None:
        if path == self.refuse:
            raise OSError(errno.EIO, "Input/output error", path)
        super().write_text(path, value)


def test_eio_outside_an_irq_affinity_file_is_not_taken_for_a_managed_irq(
        tmp_path: Path) -> None:
    tree = copy_board("rk3588-vendor", tmp_path)
    before = snapshot(tree)
    profiles = tmp_path / "profiles"
    write_profile(profiles, "irqs", "rt: {irq_affinity: {'*mmc*': 'cpus:0'}, "
                  "default_irq_affinity: 'cpus:0-3'}\n")
    engine = engine_for(tree, tmp_path / "state", [REPO_PROFILES, profiles],
                        root=EioRoot(tree, irqs.DEFAULT_AFFINITY))
    with pytest.raises(TuningError, match=r"default_smp_affinity .*Input/output error.*rolled "
                       r"back"):
        engine.apply("irqs")
    assert snapshot(tree) == before
    assert not (tmp_path / "state" / FILE_NAME).exists()


def test_rollback_of_an_apply_cut_short_passes_over_managed_irqs(tmp_path: Path) -> None:
    """An apply killed before it journaled its skips leaves a managed IRQ in the journal;
    the kernel never let it change, so its EIO on rollback is no failure."""
    tree, engine = _engine("x86-edge-npu", tmp_path, "rt: {irq_affinity: {'*': 'cpus:0'}}\n")
    before = snapshot(tree)
    engine.apply("irqs")
    state = engine.journal.load()
    assert state is not None and state.runtime["skipped"] == ["/proc/irq/131/smp_affinity_list"]
    state.status, state.runtime = "applying", {}
    engine.journal.save(state)
    assert engine.rollback()[0] == "irqs"
    assert snapshot(tree) == before


# -- MSI chips that cannot move a vector (docs/kernel-facts/rt-irqs.md) -----------------------

CHAINED = """\
           CPU0       CPU1
 11:     912344     812344     GICv3  30 Level     arch_timer
210:        618          0     PCI-MSI 67633152 Edge      nvme0q0
212:         18          0     DW-PCI-MSIX-0001:01:00.0    2 Edge      eth0
213:         51          0     BRCM STB PCIe MSI 524288 Edge      hailo
214:         51          0     ITS-PCI-MSI 524289 Edge      ath11k_pci
"""


def test_chained_msi_chips_are_recognised_by_name() -> None:
    rows = irqs.parse_rows(CHAINED)
    assert rows[213].chip == "BRCM STB PCIe MSI" and rows[213].actions == ["hailo"]
    assert irqs.has_gic(rows)
    refusals = {irq: irqs.chip_refusal(row, True) for irq, row in rows.items()}
    assert {irq: r[0] for irq, r in refusals.items() if r} == {
        210: errno.EINVAL, 212: errno.EIO, 213: errno.EINVAL}
    assert "DesignWare" in refusals[210][1] and "brcmstb" in refusals[213][1]  # type: ignore
    # x86's vector domain is "PCI-MSI" too, and moves
    assert irqs.chip_refusal(rows[210], irqs.has_gic({210: rows[210]})) is None


def _with_admin_queue(board: str, tmp_path: Path) -> Path:
    """The board with its NVMe admin queue (not managed) on the DesignWare MSI chip."""
    tree = copy_board(board, tmp_path)
    interrupts = tree / "proc/interrupts"
    lines = interrupts.read_text().splitlines(keepends=True)
    row = next(line for line in lines if line.rstrip().endswith("nvme0q1"))
    irq = int(row.split(":")[0]) - 1
    lines.insert(lines.index(row), row.replace(f"{irq + 1}:", f"{irq}:").replace(
        "nvme0q1", "nvme0q0"))
    interrupts.write_text("".join(lines))
    for name, value in (("smp_affinity_list", "0-7"), ("smp_affinity", "ff"),
                        ("effective_affinity_list", "0")):
        (tree / f"proc/irq/{irq}").mkdir(exist_ok=True)
        (tree / f"proc/irq/{irq}/{name}").write_text(value + "\n")
    return tree


def test_fixture_root_refuses_a_designware_msi_with_einval(tmp_path: Path) -> None:
    tree = _with_admin_queue("jetson-agx-orin-jp6", tmp_path)
    with pytest.raises(OSError) as error:
        Root(tree).write_text("/proc/irq/210/smp_affinity_list", "0")
    assert error.value.errno == errno.EINVAL
    with pytest.raises(OSError) as error:  # managed: EIO comes first, as in the kernel
        Root(tree).write_text("/proc/irq/211/smp_affinity_list", "0")
    assert error.value.errno == errno.EIO


def test_realtime_skips_designware_msi_irqs_and_applies(tmp_path: Path) -> None:
    tree = _with_admin_queue("jetson-agx-orin-jp6", tmp_path / "board")
    engine = engine_for(tree, tmp_path / "state", [REPO_PROFILES])
    before = snapshot(tree)
    plan = engine.plan("realtime")
    assert not [c for c in plan.changes if c.path.startswith("/proc/irq/21")]
    for irq, name in ((210, "nvme0q0"), (211, "nvme0q1")):
        assert f"rt.irq_affinity.*: IRQ {irq} ({name}) skipped: its MSI chip cannot move it " \
            "(DesignWare PCIe MSI (pcie-designware-host.c: dw_pci_msi_set_affinity returns " \
            "-EINVAL); every vector arrives through one parent interrupt): the kernel " \
            "answers EINVAL" in plan.warnings
    engine.apply("realtime")
    assert engine.verify() == []
    engine.rollback()
    assert snapshot(tree) == before
