"""SIGINT and SIGTERM for commands that run for a while: a flag to wait on, not an exception.

A KeyboardInterrupt raised in the main thread skips the command's stop path, and a process
that exits while a thread is still inside ONNX Runtime aborts ("terminate called without an
active exception", exit 134).  Here the signal only sets an event: the command waits on it,
stops and joins its threads as it does at the end of a normal run, and then exits.

A command whose stop path is its ``with`` blocks, and that runs no ONNX Runtime in its own
process (``model tune``: the device's knobs, a scratch data plane and directory), has SIGTERM
and SIGHUP raise instead (``Terminated``), as Ctrl-C does: without it the default action
ended the process where it stood and left all three behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType, TracebackType
from typing import Any

SIGINT_EXIT = 130  # 128 + SIGINT, what a shell reports for Ctrl-C


class StopSignals:
    """``with StopSignals() as stop:`` SIGINT/SIGTERM set ``stop.event``; the previous
    handlers come back on exit.  A signal ignored when the command started (nohup, a
    background job) stays ignored; outside the main thread nothing is installed."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():
            return self
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous = signal.getsignal(signum)
            if previous is not signal.SIG_IGN:
                self._previous[signum] = previous
                signal.signal(signum, self._handle)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:  # a second Ctrl-C while stopping changes nothing
            self.received = signal.Signals(signum)
        self.event.set()

    @property
    def name(self) -> str | None:
        """``SIGINT`` or ``SIGTERM`` once one arrived."""
        return None if self.received is None else self.received.name


def exit_code(code: int, *, threads_stuck: bool) -> int:
    """``code``; but with a thread still inside ONNX Runtime (a stuck call that could not be
    joined), leave at once: the interpreter's normal exit would abort in ORT's destructors."""
    if threads_stuck:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP raised in the main thread; ``status`` the shell's 128 + signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.status = 128 + signum


@contextlib.contextmanager
def raising_on_termination() -> Iterator[None]:
    """Within it SIGTERM and SIGHUP raise Terminated in the main thread (one ignored when
    the command started, as under nohup, stays ignored); the previous handlers after it."""
    previous: dict[signal.Signals, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGHUP):
            handler = signal.getsignal(signum)
            if handler is not signal.SIG_IGN:
                previous[signum] = handler
                signal.signal(signum, _raise)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _raise(signum: int, frame: FrameType | None) -> None:
    raise Terminated(signum)
