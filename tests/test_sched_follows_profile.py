"""Thread scheduling follows the profile: after a switch, a rollback and rollback_on_stop the
inference threads get the new plan's policy and CPUs, or the baseline (SCHED_OTHER, nice 0,
every CPU) when it has none.  Real threads of this process (tests run as root), never one
this test did not start.

sched(7): a thread created by clone() inherits its creator's policy, priority, nice value and
CPU affinity, so a thread born of a SCHED_FIFO thread is FIFO too: what it "had" when it was
adopted is no baseline to restore.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from tuning_helpers import copy_board

from agent.config.loader import from_dict
from agent.discovery import discover
from agent.kernel import sched as rt
from agent.kernel.fsroot import Root
from agent.service.dataplane import Supervisor
from agent.service.parts import Ending
from agent.service.tuning import Tuning
from agent.serving.threads import InferenceThreads, read_sched_file, write_sched_file

CPUS = sorted(os.sched_getaffinity(0))
needs_two = pytest.mark.skipif(len(CPUS) < 2 or os.geteuid() != 0,
                               reason="needs root and two CPUs to move between")


class Sleeper:
    """A real thread that waits; ``tid`` is its kernel id.  ``spawn`` runs in it."""

    def __init__(self, spawn: Callable[[], None] | None = None) -> None:
        self.ready, self.done = threading.Event(), threading.Event()
        self.tid = 0
        self.spawn = spawn
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.ready.wait(10)

    def _run(self) -> None:
        self.tid = threading.get_native_id()
        if self.spawn is not None:
            self.spawn()
        self.ready.set()
        self.done.wait(60)

    def stop(self) -> None:
        self.done.set()
        self.thread.join(10)


def state(tid: int) -> tuple[str, int, list[int], int]:
    sched = rt.read_thread_sched(tid)
    return sched.policy, sched.priority, sched.cpus, os.getpriority(os.PRIO_PROCESS, tid)


@pytest.fixture()
def born_of_fifo() -> Iterator[tuple[Sleeper, Sleeper]]:
    """A SCHED_FIFO thread on the first CPU at nice 3, and the thread it started."""
    children: list[Sleeper] = []

    def become_fifo_and_spawn() -> None:
        me = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, me, 3)
        rt.apply_thread_sched(me, rt.ThreadSched("fifo", 1, CPUS[:1]))
        children.append(Sleeper())

    parent = Sleeper(become_fifo_and_spawn)
    try:
        yield parent, children[0]
    finally:
        children[0].stop()
        parent.stop()


@needs_two
def test_a_thread_born_of_a_fifo_thread_goes_back_to_the_baseline(
        born_of_fifo: tuple[Sleeper, Sleeper]) -> None:
    _parent, child = born_of_fifo
    assert state(child.tid) == ("fifo", 1, CPUS[:1], 3)  # inherited, as sched(7) says
    threads = InferenceThreads(rt.ThreadSched("fifo", 2, CPUS[-1:]))
    threads.adopt([child.tid])
    assert state(child.tid)[:3] == ("fifo", 2, CPUS[-1:])
    threads.switch(rt.ThreadSched("other", 0, CPUS[:1]))
    assert state(child.tid)[:3] == ("other", 0, CPUS[:1])
    threads.switch(None)  # a rollback: not FIFO 1 on one CPU, what it was adopted with
    assert state(child.tid) == ("other", 0, CPUS, 0)
    assert threads.errors == []


@needs_two
def test_switch_rollback_and_rollback_on_stop_reach_the_inference_threads(
        tmp_path: Path) -> None:
    """The service's chain: Tuning -> the supervisor's sched file -> the data plane's
    InferenceThreads (in this process), with real threads."""
    tree = copy_board("jetson-xavier-nx-jp5-rt", tmp_path)
    root = Root(tree)
    tuning = Tuning(root, discover(root), tmp_path / "state", "realtime", True,
                    lambda kind, **fields: None)
    tuning.start()
    assert tuning.applied and tuning.error is None
    sched_file = tmp_path / "sched.json"
    threads = InferenceThreads(tuning.inference_sched())  # what the data plane starts with

    def resched(wanted: rt.ThreadSched | None) -> None:  # file, then SIGHUP's handler
        write_sched_file(sched_file, wanted)
        threads.switch(read_sched_file(sched_file))

    tuning.on_sched = resched
    worker = Sleeper()
    try:
        threads.adopt([worker.tid])
        online = set(CPUS)
        # realtime on the Xavier: FIFO 80 on 1-5, CPU 0 kept for housekeeping
        assert state(worker.tid)[:2] == ("fifo", 80)
        assert set(state(worker.tid)[2]) == online & {1, 2, 3, 4, 5}
        tuning.switch("balanced")  # no rt section: back to the baseline
        assert state(worker.tid) == ("other", 0, CPUS, 0)
        tuning.switch("jetson-orin", force=True)  # SCHED_OTHER on every CPU of the board
        assert state(worker.tid)[:2] == ("other", 0)
        tuning.switch("latency")
        assert state(worker.tid)[:2] == ("fifo", 80)
        assert tuning.rollback() == "latency"
        assert state(worker.tid) == ("other", 0, CPUS, 0)
        tuning.switch("realtime")
        assert state(worker.tid)[:2] == ("fifo", 80)
        tuning.stop(Ending(flush_s=0.0, rollback=True))  # rollback_on_stop
        assert state(worker.tid) == ("other", 0, CPUS, 0)
        assert not tuning.applied and threads.errors == []
    finally:
        rt.reset_thread_sched(worker.tid, CPUS)
        worker.stop()


FAKE_SERVER = textwrap.dedent("""\
    import json, os, signal, sys, time
    directory, log = sys.argv[1], sys.argv[2]
    time.sleep(1.5)  # starting up: SIGHUP's default action would end it here
    def heard(number, frame):
        with open(log, "a") as handle:
            handle.write(open(os.path.join(directory, "sched.json")).read() + "\\n")
    signal.signal(signal.SIGHUP, heard)
    with open(os.path.join(directory, "ready.json"), "w") as handle:
        json.dump({"pid": os.getpid(), "http": "127.0.0.1:9", "grpc": "127.0.0.1:9"}, handle)
    while True:
        time.sleep(0.1)
""")


class FakeServerSupervisor(Supervisor):
    """The real supervisor around a stand-in for ``edge-agent serve`` that takes 1.5 s to
    install its SIGHUP handler, then writes its ready file."""

    def _command(self) -> list[str]:
        return [sys.executable, "-c", FAKE_SERVER, str(self.directory),
                str(self.state_dir / "heard.log")]


def test_a_new_schedule_reaches_a_server_that_is_still_starting(tmp_path: Path) -> None:
    supervisor = FakeServerSupervisor(from_dict({}), tmp_path, lambda kind, **fields: None,
                                      rt.ThreadSched("fifo", 80, [1]), wait_ready_s=30)
    # wait_ready() waits for a ready server, which this stand-in never is: it runs beside
    # the test
    supervisor.launch()
    threading.Thread(target=supervisor.wait_ready, daemon=True).start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and supervisor.process is None:
        time.sleep(0.05)
    try:
        supervisor.resched(None)  # a rollback while the server starts: no signal yet
        assert json.loads((supervisor.directory / "sched.json").read_text()) is None
        deadline = time.monotonic() + 20
        log = tmp_path / "heard.log"
        # the file exists before its line is written
        while time.monotonic() < deadline and not (log.exists() and log.read_text()[-1:] == "\n"):
            time.sleep(0.1)
        assert supervisor.process is not None and supervisor.process.poll() is None
        assert log.read_text() == "null\n"  # signalled once it was ready, and it read null
        supervisor.resched(rt.ThreadSched("other", 0, [0]))  # ready now: signalled at once
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and log.read_text().count("\n") < 2:
            time.sleep(0.05)
        assert json.loads(log.read_text().splitlines()[1]) == {"policy": "other",
                                                               "priority": 0, "cpus": [0]}
        assert supervisor.restarts == 0
    finally:
        supervisor.stop()
