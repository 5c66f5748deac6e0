"""CI's wiring and the constraints files it tests, checked on the host in a second.

``.ci/run`` must run the README's test command as written, then the aarch64 lane
(``.ci/aarch64``), and fail when either fails; the lane's test subset and smoke boards must
exist; and every constraints file for another platform pins the x86_64 file's versions,
except the pins its header lists as differences (each with its reason).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

CHECKOUT = Path(__file__).resolve().parents[1]
CONSTRAINTS = CHECKOUT / "constraints"
REFERENCE = CONSTRAINTS / "linux-x86_64-py3.11.txt"
README_TEST_COMMAND = "./install.sh --dev && .venv/bin/python -m pytest"


def fake_checkout(tmp_path: Path, exits: dict[str, int]) -> tuple[Path, Path]:
    """A copy of .ci/run beside stand-ins for install.sh, the venv's python and the lane,
    each logging its name and arguments and exiting with its code from ``exits``."""
    log = tmp_path / "calls"
    for name in ("install.sh", ".venv/bin/python", ".ci/aarch64"):
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f'#!/bin/sh\necho "{name} $*" >> {log}\nexit {exits.get(name, 0)}\n')
        path.chmod(0o755)
    shutil.copy2(CHECKOUT / ".ci/run", tmp_path / ".ci/run")
    return tmp_path / ".ci/run", log


def test_the_readme_test_command_is_what_ci_runs() -> None:
    assert README_TEST_COMMAND in (CHECKOUT / "README.md").read_text()
    lines = (CHECKOUT / ".ci/run").read_text().splitlines()
    assert any(line.startswith(README_TEST_COMMAND) for line in lines)


def test_ci_runs_the_tests_then_the_aarch64_lane(tmp_path: Path) -> None:
    script, log = fake_checkout(tmp_path, {})
    code = subprocess.run([str(script)], timeout=30, check=False).returncode
    assert (code, log.read_text().splitlines()) == (
        0, ["install.sh --dev", ".venv/bin/python -m pytest", ".ci/aarch64 "])


@pytest.mark.parametrize(("failing", "calls"), [
    ("install.sh", ["install.sh --dev"]),
    (".venv/bin/python", ["install.sh --dev", ".venv/bin/python -m pytest"]),
    (".ci/aarch64", ["install.sh --dev", ".venv/bin/python -m pytest", ".ci/aarch64 "]),
])
def test_a_failing_step_fails_ci_and_stops_it(tmp_path: Path, failing: str,
                                              calls: list[str]) -> None:
    script, log = fake_checkout(tmp_path, {failing: 3})
    code = subprocess.run([str(script)], timeout=30, check=False).returncode
    assert (code, log.read_text().splitlines()) == (3, calls)


def lane_array(name: str) -> list[str]:
    """A bash array's words as .ci/aarch64 declares it (``NAME=(a b\\n c)``)."""
    text = (CHECKOUT / ".ci/aarch64").read_text()
    found = re.search(rf"^{name}=\(([^)]*)\)", text, re.MULTILINE)
    assert found, f".ci/aarch64 declares no {name}"
    return found.group(1).split()


def test_the_lane_runs_tests_that_exist_within_its_budget() -> None:
    tests = lane_array("AARCH64_TESTS")
    assert tests and all((CHECKOUT / test).is_file() for test in tests), tests
    budget = re.search(r'budget="\$\{EDGE_AGENT_AARCH64_BUDGET_S:-(\d+)\}"',
                       (CHECKOUT / ".ci/aarch64").read_text())
    assert budget and int(budget.group(1)) <= 25 * 60


def test_the_lane_smokes_fixture_boards_that_exist() -> None:
    smoke = (CHECKOUT / ".ci/aarch64_smoke.py").read_text()
    boards = re.findall(r'"([a-z0-9-]+)": "(?:jetson-orin|rk3588)"', smoke)
    assert sorted(boards) == ["jetson-agx-orin-jp6", "rk3588-vendor"]
    assert all((CHECKOUT / "tests/fixtures" / board).is_dir() for board in boards)


def pins(path: Path) -> dict[str, str]:
    result: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            result[re.sub(r"[-_.]+", "-", name).lower()] = version
    return result


def listed_differences(path: Path) -> dict[str, str]:
    """The header's ``#   name==version (x86_64: ...)`` lines: the pins that differ."""
    found = re.findall(r"^#   ([A-Za-z0-9_.-]+)==(\S+) ", path.read_text(), re.MULTILINE)
    return {re.sub(r"[-_.]+", "-", name).lower(): version for name, version in found}


OTHERS = sorted(p.name for p in CONSTRAINTS.glob("*.txt") if p != REFERENCE)


def test_there_are_constraints_for_aarch64() -> None:
    assert "linux-aarch64-py3.11.txt" in OTHERS
    # install.sh looks for <os>-<arch>-py<X.Y>.txt
    assert all(re.fullmatch(r"linux-(aarch64|x86_64)-py3\.\d+\.txt", name) for name in OTHERS)


@pytest.mark.parametrize("name", OTHERS)
def test_constraints_pin_the_x86_64_versions_or_list_why_not(name: str) -> None:
    reference, other = pins(REFERENCE), pins(CONSTRAINTS / name)
    differing = {package: version for package, version in other.items()
                 if reference.get(package) != version}
    assert differing == listed_differences(CONSTRAINTS / name)
    missing = sorted(set(reference) - set(other))
    if missing:  # a file for fewer packages says which it leaves out
        header = (CONSTRAINTS / name).read_text()
        assert all(package in header.lower() for package in missing), missing
