"""Ctrl-C and SIGTERM on real ``edge-agent`` processes: a clean stop, never a traceback, never
an abort inside ONNX Runtime (a process that exits with a thread still in ``session.run``
dies with "terminate called without an active exception", exit 134)."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from agent_process import agent_config, sigint_at_default
from mqtt_helpers import free_port, wait_until
from tuning_helpers import copy_board

WORKTREE = Path(__file__).resolve().parent.parent


def spawn(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """``python -m agent ARGS`` from this checkout, with SIGINT at its default even when
    the tests run as a background job (which ignores it, and children inherit that)."""
    return subprocess.Popen(sigint_at_default(sys.executable, "-m", "agent", *args),
                            cwd=WORKTREE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONFAULTHANDLER": "1", **(env or {})})


def stopped(process: subprocess.Popen[bytes], signum: int) -> tuple[int, str, str]:
    """The exit status and output of ``process`` after ``signum``; one that does not stop
    within a minute is aborted, so the failure shows every thread's stack (faulthandler)."""
    process.send_signal(signum)
    try:
        out, err = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGABRT)
        out, err = process.communicate(timeout=30)
        pytest.fail(f"no stop 60 s after {signal.Signals(signum).name}:\n{err.decode()}")
    finally:
        process.kill()
    return process.returncode, out.decode(), err.decode()


def assert_clean(stderr: str) -> None:
    assert "Traceback" not in stderr, stderr
    assert "terminate called" not in stderr, stderr


def running_infer(tmp_path: Path) -> subprocess.Popen[bytes]:
    """``infer`` for 30 s, returned once its first progress line shows calls completing."""
    process = spawn("infer", "--seconds", "30", "--progress", "--json",
                    "--state-dir", str(tmp_path / "state"))
    assert process.stderr is not None
    first = process.stderr.read(1)  # the progress line starts with "\r" once the loop runs
    assert first == b"\r", first + process.stderr.read()
    return process


def test_sigint_stops_infer_cleanly_with_the_statistics_so_far(tmp_path: Path) -> None:
    code, out, err = stopped(running_infer(tmp_path), signal.SIGINT)
    assert_clean(err)
    assert code == 130, err
    result = json.loads(out)
    assert result["stopped_by"] == "SIGINT"
    assert result["count"] > 0 and result["errors"] == 0
    assert result["warnings"] == []


def test_sigterm_stops_infer_cleanly_and_exits_0(tmp_path: Path) -> None:
    code, out, err = stopped(running_infer(tmp_path), signal.SIGTERM)
    assert_clean(err)
    assert code == 0, err
    assert json.loads(out)["stopped_by"] == "SIGTERM"


def test_sigint_summary_says_the_run_was_stopped_early(tmp_path: Path) -> None:
    process = spawn("infer", "--seconds", "30", "--progress",
                    "--state-dir", str(tmp_path / "state"))
    assert process.stderr is not None and process.stderr.read(1) == b"\r"
    code, out, err = stopped(process, signal.SIGINT)
    assert_clean(err)
    assert code == 130
    assert out.splitlines()[-1] == "stopped early by SIGINT"


def running_selftest(tmp_path: Path) -> tuple[subprocess.Popen[bytes], Path]:
    """``selftest`` for 30 s against a broker that is not there, returned once its probe
    agent has built the model session (its optimised graph is in the probe's cache)."""
    config = tmp_path / "agent.yaml"
    config.write_text(yaml.safe_dump(agent_config(tmp_path, free_port())))  # no broker there
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    process = spawn("selftest", "--config", str(config), "--seconds", "30",
                    env={"TMPDIR": str(scratch)})
    assert wait_until(lambda: any(scratch.glob("edge-agent-selftest-*/model-cache/*.onnx"))
                      or process.poll() is not None, 60)
    assert process.poll() is None, process.communicate()
    return process, scratch


@pytest.mark.parametrize(("signum", "expected"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_stops_selftest_cleanly_with_no_verdict(tmp_path: Path, signum: int,
                                                         expected: int) -> None:
    process, scratch = running_selftest(tmp_path)
    code, out, err = stopped(process, signum)
    assert_clean(err)
    assert code == expected, err
    assert f"stopped by {signal.Signals(signum).name}" in err and "no verdict" in err
    assert out == ""  # no checks printed: none of them finished
    # The probe stopped and its state directory went (ORT keeps a .ses file of its own).
    assert list(scratch.glob("edge-agent-selftest-*")) == []


def test_ctrl_c_in_any_command_prints_no_traceback(tmp_path: Path) -> None:
    """``discover`` blocked on a file that never ends (a FIFO standing in for a hung sysfs
    read): Ctrl-C lands in plain Python code, and main() turns it into exit 130."""
    root = copy_board("bare-vm", tmp_path)
    cpuinfo = root / "proc" / "cpuinfo"
    cpuinfo.unlink()
    os.mkfifo(cpuinfo)
    process = spawn("discover", "--root", str(root), "--json")

    writer: list[int] = []

    def reader_waiting() -> bool:
        try:  # opening the write end succeeds only once a reader has the FIFO open
            writer.append(os.open(cpuinfo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError as error:
            assert error.errno == errno.ENXIO
            return process.poll() is not None
        return True

    assert wait_until(reader_waiting, 60)
    assert writer, process.communicate()
    # A signal that lands after open() but before read() is only noted by Python and the
    # read then blocks for good (the handler runs between bytecodes): wait for the read.
    wchan = Path(f"/proc/{process.pid}/wchan")
    assert wait_until(lambda: "pipe_read" in wchan.read_text(), 60), wchan.read_text()
    try:
        code, out, err = stopped(process, signal.SIGINT)
    finally:
        os.close(writer[0])
    assert_clean(err)
    assert code == 130
    assert (out, err) == ("", "\n")
