"""scripts/profile_matrix.py: one board x one profile through the CLI's apply, verify and
rollback on a copy, and the Markdown row it prints."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
from tuning_helpers import FIXTURES, plan_engine

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "profile_matrix.py"


@pytest.fixture(scope="module")
def matrix() -> ModuleType:
    spec = importlib.util.spec_from_file_location("profile_matrix", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["profile_matrix"] = module
    spec.loader.exec_module(module)
    return module


def test_one_cell_applies_verifies_and_rolls_back_exactly(
        matrix: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = plan_engine(FIXTURES / "rk3588-vendor", tmp_path / "state").plan("latency")
    assert matrix.main(["--board", "rk3588-vendor", "--profile", "latency"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| board | profile | match | planned | skipped (reason) | applied | " \
        "verified | rolled back exactly |"
    assert len(lines) == 3
    cells = [c.strip() for c in lines[2].strip("|").split(" | ")]
    skipped = [w.split(": skipped: ")[0] for w in plan.warnings if ": skipped: " in w]
    assert cells[:4] == ["rk3588-vendor", "latency", "yes", str(len(plan.changes))]
    assert skipped == ["sysctl.kernel.numa_balancing"]
    assert cells[4] == "1: sysctl.kernel.numa_balancing (no /proc/sys/kernel/numa_balancing: " \
        "the kernel is built without CONFIG_NUMA_BALANCING)"
    assert cells[5:] == [str(len(plan.changes)), "yes", "yes"]


def test_a_tree_left_changed_is_not_exact(matrix: ModuleType, tmp_path: Path) -> None:
    tree = tmp_path / "t"
    (tree / "sys").mkdir(parents=True)
    (tree / "sys/a").write_text("1\n")
    before = matrix.listing(tree)
    (tree / "sys/a").write_text("2\n")
    (tree / "sys/b").symlink_to("a")
    after = matrix.listing(tree)
    assert {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)} == {
        "sys/a", "sys/b"}


def test_a_profile_for_another_board_that_is_refused_is_not_a_failure(
        matrix: ModuleType, tmp_path: Path) -> None:
    row = matrix.run_one("rk3588-vendor", "jetson-orin", FIXTURES, tmp_path / "cell")
    assert (row.match, row.planned, row.exact, row.failed) == ("no (forced)", "refused", "yes",
                                                               False)
    assert row.refused.startswith("jetson-orin.yaml: dvfs.gpu.governor: 'nvhost_podgov' is "
                                  "not available")
