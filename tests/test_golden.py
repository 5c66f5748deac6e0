"""Golden output per fixture board: ``edge-agent discover --root <tree> --json`` of each tree
in ``tests/fixtures/`` against the checked-in ``tests/golden/<board>.json``, as
node_exporter's end-to-end test does, so any change to what discovery reports shows up as a
diff in review.

The command runs as a real process (``python -m agent``) from this checkout.  Only the
``root`` field depends on where the checkout is: it is checked to be the tree's resolved path,
then written as ``tests/fixtures/<board>``.  Nothing else may depend on the host (a fixture
root reads no host file, udev or NVML), and a second run must give the same bytes.

After a deliberate change, regenerate every file and review the diff::

    python tests/golden/update.py
"""

from __future__ import annotations

import difflib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from tuning_helpers import copy_board

CHECKOUT = Path(__file__).resolve().parents[1]
FIXTURES = CHECKOUT / "tests" / "fixtures"
GOLDEN = CHECKOUT / "tests" / "golden"
BOARDS = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir() and p.name[0] not in "_.")
UPDATE = "python tests/golden/update.py"


def discover_json(board: str, tree: Path | None = None) -> str:
    """The CLI's ``discover --json`` of the board's tree (or of ``tree``, a copy of it), with
    ``root`` written as ``tests/fixtures/<board>``."""
    tree = tree or FIXTURES / board
    result = subprocess.run([sys.executable, "-m", "agent", "discover", "--root", str(tree),
                             "--json"], capture_output=True, text=True, cwd=CHECKOUT,
                            timeout=120, check=False)
    assert result.returncode == 0, f"discover --root {tree} failed:\n{result.stderr}"
    output = json.loads(result.stdout)
    assert output["root"] == str(tree.resolve()), f"root {output['root']!r} is not {tree}"
    output["root"] = (FIXTURES / board).relative_to(CHECKOUT).as_posix()
    return json.dumps(output, indent=2) + "\n"


def test_every_board_has_a_golden_file_and_no_other_is_left() -> None:
    assert BOARDS, f"no fixture trees in {FIXTURES}"
    expected = {f"{board}.json" for board in BOARDS}
    present = {path.name for path in GOLDEN.glob("*.json")}
    assert present == expected, (f"missing: {sorted(expected - present)}, stale: "
                                 f"{sorted(present - expected)}; run {UPDATE}")


@pytest.mark.parametrize("board", BOARDS)
def test_discover_matches_its_golden_file(board: str) -> None:
    golden = GOLDEN / f"{board}.json"
    if not golden.exists():
        pytest.fail(f"{golden.relative_to(CHECKOUT)} is missing; run {UPDATE}")
    actual = discover_json(board)
    expected = golden.read_text()
    if actual != expected:
        diff = difflib.unified_diff(expected.splitlines(keepends=True),
                                    actual.splitlines(keepends=True),
                                    f"tests/golden/{board}.json", f"discover --root {board}")
        pytest.fail(f"discover --json of {board} differs from its golden file (if the change "
                    f"is deliberate, run {UPDATE} and review the diff):\n{''.join(diff)}",
                    pytrace=False)


@pytest.mark.parametrize("board", BOARDS)
def test_discover_does_not_depend_on_where_the_tree_is(board: str, tmp_path: Path) -> None:
    """A copy elsewhere, read by a second run, gives the same output: nothing from the
    checkout's path, the time or the host leaks in besides ``root``."""
    copy = copy_board(board, tmp_path / "elsewhere")  # cp -a: links kept as links
    assert discover_json(board, copy) == (GOLDEN / f"{board}.json").read_text()
