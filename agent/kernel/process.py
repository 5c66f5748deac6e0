"""prctl(2) for the few process and thread settings the agent makes: a thread's kernel name,
and a child process that ends with its parent.  One home for the libc call."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
NAME_BYTES = 15  # the kernel keeps 16 with the terminating NUL


def _prctl(option: int, value: int | bytes) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    return int(libc.prctl(option, value, 0, 0, 0))


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
