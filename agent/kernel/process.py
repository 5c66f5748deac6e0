"""The few process and thread settings the agent makes through libc: prctl(2) for a thread's
kernel name and a child process that ends with its parent, and glibc's allocator policy for
a process that moves large buffers (the data plane).  One home for the libc calls, and for
the data plane's other process-wide memory setting: its startup heap out of the cyclic
collector's reach."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import os
import signal
import subprocess
from typing import Any

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
NAME_BYTES = 15  # the kernel keeps 16 with the terminating NUL
M_TRIM_THRESHOLD = -1  # mallopt(3) parameters, from glibc's malloc.h
M_MMAP_THRESHOLD = -3


@functools.cache
def _libc() -> ctypes.CDLL:
    """The C library the process runs on, loaded once."""
    return ctypes.CDLL(None, use_errno=True)


def _prctl(option: int, value: int | bytes) -> int:
    return int(_libc().prctl(option, value, 0, 0, 0))


def name_current_thread(name: str) -> None:
    """The calling thread's comm (``top -H``, ``/proc/<pid>/task/<tid>/comm``); a failure
    leaves the old name."""
    with contextlib.suppress(OSError, AttributeError):  # no prctl: the name is a convenience
        _prctl(PR_SET_NAME, name.encode()[:NAME_BYTES])


def die_with_parent(parent_pid: int) -> None:
    """SIGTERM when the parent dies; exits at once if it died before the request took
    effect (the child was reparented already)."""
    _prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))
    if os.getppid() != parent_pid:
        raise SystemExit(0)


def keep_freed_buffers(largest_bytes: int) -> bool:
    """Serve allocations up to ``largest_bytes`` from the heap and keep what is freed there
    (until ``release_freed_memory``), instead of glibc's default of mapping each large
    buffer fresh and trimming the heap on free: a tensor of a request (hundreds of KB) then
    costs page faults on every copy (1.7 ms to build one 600 KB gRPC message on a 2-core
    x86 box, 0.08 ms with this).  Whether the C library took it (False: not glibc)."""
    try:
        mallopt = _libc().mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, largest_bytes)
                and mallopt(M_TRIM_THRESHOLD, 2 * largest_bytes))


def release_freed_memory() -> None:
    """Give freed heap memory of every arena back to the kernel (malloc_trim(3)): after a
    burst, so a process that keeps freed buffers does not keep a burst's RSS."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing is kept
        _libc().malloc_trim(0)


def freeze_long_lived() -> None:
    """Collect once, then move every object alive now out of the cyclic collector's
    generations (gc.freeze).  A full collection otherwise walks every imported module's
    objects while it holds the GIL: 26-46 ms in the data plane here, each one a missed
    1-s window for a latency-critical model (bench/qos.py).  Called once, when startup is
    over: what lives then lives as long as the process (reference counting still frees
    it), and a later freeze would keep a later load's cyclic garbage for good."""
    gc.collect()
    gc.freeze()


def stop_child(process: subprocess.Popen[Any], grace_s: float) -> None:
    """SIGTERM ``process`` (a child this agent started), SIGKILL it if it has not ended
    within ``grace_s``, and reap it either way; nothing for one that already ended."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
