"""Board x profile matrix: every bundled profile planned, applied, verified and rolled back on
a copy of every fixture board tree, through the CLI's own code (``edge-agent profile apply /
verify / rollback --root COPY``), and the copy byte-compared before and after.

Prints a Markdown table, one row per board and profile: whether the profile's ``match``
fits the board (others are applied with --force, as an operator could), the number of
planned changes, what was skipped and why (at plan time: a knob the kernel lacks; at apply:
a write the kernel refused), the writes made, whether verify found every setting holding,
and whether rollback left the tree byte for byte as it was.  Exit status 1 when a row
failed (a profile for the board refused, an apply that failed, drift, a tree not restored).

    python scripts/profile_matrix.py                       # every board x every profile
    python scripts/profile_matrix.py --board rk3588-vendor --profile latency
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
PROFILES = REPO / "profiles"
sys.path.insert(0, str(REPO))

from agent import cli  # noqa: E402
from agent.discovery import discover  # noqa: E402
from agent.kernel.fsroot import Root  # noqa: E402
from agent.tuning.profiles import ProfileStore  # noqa: E402

REASON_WORDS = 12  # a skip's reason, cut at a word: the table stays readable
HEADER = ("board", "profile", "match", "planned", "skipped (reason)", "applied", "verified",
          "rolled back exactly")


@dataclass
class Row:
    board: str
    profile: str
    match: str = ""
    planned: str = ""
    skipped: list[str] = field(default_factory=list)
    applied: str = ""
    verified: str = ""
    exact: str = ""
    failed: bool = False
    refused: str = ""  # why the profile was refused at plan time

    def cells(self) -> list[str]:
        skipped = f"{len(self.skipped)}: " + "; ".join(self.skipped) if self.skipped else "0"
        skipped = f"refused: {self.refused}" if self.refused else skipped
        return [self.board, self.profile, self.match, self.planned, skipped, self.applied,
                self.verified, self.exact]


def boards(fixtures: Path) -> list[str]:
    """The fixture board trees (a directory with a sys/ tree)."""
    return sorted(p.name for p in fixtures.iterdir() if (p / "sys").is_dir())


def profiles(directory: Path) -> list[str]:
    return sorted(p.stem for p in directory.glob("*.yaml"))


def listing(tree: Path) -> dict[str, tuple[str, bytes]]:
    """Every entry below ``tree``: a link's target, a file's bytes, a directory."""
    entries: dict[str, tuple[str, bytes]] = {}
    for top, dirs, files in os.walk(tree):
        for name in [*dirs, *files]:
            path = Path(top) / name
            relative = str(path.relative_to(tree))
            if path.is_symlink():
                entries[relative] = ("link", os.readlink(path).encode())
            elif path.is_dir():
                entries[relative] = ("dir", b"")
            else:
                entries[relative] = ("file", path.read_bytes())
    return entries


def edge_agent(*argv: str) -> tuple[int, str, str]:
    """``edge-agent ARGV`` in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(list(argv))
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 1
    return code, out.getvalue(), err.getvalue()


def short(text: str, words: int = REASON_WORDS) -> str:
    """The first ``words`` words, cut at a word; pipes escaped for the table.  "PATH does not
    exist on this device (why)" reads "no PATH: why"."""
    missing = re.match(r"(\S+) does not exist on this device:? ?\(?(.*?)\)?$", text)
    if missing:
        text = f"no {missing.group(1)}" + (f": {missing.group(2)}" if missing.group(2) else "")
    parts = text.split()
    cut = " ".join(parts[:words]) + (" …" if len(parts) > words else "")
    return cut.replace("|", "\\|")


def _skips(plan: dict[str, Any], skipped: list[str]) -> list[str]:
    """Plan-time skips (``key: skipped: why``) and apply-time ones (``path: why``)."""
    found = []
    for warning in plan.get("warnings", []):
        key, sep, why = warning.partition(": skipped: ")
        if sep:
            found.append(f"{key} ({short(why)})")
    for skip in skipped:
        path, _, why = skip.partition(": ")
        found.append(f"{path} ({short(why)})")
    return found


def run_one(board: str, profile: str, fixtures: Path, work: Path) -> Row:
    """Copy the board, then apply / verify / rollback ``profile`` on the copy."""
    row = Row(board, profile)
    tree, state = work / board, work / "state"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    subprocess.run(["cp", "-a", "--no-target-directory", str(fixtures / board), str(tree)],
                   check=True)
    root = Root(tree)
    loaded = ProfileStore(root, dirs=[PROFILES]).load(profile)
    fits = not loaded.match or loaded.matches(discover(root).board)
    row.match = "yes" if fits else "no (forced)"
    before = listing(tree)
    where = ("--root", str(tree), "--state-dir", str(state))
    code, out, err = edge_agent("profile", "apply", profile, "--force", "--json", *where)
    if not out.strip():  # refused before anything was written
        row.planned, row.applied, row.verified = "refused", "—", "—"
        why = err.strip().splitlines()[-1] if err.strip() else f"exit status {code}"
        why = why.removeprefix("edge-agent profile apply: ").replace(f"{PROFILES}/", "")
        row.refused, row.failed = short(why, 24), fits
    else:
        result = json.loads(out)
        row.planned = str(len(result["changes"]))
        row.skipped = _skips(result, result["skipped"])
        row.applied = str(result["written"])
        code, out, _ = edge_agent("profile", "verify", "--json", *where)
        drift = json.loads(out)["drift"] if out.strip() else []
        row.verified = "yes" if code == 0 else f"no: {len(drift)} drifted"
        row.failed = code != 0
        code, _, err = edge_agent("profile", "rollback", "--json", *where)
        if code != 0:
            row.failed = True
            row.exact = f"rollback failed: {short(err.strip(), 12)}"
    after = listing(tree)
    differ = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    if not row.exact:
        row.exact = "yes" if not differ else f"no: {len(differ)} differ ({', '.join(differ[:3])})"
        row.failed = row.failed or bool(differ)
    return row


def table(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row.cells()) + " |" for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--board", action="append", help="only this board (repeatable)")
    parser.add_argument("--profile", action="append", help="only this profile (repeatable)")
    parser.add_argument("--fixtures", type=Path, default=FIXTURES, help="board trees")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="profile-matrix-") as work:
        for board in args.board or boards(args.fixtures):
            for profile in args.profile or profiles(PROFILES):
                rows.append(run_one(board, profile, args.fixtures, Path(work) / "cell"))
    print(table(rows))
    return 1 if any(row.failed for row in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
