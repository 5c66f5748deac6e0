"""``.rknn`` models for Rockchip NPUs, converted by rknn-toolkit2 in a venv of its own.

The toolkit pins numpy, onnx, protobuf and torch to versions the agent's venv cannot hold, so
it runs as a subprocess: the converter venv's python runs rknn_worker.py (beside this file)
with a fixed argv and no shell. This side writes the feeds as .npy files and the toolkit's
calibration list, speaks the worker's JSON-lines protocol (described in rknn_worker.py),
bounds it in time and size, and reads the simulator's outputs back.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import queue
import re
import signal
import subprocess
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from agent.modelbuild.request import BuildError, Feed, Progress

PLATFORMS = ("rk3588", "rk3576", "rk3566")
PRECISIONS = ("int8", "fp16")
CONFIG_KEY = "model_build.rknn_python"
ENV = "EDGE_AGENT_RKNN_PYTHON"
DEFAULT_PYTHON = Path("/opt/edge-agent/rknn-venv/bin/python")
SETUP = ("setup_rknn_converter.sh [VENV_DIR] (scripts/ in a checkout, "
         "<prefix>/share/edge-agent/ in a device install)")
WORKER = Path(__file__).with_name("rknn_worker.py")
MODEL_FILE = "model.rknn"
PROTOCOL = 1
TIMEOUT_S = 1800.0  # a real model calibrates for many minutes on a 2-core machine

STDOUT_LIMIT = 1 << 20  # the protocol's lines are short; more than this is not the worker
STDERR_TAIL = 4000  # characters of the toolkit's log kept for an error message
PROGRESS_LIMIT = 200  # characters of one progress line relayed
COLOUR = re.compile(r"\x1b\[[0-9;]*m")  # the toolkit colours its log even into a pipe


@dataclass(frozen=True)
class RknnConversion:
    model: Path  # the written .rknn
    # simulator outputs, one list per held-out feed, in output order
    outputs: list[list[np.ndarray]]
    toolkit_version: str


def converter_python(config_value: str | None) -> Path:
    """The converter venv's python: the config value, else $EDGE_AGENT_RKNN_PYTHON, else the
    default venv. A venv directory is taken for its bin/python."""
    env_value = os.environ.get(ENV)
    if config_value:
        where, path = CONFIG_KEY, Path(config_value)
    elif env_value:
        where, path = ENV, Path(env_value)
    else:
        where, path = f"the default converter (neither {CONFIG_KEY} nor {ENV} is set)", \
            DEFAULT_PYTHON
    path = path.expanduser()
    if path.is_dir():
        path = path / "bin" / "python"
    # Not resolved: a venv's python is a symlink to the system one, which is not the venv.
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise BuildError(f"{where}: {path} is not an executable python; set the rknn "
                         f"converter up with {SETUP} and point {CONFIG_KEY} (or {ENV}) at "
                         "VENV_DIR/bin/python")
    return path


def convert(source: Path, out_dir: Path, platform: str, precision: str,
            calibration: Sequence[Feed], heldout: Sequence[Feed], python: Path,
            timeout_s: float, progress: Progress) -> RknnConversion:
    """``out_dir/model.rknn`` converted from ``source`` for ``platform``, with the simulator's
    outputs for each held-out feed (to gate it against the original)."""
    if platform not in PLATFORMS:
        raise BuildError(f"--target rknn:{platform}: not a supported Rockchip platform "
                         f"(allowed: {', '.join('rknn:' + name for name in PLATFORMS)})")
    if precision not in PRECISIONS:
        raise BuildError(f"--precision {precision}: not offered for rknn "
                         f"(allowed: {', '.join(PRECISIONS)})")
    if precision == "int8" and not calibration:
        raise BuildError("--precision int8 for rknn needs calibration inputs (--calibration DIR)")
    if not source.is_file():
        raise BuildError(f"{source}: no such model file")
    inputs = _input_specs(itertools.chain(
        ((f"calibration input {index}", feed) for index, feed in enumerate(calibration)),
        ((f"held-out input {index}", feed) for index, feed in enumerate(heldout))))
    out_dir.mkdir(parents=True, exist_ok=True)
    model = out_dir / MODEL_FILE
    model.unlink(missing_ok=True)  # what the check after the run sees is this run's
    with tempfile.TemporaryDirectory(prefix=".rknn-", dir=out_dir) as scratch_name:
        scratch = Path(scratch_name)
        names = [name for name, _ in inputs]
        samples = _write_calibration(scratch, names, calibration)
        request = {"protocol": PROTOCOL, "source": str(source.resolve()), "model": str(model),
                   "platform": platform, "precision": precision,
                   "inputs": [{"name": name, "shape": shape} for name, shape in inputs],
                   "dataset": str(scratch / "dataset.txt") if samples else None,
                   "calibration_samples": samples,
                   "heldout": _write_heldout(scratch, names, heldout),
                   "outputs_dir": str(scratch / "outputs")}
        (scratch / "outputs").mkdir()
        result = _run_worker(python, request, scratch, timeout_s, progress)
        outputs = _read_outputs(result, len(heldout), scratch / "outputs")
        version = str(result.get("toolkit_version") or "unknown")
    if not model.is_file():
        raise BuildError(f"rknn converter reported success but wrote no {model}")
    return RknnConversion(model=model, outputs=outputs, toolkit_version=version)


def _input_specs(feeds: Iterable[tuple[str, Feed]]) -> list[tuple[str, list[int]]]:
    """Input names in the first feed's order, each with its batch-1 shape; every feed must
    have the same inputs and per-sample shapes, since the .rknn has fixed shapes.  The
    feeds are read one at a time (a lazy set stays on disk)."""
    specs: list[tuple[str, list[int]]] | None = None
    first_label, first = "", {}
    for label, feed in feeds:
        if specs is None:
            first_label, first = label, feed
            specs = [(name, [1, *np.shape(array)[1:]]) for name, array in first.items()]
        if set(feed) != set(first):
            raise BuildError(f"{label}: names {sorted(feed)} differ from {first_label}'s "
                             f"{sorted(first)}")
        for name, shape in specs:
            array = feed[name]
            if array.ndim < 1 or array.shape[0] < 1 or list(array.shape[1:]) != shape[1:]:
                raise BuildError(f"{label}: {name} has shape {list(array.shape)}; the "
                                 f"rknn model takes [N, {', '.join(map(str, shape[1:]))}]")
    if specs is None:
        raise BuildError("rknn conversion needs at least one calibration or held-out input")
    return specs


def _write_calibration(scratch: Path, names: list[str], feeds: Sequence[Feed]) -> int:
    """One .npy per sample and input, listed in dataset.txt as the toolkit reads it: a line
    per sample, its inputs' files separated by spaces (so the names have none)."""
    folder = scratch / "calibration"
    folder.mkdir()
    lines = []
    for index, feed in enumerate(feeds):
        for sample in range(feed[names[0]].shape[0]):
            files = []
            for position, name in enumerate(names):
                path = folder / f"{index:04d}-{sample:03d}-{position}.npy"
                np.save(path, feed[name][sample:sample + 1], allow_pickle=False)
                files.append(path.relative_to(scratch).as_posix())
            lines.append(" ".join(files))
    (scratch / "dataset.txt").write_text("".join(line + "\n" for line in lines))
    return len(lines)


def _write_heldout(scratch: Path, names: list[str], feeds: Sequence[Feed]) -> list[list[str]]:
    folder = scratch / "heldout"
    folder.mkdir()
    written = []
    for index, feed in enumerate(feeds):
        paths = []
        for position, name in enumerate(names):
            path = folder / f"{index:04d}-{position}.npy"
            np.save(path, feed[name], allow_pickle=False)
            paths.append(str(path))
        written.append(paths)
    return written


def _read_outputs(result: dict[str, Any], count: int, folder: Path) -> list[list[np.ndarray]]:
    listed = result.get("outputs")
    if not (isinstance(listed, list) and len(listed) == count
            and all(isinstance(paths, list) for paths in listed)):
        raise BuildError(f"rknn converter: its result lists no outputs for the {count} "
                         f"held-out inputs: {str(listed)[:200]}")
    outputs = []
    for paths in listed:
        arrays = []
        for name in paths:
            path = Path(str(name))
            if path.parent != folder or not path.is_file():
                raise BuildError(f"rknn converter: output {name} is not a file it was given")
            arrays.append(np.load(path, allow_pickle=False))
        outputs.append(arrays)
    return outputs


def _run_worker(python: Path, request: dict[str, Any], cwd: Path, timeout_s: float,
                progress: Progress) -> dict[str, Any]:
    """The worker's result; its progress lines relayed on this thread as they come."""
    # -I: no PYTHONPATH, user site or script directory from the agent's environment.
    process = subprocess.Popen([str(python), "-I", str(WORKER)], cwd=cwd,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, start_new_session=True)
    assert process.stdin and process.stdout and process.stderr
    lines: queue.Queue[bytes | None] = queue.Queue()
    tail: deque[str] = deque()
    threads = [threading.Thread(target=_send, args=(process.stdin, request), daemon=True),
               threading.Thread(target=_read_lines, args=(process.stdout, lines), daemon=True),
               threading.Thread(target=_keep_tail, args=(process.stderr, tail), daemon=True)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout_s
    messages: list[dict[str, Any]] = []
    garbage: str | None = None
    try:
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise BuildError(f"rknn converter: no result after {timeout_s:g} s; killed"
                                 + _tail_text(tail)) from None
            if line is None:
                break
            message = _parse(line)
            if message is None:
                garbage = garbage or line.decode(errors="replace")[:200]
            elif "progress" in message:
                progress(str(message["progress"])[:PROGRESS_LIMIT])
            else:
                messages.append(message)
        try:
            returncode = process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise BuildError(f"rknn converter: did not exit within {timeout_s:g} s; killed"
                             + _tail_text(tail)) from None
    finally:
        # The whole group: the toolkit may leave children that hold the pipes open.
        _kill_group(process)
        for thread in threads:
            thread.join(timeout=5)
    return _outcome(python, returncode, messages, garbage, _tail_text(tail))


def _outcome(python: Path, returncode: int, messages: list[dict[str, Any]],
             garbage: str | None, tail: str) -> dict[str, Any]:
    if garbage is not None:
        raise BuildError(f"rknn converter ({python}) wrote a line that is not its protocol's "
                         f"JSON: {garbage!r}" + tail)
    last = messages[-1] if messages else {}
    if "error" in last:
        raise BuildError(f"rknn converter failed at {last.get('step', '?')}: {last['error']}"
                         + tail)
    if returncode != 0:
        how = f"signal {-returncode}" if returncode < 0 else f"status {returncode}"
        raise BuildError(f"rknn converter ({python}) ended with {how}" + tail)
    result = last.get("result")
    if not isinstance(result, dict):
        raise BuildError(f"rknn converter ({python}) ended without a result" + tail)
    return result


def _parse(line: bytes) -> dict[str, Any] | None:
    try:
        message = json.loads(line)
    except ValueError:
        return None
    return message if isinstance(message, dict) else None


def _send(stream: IO[bytes], request: dict[str, Any]) -> None:
    """On a thread: a worker that never reads its stdin must not stall the timeout."""
    try:
        stream.write(json.dumps(request).encode())
        stream.close()
    except (BrokenPipeError, ValueError):  # it exited first; its output says why
        pass


def _read_lines(stream: IO[bytes], lines: queue.Queue[bytes | None]) -> None:
    """Each stdout line to the queue, up to STDOUT_LIMIT bytes; the rest is drained, so the
    worker never blocks on a full pipe, and reported as one unparseable line."""
    total = 0
    for line in iter(lambda: stream.readline(STDOUT_LIMIT), b""):
        total += len(line)
        if total <= STDOUT_LIMIT:
            lines.put(line)
        elif total - len(line) <= STDOUT_LIMIT:
            lines.put(b"(more than %d bytes on stdout)" % STDOUT_LIMIT)
    lines.put(None)


def _keep_tail(stream: IO[bytes], tail: deque[str]) -> None:
    kept = 0
    for raw in iter(lambda: stream.readline(STDERR_TAIL), b""):
        line = COLOUR.sub("", raw.decode(errors="replace"))
        tail.append(line)
        kept += len(line)
        while kept > STDERR_TAIL and len(tail) > 1:
            kept -= len(tail.popleft())


def _tail_text(tail: deque[str]) -> str:
    text = "".join(tail).rstrip()[-STDERR_TAIL:]
    return f"\nits stderr ends:\n{text}" if text else ""


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
