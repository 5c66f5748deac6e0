"""The committed fixture trees are exactly what their builders produce, and are sound."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parent / "fixtures"
sys.path.insert(0, str(FIXTURES))
import make_fixtures  # noqa: E402


@pytest.mark.parametrize("name", sorted(make_fixtures.BOARDS))
def test_committed_tree_matches_its_builder(name: str, tmp_path: Path) -> None:
    rebuilt = make_fixtures.build_board(name, tmp_path)
    committed = make_fixtures.tree_listing(FIXTURES / name)
    fresh = make_fixtures.tree_listing(rebuilt)
    assert sorted(set(committed) ^ set(fresh)) == [], "run tests/fixtures/make_fixtures.py"
    changed = [path for path in fresh if fresh[path] != committed[path]]
    assert changed == [], "run tests/fixtures/make_fixtures.py"


@pytest.mark.parametrize("name", sorted(make_fixtures.BOARDS))
def test_tree_has_no_empty_dirs_or_dangling_links(name: str) -> None:
    assert make_fixtures.problems(FIXTURES / name) == []
