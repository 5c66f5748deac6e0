"""Crash safety: an apply killed with SIGKILL at random moments always rolls back exactly."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from tuning_helpers import REPO_PROFILES, copy_board, engine_for, snapshot

from agent.tuning.journal import FILE_NAME

ITERATIONS = 30
SEED = 20261130
# The child widens the window between writes a little so that kills land mid-apply on a
# fast machine too; every write still goes through the real engine and journal.
CHILD = """
import sys, time
from agent.discovery import discover
from agent.kernel.fsroot import Root
from agent.tuning.engine import Engine
from agent.tuning.journal import Journal
from agent.tuning.profiles import ProfileStore
from pathlib import Path

class SlowRoot(Root):
    def write_text(self, path, value):
        super().write_text(path, value)
        time.sleep(0.001)

root = SlowRoot(sys.argv[1])
engine = Engine(root, discover(root), Journal(sys.argv[2]), ProfileStore(root,
                dirs=[Path(sys.argv[3])]))
print("ready", flush=True)
engine.apply("realtime", force=True)
print("done", flush=True)
"""


def test_sigkill_during_apply_always_rolls_back_exactly(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    tree = copy_board("x86-edge-npu", tmp_path)  # reused: each rollback must restore it
    expected = snapshot(tree)
    outcomes = {"no journal": 0, "applying": 0, "applied": 0}
    for iteration in range(ITERATIONS):
        state = tmp_path / f"state{iteration}"
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(tree), str(state), str(REPO_PROFILES)],
            stdout=subprocess.PIPE, text=True)
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0, 0.12))
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        journal = state / FILE_NAME
        if not journal.exists():
            assert snapshot(tree) == expected, "a write happened without a journal"
        outcomes[json.loads(journal.read_text())["status"] if journal.exists()
                 else "no journal"] += 1
        engine_for(tree, state).rollback()
        assert snapshot(tree) == expected, f"iteration {iteration}: tree not restored"
        assert not (state / FILE_NAME).exists()
    assert outcomes["applying"] >= 3, outcomes  # kills really landed mid-apply


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
