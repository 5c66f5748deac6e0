"""Regenerate ``tests/golden/<board>.json`` from ``edge-agent discover --root <tree> --json``
of every tree in ``tests/fixtures/`` (run from anywhere: ``python tests/golden/update.py``),
then review the diff with ``git diff tests/golden``.  ``tests/test_golden.py`` compares them.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from test_golden import BOARDS, GOLDEN, discover_json


def main() -> int:
    for stale in set(GOLDEN.glob("*.json")) - {GOLDEN / f"{board}.json" for board in BOARDS}:
        stale.unlink()
        print(f"removed {stale.name}")
    for board in BOARDS:
        path = GOLDEN / f"{board}.json"
        text = discover_json(board)
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            print(f"wrote {path.name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
