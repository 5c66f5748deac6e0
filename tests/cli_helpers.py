"""``edge-agent ARGS`` run in this process, for the tests that are about a command's output
and exit status rather than about its process (signals, import costs, the installed entry
point keep their subprocesses).

A fresh interpreter per call cost some 0.3 s of imports each, and these tests make hundreds
of calls.  The call is what ``python -m agent`` does (agent/__main__.py: ``SystemExit(main())``)
with what a fresh process would give it: its own stdout and stderr, the working directory
asked for, and logging as an unconfigured interpreter has it (no handlers: a warning reaches
stderr through logging's last resort, as it would there, instead of pytest's capture).  An
exception that escapes is printed as the interpreter would and gives status 1.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import subprocess
import traceback
from collections.abc import Iterator

from agent import cli


@contextlib.contextmanager
def _fresh_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    root.handlers, root.level = [], logging.WARNING
    try:
        yield
    finally:
        root.handlers, root.level = handlers, level


@contextlib.contextmanager
def _working_directory(cwd: str | os.PathLike[str] | None) -> Iterator[None]:
    if cwd is None:
        yield
        return
    before = os.getcwd()
    os.chdir(cwd)
    try:
        yield
    finally:
        os.chdir(before)


def edge_agent(*args: str | os.PathLike[str],
               cwd: str | os.PathLike[str] | None = None) -> subprocess.CompletedProcess[str]:
    """``edge-agent ARGS`` as ``subprocess.run(..., capture_output=True, text=True)`` reports
    it: its exit status, stdout and stderr."""
    argv = [os.fspath(arg) for arg in args]
    out, err = io.StringIO(), io.StringIO()
    with _working_directory(cwd), _fresh_logging(), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as stop:  # argparse's usage errors, --help, --version
            if stop.code is None or isinstance(stop.code, int):
                code = stop.code or 0
            else:
                print(stop.code, file=err)
                code = 1
        except Exception:  # what the interpreter prints for an uncaught exception
            traceback.print_exc(file=err)
            code = 1
    return subprocess.CompletedProcess(["edge-agent", *argv], code, out.getvalue(),
                                       err.getvalue())

