"""The tuning engine on this machine's real / where that is safe: planning writes nothing,
and a real cgroup is created, used and removed under a writable cgroup2 mount."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from tuning_helpers import REPO_PROFILES, named_thread

from agent.discovery import discover
from agent.kernel.fsroot import Root
from agent.tuning.engine import Engine, TuningError
from agent.tuning.journal import Journal
from agent.tuning.profiles import ProfileStore


def cgroup2_mount() -> str | None:
    for line in Path("/proc/mounts").read_text().splitlines():
        fields = line.split()
        if fields[2] == "cgroup2" and os.access(fields[1], os.W_OK):
            return fields[1]
    return None


def cgroup_of(pid: int) -> str:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return line[3:]
    raise AssertionError(f"/proc/{pid}/cgroup has no cgroup v2 line")


@pytest.mark.parametrize("profile", ["balanced", "latency", "realtime", "powersave", "auto"])
def test_planning_on_the_real_root_writes_nothing(profile: str, tmp_path: Path) -> None:
    root = Root("/")
    engine = Engine(root, discover(root), Journal(tmp_path), ProfileStore(root,
                                                                          dirs=[REPO_PROFILES]))
    plan = engine.plan(profile, force=True)
    for change in plan.changes:  # every planned path is an allowlisted knob that exists
        assert Path(change.path).exists()
        if change.compare != "sched":  # a thread's scheduling is a syscall, not a file
            root.check_writable(change.path)
    assert list(tmp_path.iterdir()) == []


@pytest.fixture()
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    child = subprocess.Popen(["sleep", "60"])
    yield child
    child.kill()
    child.wait()


def test_real_cgroup_created_used_and_removed(sleeper: subprocess.Popen[bytes]) -> None:
    mount = cgroup2_mount()
    if mount is None or os.geteuid() != 0:
        pytest.skip("no writable cgroup2 mount here (needs root and cgroup v2)")
    root = Root("/")
    directory = f"{mount}/edge-agent-test-{uuid.uuid4().hex[:8]}"
    original = cgroup_of(sleeper.pid)
    assert root.mkdir(directory)
    assert not root.mkdir(directory)  # already there: reported, not an error
    try:
        assert Path(directory, "cgroup.procs").exists()  # the kernel filled it in
        root.write_text(f"{directory}/cgroup.procs", str(sleeper.pid))  # one pid a write
        assert cgroup_of(sleeper.pid) == "/" + directory.removeprefix(mount).lstrip("/")
        assert Path(directory, "cgroup.procs").read_text().split() == [str(sleeper.pid)]
    finally:
        back = f"{mount}{original}".rstrip("/") or mount
        root.write_text(f"{back}/cgroup.procs", str(sleeper.pid))
        root.rmdir(directory)
    assert cgroup_of(sleeper.pid) == original
    assert not Path(directory).exists()


def test_profile_sets_and_restores_a_real_threads_scheduling(tmp_path: Path) -> None:
    """rt.threads on the real root: only a thread this test starts and names is touched."""
    from agent.kernel import sched as rt

    name = f"eatest-{uuid.uuid4().hex[:6]}"
    last = max(os.sched_getaffinity(0))
    if last == 0:
        pytest.skip("a FIFO thread needs a CPU beside the housekeeping CPU 0")
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    (profiles / "threads.yaml").write_text(  # CPU 0 is housekeeping: never a FIFO thread's
        f"rt: {{threads: [{{comm: '{name}', policy: fifo, priority: 10, cpus: 'cpus:{last}'}}]}}"
        "\n")
    root = Root("/")
    with named_thread(name) as tid:
        engine = Engine(root, discover(root), Journal(tmp_path / "state"),
                        ProfileStore(root, dirs=[profiles]))
        original = rt.read_thread_sched(tid)
        try:
            result = engine.apply("threads")
        except TuningError as error:  # only to skip where RT is not allowed here
            if "CAP_SYS_NICE" in str(error):
                pytest.skip(f"SCHED_FIFO not allowed here: {error}")
            raise
        assert [c.path for c in result.written] == [f"/proc/{os.getpid()}/task/{tid}"]
        assert rt.read_thread_sched(tid) == rt.ThreadSched("fifo", 10, [last])
        assert engine.verify() == []
        engine.rollback()
        assert rt.read_thread_sched(tid) == original
