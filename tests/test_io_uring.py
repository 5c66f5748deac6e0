"""io_uring: the kernel.io_uring_disabled/io_uring_group sysctls on the fixture boards, its
state in discovery, and its kernel-side threads under rt.threads -- with a real SQPOLL ring
this test creates (only its own iou-sqp thread is touched; the ring is closed after)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from mqtt_helpers import wait_until
from tuning_helpers import copy_board, engine_for, named_thread, snapshot, write_profile

from agent.discovery import discover
from agent.discovery.kernel import IO_URING_SETUP, probe_io_uring_errno
from agent.kernel import sched as rt
from agent.kernel.fsroot import Root
from agent.tuning.engine import Engine
from agent.tuning.errors import ProfileError
from agent.tuning.journal import Journal
from agent.tuning.profiles import ProfileStore

SYSCTL = "proc/sys/kernel/io_uring_{}"
IORING_SETUP_SQPOLL = 1 << 1


def _engine(tmp_path: Path, board: str, profile: str) -> tuple[Path, Engine]:
    tree = copy_board(board, tmp_path)
    profiles = tmp_path / "profiles"
    write_profile(profiles, "uring", profile)
    return tree, engine_for(tree, tmp_path / "state", [profiles])


# -- the sysctls on the fixture boards ---------------------------------------------------


def test_disabled_and_group_round_trip_byte_exact(tmp_path: Path) -> None:
    tree, engine = _engine(tmp_path, "x86-server-nvidia",
                           "io_uring: {disabled: 1, group: 1001}\n")
    before = snapshot(tree)
    plan = engine.plan("uring")
    assert [(c.tuner, c.path, c.current, c.desired) for c in plan.changes] == [
        ("io_uring", "/proc/sys/kernel/io_uring_disabled", "0", "1"),
        ("io_uring", "/proc/sys/kernel/io_uring_group", "-1", "1001")]
    engine.apply("uring")
    assert (tree / SYSCTL.format("disabled")).read_text() == "1\n"
    assert (tree / SYSCTL.format("group")).read_text() == "1001\n"
    assert engine.verify() == []
    engine.rollback()
    assert snapshot(tree) == before


@pytest.mark.parametrize("board", ["jetson-agx-orin-jp6", "jetson-xavier-nx-jp5-rt",
                                   "rk3588-vendor"])
def test_kernels_before_6_6_lack_the_switch_not_io_uring(board: str, tmp_path: Path) -> None:
    _tree, engine = _engine(tmp_path, board, "io_uring: {disabled: 2}\n")
    with pytest.raises(ProfileError) as caught:
        engine.plan("uring")
    assert caught.value.key == "io_uring.disabled"
    assert "6.6" in caught.value.message and "still have io_uring" in caught.value.message
    profiles = tmp_path / "profiles"
    write_profile(profiles, "soft", "include: [uring]\noptional: [io_uring]\n")
    plan = engine.plan("soft")
    assert plan.changes == [] and any("io_uring.disabled: skipped" in w for w in plan.warnings)


def test_group_without_restricted_mode_warns(tmp_path: Path) -> None:
    _tree, engine = _engine(tmp_path, "rk3588-mainline", "io_uring: {group: 1001}\n")
    plan = engine.plan("uring")
    assert any("only with io_uring_disabled = 1" in w for w in plan.warnings)
    write_profile(tmp_path / "profiles", "admin", "io_uring: {disabled: 1}\n")
    assert any("CAP_SYS_ADMIN processes only" in w for w in engine.plan("admin").warnings)


@pytest.mark.parametrize("value", [3, -1, "yes"])
def test_schema_names_the_allowed_values(value: object, tmp_path: Path) -> None:
    _tree, engine = _engine(tmp_path, "rk3588-mainline", f"io_uring: {{disabled: {value}}}\n")
    with pytest.raises(ProfileError) as caught:
        engine.plan("uring")
    assert caught.value.key == "io_uring.disabled"


def test_fixture_root_refuses_what_proc_dointvec_minmax_refuses(tmp_path: Path) -> None:
    tree = copy_board("bare-vm", tmp_path)
    with pytest.raises(OSError) as caught:
        Root(tree).write_text("/proc/sys/kernel/io_uring_disabled", "3")
    assert caught.value.errno == errno.EINVAL


# -- discovery ---------------------------------------------------------------------------


@pytest.mark.parametrize(("board", "expected"), [
    ("x86-server-nvidia", (True, 0, -1, "enabled")),
    ("x86-edge-npu", (True, 1, -1, "restricted")),     # CAP_SYS_ADMIN or the group
    ("jetson-agx-orin-jp6", (None, None, None, None)),  # 5.15: no sysctl, no probe
])
def test_discovery_reports_the_state(board: str, expected: tuple[object, ...]) -> None:
    from tuning_helpers import FIXTURES

    kernel = discover(Root(FIXTURES / board)).kernel
    assert (kernel.io_uring, kernel.io_uring_disabled, kernel.io_uring_group,
            kernel.io_uring_status) == expected


def test_discovery_on_the_host_probes_the_syscall() -> None:
    kernel = discover(Root("/")).kernel
    code = probe_io_uring_errno()
    if kernel.io_uring_disabled is None:
        assert kernel.io_uring_status == {0: "enabled", errno.ENOSYS: "not built"}.get(
            code, "blocked")
    assert kernel.io_uring is (kernel.io_uring_status != "disabled" if
                               kernel.io_uring_disabled is not None else code == 0)


# -- io_uring's kernel-side threads ------------------------------------------------------


def open_sqpoll_ring(idle_ms: int) -> int:
    """A real ring with a submission-queue polling thread (its fd).  The thread busy-polls
    for ``idle_ms`` after its last work, then sleeps until the ring closes."""
    libc = ctypes.CDLL(None, use_errno=True)
    params = (ctypes.c_uint32 * 30)()  # struct io_uring_params: 120 bytes
    params[2] = IORING_SETUP_SQPOLL  # flags
    params[4] = idle_ms  # sq_thread_idle
    fd = libc.syscall(IO_URING_SETUP, 4, ctypes.byref(params))
    if fd < 0:
        code = ctypes.get_errno()
        pytest.skip(f"io_uring_setup with SQPOLL is not permitted here: "
                    f"{errno.errorcode.get(code, code)} ({os.strerror(code)})")
    return int(fd)


def sqpoll_thread(creator: int) -> int:
    """The TID of the SQPOLL thread of the ring this process's thread ``creator`` (a TID)
    made.  The kernel starts it under the creator's name and it names itself
    iou-sqp-<creator> when it first runs, which on a busy machine can be after
    io_uring_setup has returned: wait for the name."""
    name, tids = f"iou-sqp-{creator}", []

    def named() -> bool:
        tids[:] = [t for _p, t, _c in rt.threads_matching(Root("/"), name, pid=os.getpid())]
        return bool(tids)

    assert wait_until(named, 30), f"no {name} thread in /proc/self/task"
    assert len(tids) == 1, f"{len(tids)} {name} threads"
    return tids[0]


@pytest.fixture
def sqpoll_ring() -> Iterator[tuple[int, int]]:
    """A real SQPOLL ring of this process: (ring fd, iou-sqp tid)."""
    fd = open_sqpoll_ring(idle_ms=60_000)  # its thread stays up while the test runs
    try:
        yield fd, sqpoll_thread(threading.get_native_id())
    finally:
        os.close(fd)


def test_an_sqpoll_thread_that_has_not_run_yet_is_waited_for() -> None:
    """The fixture's flake under load (issue 32), made certain: the ring is created from a
    thread that is SCHED_FIFO on one CPU, so its SQPOLL thread (which inherits both) cannot
    run, and name itself, until that thread sleeps."""
    cpu, found, errors = max(os.sched_getaffinity(0)), [], []

    def create() -> None:
        try:
            os.sched_setaffinity(0, {cpu})  # 0: this thread
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
        except PermissionError as error:
            errors.append(f"SCHED_FIFO is not permitted here: {error}")
            return
        fd = open_sqpoll_ring(idle_ms=1)  # it sleeps again at once: this thread runs on
        try:
            found.append(sqpoll_thread(threading.get_native_id()))
        except AssertionError as error:
            errors.append(str(error))
        finally:
            os.close(fd)

    creator = threading.Thread(target=create)
    creator.start()
    creator.join(60)
    assert not creator.is_alive()
    if errors and errors[0].startswith("SCHED_FIFO"):
        pytest.skip(errors[0])
    assert errors == [] and len(found) == 1


IORING_OP_OPENAT, IOSQE_ASYNC, AT_FDCWD = 18, 1 << 4, -100
IORING_OFF_SQES = 0x10000000
IO_URING_ENTER = IO_URING_SETUP + 1  # 426 on x86_64 and arm64


@pytest.fixture
def io_wq_worker(tmp_path: Path) -> Iterator[int]:
    """A real io-wq worker (iou-wrk-<pid>) of this process: an openat of a FIFO with no
    writer, forced to io-wq (IOSQE_ASYNC), blocks in it.  Yields its TID; afterwards a writer
    lets the open finish, its fd and the ring are closed."""
    libc = ctypes.CDLL(None, use_errno=True)
    params = (ctypes.c_uint32 * 30)()
    fd = libc.syscall(IO_URING_SETUP, 4, ctypes.byref(params))
    if fd < 0:
        code = ctypes.get_errno()
        pytest.skip(f"io_uring_setup is not permitted here: {errno.errorcode.get(code, code)}")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    name = ctypes.create_string_buffer(str(fifo).encode())
    sq_entries, tail, array = params[0], params[11], params[16]  # io_sqring_offsets
    ring = mmap.mmap(fd, array + 4 * sq_entries, offset=0)
    sqes = mmap.mmap(fd, 64 * sq_entries, offset=IORING_OFF_SQES)
    try:  # struct io_uring_sqe: opcode, flags, ioprio, fd, off, addr, len, open_flags, data
        sqes[0:64] = struct.pack("=BBHiQQIIQ24x", IORING_OP_OPENAT, IOSQE_ASYNC, 0, AT_FDCWD,
                                 0, ctypes.addressof(name), 0, os.O_RDONLY, 1)
        struct.pack_into("=I", ring, array, 0)
        struct.pack_into("=I", ring, tail, struct.unpack_from("=I", ring, tail)[0] + 1)
        assert libc.syscall(IO_URING_ENTER, fd, 1, 0, 0, None, 0) == 1
        comm, tids = f"iou-wrk-{os.getpid()}", []
        for _ in range(100):
            tids = [t for _p, t, _c in rt.threads_matching(Root("/"), comm, pid=os.getpid())]
            if tids:
                break
            time.sleep(0.02)
        assert tids, f"no {comm} thread in /proc/self/task"
        yield tids[0]
    finally:
        os.close(os.open(fifo, os.O_WRONLY))  # the worker's open completes
        time.sleep(0.1)
        for entry in Path("/proc/self/fd").iterdir():  # the fd that open gave us
            with contextlib.suppress(OSError):
                if os.readlink(entry) == str(fifo):
                    os.close(int(entry.name))
        sqes.close()
        ring.close()
        os.close(fd)


def test_a_real_io_wq_worker_is_pinned_or_reported(io_wq_worker: int, tmp_path: Path) -> None:
    """On 6.3+ an io-wq worker takes an affinity (held while it lives); before, it is
    PF_NO_SETAFFINITY and the apply reports the refusal instead of failing."""
    warnings = _pin_and_restore(tmp_path, io_wq_worker, "iou-wrk",
                                "io-wq worker; use IORING_REGISTER_IOWQ_AFF")
    assert any("IORING_REGISTER_IOWQ_AFF" in w for w in warnings)


def _thread_profile(tmp_path: Path, comm: str, cpu: int) -> Engine:
    profiles = tmp_path / "profiles"
    write_profile(profiles, "threads", f"rt: {{threads: [{{comm: '{comm}', pid: {os.getpid()},"
                                       f" policy: other, cpus: 'cpus:{cpu}'}}]}}\n")
    root = Root("/")
    return Engine(root, discover(root), Journal(tmp_path / "state"),
                  ProfileStore(root, dirs=[profiles]))


def test_sqpoll_thread_is_pinned_verified_and_restored(
        sqpoll_ring: tuple[int, int], tmp_path: Path) -> None:
    _pin_and_restore(tmp_path, sqpoll_ring[1], "iou-sqp",
                     "SQPOLL thread; use IORING_SETUP_SQ_AFF with sq_thread_cpu")


def _pin_and_restore(tmp_path: Path, tid: int, kind: str, refusal: str) -> list[str]:
    """Pin a real io_uring thread of this process to one CPU through rt.threads, verify,
    roll back; a kernel that refuses (PF_NO_SETAFFINITY before 6.3/6.4) is reported."""
    original = rt.read_thread_sched(tid)
    cpu = max(os.sched_getaffinity(0))
    if original.cpus == [cpu]:
        pytest.skip(f"the {kind} thread already runs on one CPU only: nothing to change")
    engine = _thread_profile(tmp_path, f"{kind}-{os.getpid()}", cpu)
    result = engine.apply("threads")
    path = f"/proc/{os.getpid()}/task/{tid}"
    if result.skipped:
        assert result.skipped == [f"{path}: kernel refuses affinity ({refusal})"]
    else:
        assert [c.path for c in result.written] == [path]
        assert sorted(os.sched_getaffinity(tid)) == [cpu]
    assert engine.verify() == []
    engine.rollback()
    assert rt.read_thread_sched(tid) == original
    return result.plan.warnings


def test_io_wq_worker_refusing_affinity_is_reported_not_fatal(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An io-wq worker is PF_NO_SETAFFINITY on older kernels: sched_setaffinity is EINVAL.
    A thread of this test named like one stands in (with another number, so a real worker
    still idling from an earlier test is not matched); the kernel's refusal is emulated."""
    name = "iou-wrk-4194304"  # above pid_max's limit: no real ring owner has it
    real = os.sched_setaffinity

    def no_setaffinity(pid: int, cpus: object) -> None:
        if pid == tid:
            raise OSError(errno.EINVAL, "Invalid argument")
        real(pid, cpus)  # type: ignore[arg-type]

    with named_thread(name) as tid:
        original = rt.read_thread_sched(tid)
        engine = _thread_profile(tmp_path, name, min(os.sched_getaffinity(0)))
        plan = engine.plan("threads")
        assert any("IORING_REGISTER_IOWQ_AFF" in w for w in plan.warnings)
        if not plan.changes:
            pytest.skip("the thread already runs on that CPU only")
        monkeypatch.setattr(os, "sched_setaffinity", no_setaffinity)
        result = engine.apply("threads")
        assert result.written == []
        assert result.skipped == [f"/proc/{os.getpid()}/task/{tid}: kernel refuses "
                                  "affinity (io-wq worker; use IORING_REGISTER_IOWQ_AFF)"]
        assert engine.verify() == []  # a skipped thread is not drift
        engine.rollback()
        assert rt.read_thread_sched(tid) == original


def test_other_threads_refusing_affinity_still_fail_the_apply(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only io_uring's threads are excused: EINVAL elsewhere is a real error."""
    from agent.tuning.engine import TuningError

    name = f"eatest-{os.getpid() % 10000}"

    def refuse(pid: int, cpus: object) -> None:
        raise OSError(errno.EINVAL, "Invalid argument")

    with named_thread(name):
        engine = _thread_profile(tmp_path, name, min(os.sched_getaffinity(0)))
        if not engine.plan("threads").changes:
            pytest.skip("the thread already runs on that CPU only")
        monkeypatch.setattr(os, "sched_setaffinity", refuse)
        with pytest.raises(TuningError, match="refused for thread"):
            engine.apply("threads")


def test_io_uring_thread_names() -> None:
    assert rt.io_uring_thread("iou-wrk-1234") == (
        "io-wq worker; use IORING_REGISTER_IOWQ_AFF")
    assert rt.io_uring_thread("iou-sqp-1234") is not None
    assert rt.io_uring_thread("kworker/0:1") is None
    assert rt.io_uring_thread(None) is None
