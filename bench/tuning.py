"""Benchmark: a full profile switch and its rollback on a fixture copy, and what the crash-safe
journal costs against plain writes of the same values, side by side in one run.

Targets (issue 3): plan + apply + verify <= 17 ms; journal overhead <= 2x plain writes.
The topology is discovered once beforehand, as the service does.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from agent.discovery import discover
from agent.kernel.fsroot import Root
from agent.tuning.engine import Engine
from agent.tuning.journal import Journal
from agent.tuning.plan import Change
from agent.tuning.profiles import ProfileStore

REPO = Path(__file__).resolve().parents[1]


def timed(work: Callable[[], object]) -> float:
    start = time.perf_counter()
    work()
    return (time.perf_counter() - start) * 1000


def plain_writes(root: Root, changes: list[Change]) -> None:
    """The same writes without the journal, resolving paths as the engine does (each link
    read once per operation)."""
    with root.cached_links():
        for change in changes:
            root.write_text(change.path, change.write_value)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--board", default="x86-server-nvidia")
    parser.add_argument("--profile", default="realtime")
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        tree = Path(scratch) / "root"
        shutil.copytree(REPO / "tests" / "fixtures" / args.board, tree, symlinks=True)
        root = Root(tree)
        engine = Engine(root, discover(root), Journal(Path(scratch) / "state"),
                        ProfileStore(root, dirs=[REPO / "profiles"]))
        changes = engine.plan(args.profile, force=True).changes
        plan_ms, apply_ms, verify_ms, rollback_ms, plain_ms = [], [], [], [], []
        for _ in range(args.runs):
            plan_ms.append(timed(lambda: engine.plan(args.profile, force=True)))
            apply_ms.append(timed(lambda: engine.apply(args.profile, force=True)))
            verify_ms.append(timed(engine.verify))
            rollback_ms.append(timed(engine.rollback))
            plain_ms.append(timed(lambda: plain_writes(root, changes)))
            for change in reversed(changes):  # put the plain writes back, untimed
                root.write_text(change.path, change.restore_value)

    med = statistics.median
    journaled = med(apply_ms) - med(plan_ms)  # apply plans again, then journal + writes
    print(f"{args.board}, profile {args.profile}: {len(changes)} settings, median of "
          f"{args.runs} runs")
    print(f"  plan                       {med(plan_ms):7.2f} ms")
    print(f"  apply (plan+journal+write) {med(apply_ms):7.2f} ms")
    print(f"  verify                     {med(verify_ms):7.2f} ms")
    print(f"  full switch                {med(apply_ms) + med(verify_ms):7.2f} ms   "
          "(plan + apply + verify; target <= 17 ms)")
    print(f"  rollback                   {med(rollback_ms):7.2f} ms")
    print(f"  plain writes (baseline)    {med(plain_ms):7.2f} ms")
    print(f"  journaled writes           {journaled:7.2f} ms   ratio "
          f"{journaled / med(plain_ms):.2f}x plain writes (target <= 2x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
