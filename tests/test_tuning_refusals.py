"""Writes the real kernels refuse: planned as skips where the plan can see the reason, and an
unexpected refusal of an optional section's write skipped (journaled, so verify and rollback
stay exact) instead of failing the whole apply (issue 31 item 5)."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
from tuning_helpers import REPO_PROFILES, copy_board, engine_for, snapshot, write_profile

from agent.kernel.fsroot import Root
from agent.kernel.pcie_aspm import BOOT_FLAGS, BOOT_LOG, FADT, NO_ASPM, OSC_RETAINED, POLICY
from agent.tuning.engine import TuningError

BOARD = "x86-edge-npu"


def _fadt(flags: int) -> bytes:
    """A FACP table of ACPI 6 length whose IAPC_BOOT_ARCH flags are ``flags``."""
    table = bytearray(276)
    table[:4] = b"FACP"
    table[BOOT_FLAGS:BOOT_FLAGS + 2] = flags.to_bytes(2, "little")
    return bytes(table)


def _board(tmp_path: Path, fadt: int | None = None, osc_retained: bool = False) -> Path:
    tree = copy_board(BOARD, tmp_path)
    if fadt is not None:
        (tree / FADT.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
        (tree / FADT.lstrip("/")).write_bytes(_fadt(fadt))
    if osc_retained:
        (tree / BOOT_LOG.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
        (tree / BOOT_LOG.lstrip("/")).write_text(
            f"[    0.912345] acpi PNP0A08:00: {OSC_RETAINED} (AE_NOT_FOUND)\n")
    return tree


def test_the_fixture_kernel_answers_eperm_under_firmware_aspm_control(tmp_path: Path) -> None:
    for name, tree in (("fadt", _board(tmp_path / "a", fadt=NO_ASPM)),
                       ("osc", _board(tmp_path / "b", osc_retained=True))):
        with pytest.raises(OSError) as error:
            Root(tree).write_text(POLICY, "performance")
        assert error.value.errno == errno.EPERM, name
    Root(_board(tmp_path / "c", fadt=0)).write_text(POLICY, "performance")  # the OS controls it


def test_the_fadt_flag_is_planned_as_a_skip(tmp_path: Path) -> None:
    tree = _board(tmp_path, fadt=NO_ASPM)
    before = snapshot(tree)
    engine = engine_for(tree, tmp_path / "state")
    plan = engine.plan("x86-latency", force=True)
    assert POLICY not in [c.path for c in plan.changes]
    assert any(w.startswith("pcie.aspm_policy: skipped: the firmware keeps ASPM control "
                            f"({FADT}: ACPI_FADT_NO_ASPM") for w in plan.warnings)
    result = engine.apply("x86-latency", force=True)
    assert result.skipped == [] and result.written
    assert engine.verify() == []
    engine.rollback()
    assert snapshot(tree) == before


def test_an_osc_refusal_skips_the_optional_pcie_section(tmp_path: Path) -> None:
    """x86-latency lists pcie under optional: the EPERM the plan could not foresee (_OSC)
    skips that write, the rest applies, verify holds and rollback is byte-exact."""
    tree = _board(tmp_path, osc_retained=True)
    before = snapshot(tree)
    engine = engine_for(tree, tmp_path / "state")
    plan = engine.plan("x86-latency", force=True)
    assert POLICY in [c.path for c in plan.changes] and "pcie.aspm_policy" in plan.optional
    result = engine.apply("x86-latency", force=True)
    assert [s.split(": ", 1)[0] for s in result.skipped] == [POLICY]
    assert "the kernel refused the write (EPERM" in result.skipped[0]
    assert "pcie is optional in this profile" in result.skipped[0]
    assert len(result.written) == len(plan.changes) - 1
    state = engine.journal.load()
    assert state is not None and state.status == "applied"
    assert state.runtime["skipped"] == [POLICY]
    assert engine.verify() == []
    assert engine.rollback()[0] == "x86-latency"
    assert snapshot(tree) == before


def test_a_refusal_of_a_key_the_profile_asks_for_fails_the_apply(tmp_path: Path) -> None:
    tree = _board(tmp_path, osc_retained=True)
    before = snapshot(tree)
    profiles = tmp_path / "profiles"
    write_profile(profiles, "own", "include: [x86-latency]\npcie: {aspm_policy: performance}\n")
    engine = engine_for(tree, tmp_path / "state", [profiles, REPO_PROFILES])
    assert "pcie.aspm_policy" not in engine.plan("own", force=True).optional
    with pytest.raises(TuningError, match=r"failed at /sys/module/pcie_aspm/parameters/policy "
                       r"\(pcie.aspm_policy\).*every earlier write was rolled back"):
        engine.apply("own", force=True)
    assert not engine.journal.exists()
    assert snapshot(tree) == before
