"""Crash safety: an apply killed with SIGKILL at any of its writes always rolls back exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tuning_helpers import REPO_PROFILES, copy_board, engine_for, snapshot

from agent.tuning.journal import FILE_NAME

KILL_POINTS = 16  # spread evenly over the apply's writes, and each journal update besides
# A prepared parent: it imports and discovers once, then for each request "STATE N" forks a
# child that runs the real engine and journal on the tree and SIGKILLs itself right before
# its write number N (counting from 0: after N writes), so the kill lands mid-apply by
# construction, not by a sleep. A write is every call that can change what is on disk (a
# write, flush, truncate or close of a writable file, an os call that creates, renames,
# removes or syncs): a kill anywhere between two writes leaves what a kill right before the
# second leaves, so these kill points reach every state a kill at a random moment can. The
# parent answers "killed", or, for an N past the last write, "done WRITES R1 R2 ..." where
# each R is the number of writes before an os.replace (a journal update).
CHILD = """
import io, os, signal, sys
from agent.discovery import discover
from agent.kernel.fsroot import Root
from agent.tuning.engine import Engine
from agent.tuning.journal import Journal
from agent.tuning.profiles import ProfileStore
from pathlib import Path

WRITING_METHODS = {"write", "writelines", "truncate", "flush", "close", "__exit__"}
WRITING_CALLS = {"open", "write", "pwrite", "ftruncate", "truncate", "fsync", "fdatasync",
                 "replace", "rename", "unlink", "remove", "rmdir", "mkdir", "link",
                 "symlink", "chmod", "fchmod", "chown", "utime", "close"}

root = Root(sys.argv[1])
topology = discover(root)  # the tree is restored before every fork: the same each time
store = ProfileStore(root, dirs=[Path(sys.argv[2])])
print("ready", flush=True)
for request in sys.stdin:
    state, kill_before = request.split()
    pid = os.fork()
    if pid == 0:
        writes, replaces = [0], []

        def before_each_write(frame, event, function):
            if event == "c_call":
                owner = getattr(function, "__self__", None)
                name = getattr(function, "__name__", "")
                if isinstance(owner, io.IOBase):
                    is_write = (name in WRITING_METHODS and not owner.closed
                                and owner.writable())
                else:
                    is_write = (getattr(function, "__module__", None) == "posix"
                                and name in WRITING_CALLS)
                if not is_write:
                    return
                if writes[0] == int(kill_before):
                    os.kill(os.getpid(), signal.SIGKILL)
                if name == "replace":
                    replaces.append(writes[0])
                writes[0] += 1

        engine = Engine(root, topology, Journal(state), store)
        sys.setprofile(before_each_write)
        engine.apply("realtime", force=True)
        sys.setprofile(None)
        print("done", writes[0], *replaces, flush=True)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
        print("killed", flush=True)
    elif not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0):
        print("failed", status, flush=True)
"""


def listing(tree: Path) -> dict[str, tuple[str, bytes]]:
    """``snapshot(tree)``, a few times faster (os.scandir): it runs twice per kill point.
    The test checks that the two agree."""
    found: dict[str, tuple[str, bytes]] = {}

    def walk(directory: str, prefix: str) -> None:
        with os.scandir(directory) as entries:
            for entry in entries:
                name = prefix + entry.name
                if entry.is_symlink():
                    found[name] = ("link", os.readlink(entry.path).encode())
                elif entry.is_dir():
                    walk(entry.path, name + "/")
                elif entry.is_file():
                    found[name] = ("file", Path(entry.path).read_bytes())

    walk(str(tree), "")
    return found


def test_sigkill_during_apply_always_rolls_back_exactly(tmp_path: Path) -> None:
    tree = copy_board("x86-edge-npu", tmp_path)  # reused: each rollback must restore it
    expected = snapshot(tree)
    assert listing(tree) == expected
    parent = subprocess.Popen([sys.executable, "-c", CHILD, str(tree), str(REPO_PROFILES)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert parent.stdin is not None and parent.stdout is not None
    outcomes = {"no journal": 0, "applying": 0, "applied": 0}

    def apply_and_roll_back(state: Path, kill_before: int) -> str:
        assert parent.stdin is not None and parent.stdout is not None
        parent.stdin.write(f"{state} {kill_before}\n")
        parent.stdin.flush()
        answer = parent.stdout.readline().strip()
        journal = state / FILE_NAME
        if not journal.exists():
            assert listing(tree) == expected, "a write happened without a journal"
        outcomes[json.loads(journal.read_text())["status"] if journal.exists()
                 else "no journal"] += 1
        engine_for(tree, state).rollback()
        assert listing(tree) == expected, f"killed before write {kill_before}: not restored"
        assert not journal.exists()
        return answer

    try:
        assert parent.stdout.readline().strip() == "ready"
        # uninterrupted first: how many writes an apply makes, and where the journal's are
        done, *counts = apply_and_roll_back(tmp_path / "state-whole", 10**9).split()
        assert done == "done", done
        writes, replaces = int(counts[0]), [int(r) for r in counts[1:]]
        assert writes > 2 * KILL_POINTS and len(replaces) >= 2, counts
        points = sorted({round(i * (writes - 1) / (KILL_POINTS - 1)) for i in
                         range(KILL_POINTS)} | {r + d for r in replaces for d in (0, 1)
                                                if r + d < writes})
        for point in points:
            answer = apply_and_roll_back(tmp_path / f"state{point}", point)
            assert answer == "killed", f"before write {point} of {writes}: {answer}"
    finally:
        parent.kill()
        parent.wait(timeout=30)
    assert snapshot(tree) == expected
    # the first kill lands before any write, the last before the journal says applied
    assert outcomes["no journal"] >= 1 and outcomes["applied"] == 1, outcomes
    assert outcomes["applying"] >= KILL_POINTS - 2, outcomes  # kills really landed mid-apply


INTERRUPTED = """
import os, signal, sys
from agent.kernel import fsroot
from agent.cli import main

signal.signal(signal.SIGINT, signal.default_int_handler)  # a background job ignores it
write_text, writes = fsroot.Root.write_text, []

def interrupted_after_two(self, path, value):
    write_text(self, path, value)
    writes.append(path)
    if len(writes) == 2:  # Ctrl-C lands in the middle of the apply
        os.kill(os.getpid(), signal.SIGINT)

fsroot.Root.write_text = interrupted_after_two
sys.exit(main(sys.argv[1:]))
"""


def test_ctrl_c_during_apply_leaves_a_journal_that_rollback_restores(tmp_path: Path) -> None:
    tree = copy_board("x86-edge-npu", tmp_path)
    expected = snapshot(tree)
    state = tmp_path / "state"
    where = ["--root", str(tree), "--state-dir", str(state)]
    child = subprocess.run([sys.executable, "-c", INTERRUPTED, "profile", "apply", "realtime",
                            "--force", *where], capture_output=True, text=True, timeout=60,
                           check=False)
    assert child.returncode == 130, child.stderr
    assert "Traceback" not in child.stderr
    assert "interrupted" in child.stderr and "edge-agent profile rollback" in child.stderr
    assert json.loads((state / FILE_NAME).read_text())["status"] == "applying"
    assert snapshot(tree) != expected  # two writes happened
    rollback = subprocess.run([sys.executable, "-m", "agent", "profile", "rollback", *where],
                              capture_output=True, text=True, timeout=60, check=False)
    assert rollback.returncode == 0, rollback.stderr
    assert snapshot(tree) == expected
    assert not (state / FILE_NAME).exists()
