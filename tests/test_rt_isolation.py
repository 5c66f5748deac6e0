"""The realtime profile against what the kernel does with it: the default IRQ mask and
``irqaffinity=`` beside it (docs/kernel-facts/rt-irqs.md)."""

from __future__ import annotations

from pathlib import Path

from test_persistent_tuning import board
from tuning_helpers import REPO_PROFILES, copy_board, engine_for, snapshot, write_profile

from agent.kernel import irqs


def test_realtime_moves_the_default_irq_mask_to_housekeeping(tmp_path: Path) -> None:
    tree = copy_board("rk3588-vendor", tmp_path / "board")
    engine = engine_for(tree, tmp_path / "state", [REPO_PROFILES])
    before = snapshot(tree)
    plan = engine.plan("realtime")
    (change,) = [c for c in plan.changes if c.path == irqs.DEFAULT_AFFINITY]
    assert change.desired == "0-3"  # the little cores: housekeeping on a RK3588
    engine.apply("realtime")
    assert (tree / "proc/irq/default_smp_affinity").read_text() == "0f\n"
    assert engine.verify() == []
    engine.rollback()
    assert snapshot(tree) == before


def test_a_profile_with_kernel_arguments_gets_irqaffinity_too(tmp_path: Path) -> None:
    tree = board("jetson-extlinux", tmp_path)
    write_profile(tmp_path / "profiles", "rt-boot",
                  "include: [realtime]\ncmdline: {nohz_full: cpus:4-5}\n")
    engine = engine_for(tree, tmp_path / "state", [REPO_PROFILES, tmp_path / "profiles"])
    by_path = {c.path: c for c in engine.plan("rt-boot").changes}
    assert by_path["cmdline:irqaffinity"].desired == "irqaffinity=0"
    assert by_path[irqs.DEFAULT_AFFINITY].desired == "0"
    # without a cmdline section the boot config is left alone
    assert not [c for c in engine.plan("realtime").changes if c.tuner == "cmdline"]
