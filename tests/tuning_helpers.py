"""Shared helpers for the tuning tests: fixture copies, snapshots, an engine on a copy."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from agent.discovery import discover
from agent.kernel.fsroot import Root
from agent.tuning.engine import Engine
from agent.tuning.journal import Journal
from agent.tuning.profiles import ProfileStore

FIXTURES = Path(__file__).resolve().parent / "fixtures"
REPO_PROFILES = Path(__file__).resolve().parents[1] / "profiles"
BOARDS = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir() and p.name[0] not in "_.")
sys.path.insert(0, str(FIXTURES))
from make_fixtures import tree_listing  # noqa: E402

SharedBoard = Callable[[str], Path]  # the shared_board fixture's type (conftest.py)


def copy_board(name: str, dest: Path) -> Path:
    """A copy of a board's fixture tree (symlinks kept as links) that a test may change.
    ``cp -a`` does it in a tenth of copytree's time for these 2,000-file trees, which
    hundreds of tests copy."""
    target = dest / name
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(["cp", "-a", "--no-target-directory", str(FIXTURES / name), str(target)],
                   check=True)
    return target


class ReadOnlyRoot(Root):
    """A Root over a fixture copy that several tests share (``shared_board`` in conftest.py):
    a write through the filesystem layer fails the test that made it.  Writes past it (a
    test's own) are caught when the session ends, where each shared copy is compared with
    the committed tree."""

    def write_text(self, path: str, value: str) -> None:
        raise AssertionError(f"{path}: a plan-only test wrote to a shared fixture copy")

    def mkdir(self, path: str) -> bool:
        raise AssertionError(f"{path}: a plan-only test made a directory in a shared copy")

    def rmdir(self, path: str) -> None:
        raise AssertionError(f"{path}: a plan-only test removed a directory of a shared copy")


def plan_engine(tree: Path, state: Path, profile_dirs: list[Path] | None = None) -> Engine:
    """``engine_for`` on a shared copy, through a ReadOnlyRoot: for tests that only plan."""
    return engine_for(tree, state, profile_dirs, root=ReadOnlyRoot(tree))


def snapshot(tree: Path) -> dict[str, tuple[str, bytes]]:
    return tree_listing(tree)


def engine_for(tree: Path, state: Path, profile_dirs: list[Path] | None = None,
               root: Root | None = None, persistent: bool = False) -> Engine:
    """``persistent``: the engine writes persistent settings too, as the CLI run as root."""
    root = root or Root(tree)
    return Engine(root, discover(root), Journal(state),
                  ProfileStore(root, dirs=profile_dirs or [REPO_PROFILES]),
                  persistent=persistent)


def write_profile(directory: Path, name: str, text: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.yaml"
    path.write_text(text)
    return path


@contextmanager
def named_thread(name: str) -> Iterator[int]:
    """A thread of the test process with ``comm`` set to ``name``; yields its native TID and
    ends it afterwards."""
    ready, release, tids = threading.Event(), threading.Event(), []

    def worker() -> None:
        tids.append(threading.get_native_id())
        Path(f"/proc/self/task/{tids[0]}/comm").write_text(name)
        ready.set()
        release.wait(30)

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    ready.wait(10)
    try:
        yield tids[0]
    finally:
        release.set()
        thread.join()
