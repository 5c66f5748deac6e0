"""How an accepted command runs: its outcome, and long jobs beside the command worker.

Commands run one at a time on the controller's worker, so a handler must not hold it for
minutes (``ping`` would wait behind a model build).  A handler whose work is long checks
what it can at once and returns a ``Job`` instead of its result: the job runs on a thread
of its own, its progress steps go out as ``in_progress`` replies exactly as a handler's do,
and the command's final reply is sent when it ends.  Jobs of one ``slot`` run one at a
time; another is answered ``busy`` at once, naming the command whose job holds the slot.

Stopping cancels every job (its ``cancel`` event is set and its next progress step raises
``Cancelled``) and waits a bounded time; a job still running then is answered ``cancelled``
and left behind (a daemon thread; what it says later is dropped).  An exception inside a
job is its command's ``failed`` reply, as in a handler: it ends neither the controller nor
the next job.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agent import protocol

logger = logging.getLogger(__name__)

JOB_GRACE_S = 10.0  # how long a stop waits for cancelled jobs to end


class CommandFailed(Exception):
    """A command that ran and failed: ``code`` goes into the reply."""

    def __init__(self, code: str, message: str, result: dict[str, Any] | None = None) -> None:
        self.code, self.result = code, result
        super().__init__(message)


class Cancelled(CommandFailed):
    """The agent is stopping: raised into a job by its next progress step."""

    def __init__(self, message: str = "the agent is stopping: the job was cancelled") -> None:
        super().__init__("cancelled", message)


Progress = Callable[[str], None]


@dataclass(frozen=True)
class Job:
    """Long work a handler hands back: ``run(progress, cancel)`` returns the result (or
    raises CommandFailed) on the job's own thread; ``cancel`` is set when the agent stops,
    for work that waits (a subprocess to kill, a blocking wait to leave)."""

    slot: str  # jobs of one slot run one at a time, e.g. "build"
    run: Callable[[Progress, threading.Event], dict[str, Any]]


# status, code, message, result: what a final reply says
Outcome = tuple[str, str, str | None, dict[str, Any] | None]
Finish = Callable[[str, str, str | None, dict[str, Any] | None], None]


def outcome_of(label: str, call: Callable[[], Any]) -> Outcome | Job:
    """Run a handler (or a job's work): its result, its failure, or the job it handed back.
    Any other exception is a ``failed`` reply with code ``error``: the fleet must hear."""
    try:
        result = call()
    except CommandFailed as failure:
        return protocol.FAILED, failure.code, str(failure), failure.result
    except Exception as error:
        logger.exception("control: %s failed", label)
        return protocol.FAILED, "error", str(error), None
    if isinstance(result, Job):
        return result
    return protocol.SUCCEEDED, "ok", None, result


@dataclass
class _Running:
    command_id: str
    command: str
    slot: str
    finish: Finish
    cancel: threading.Event
    started: float = field(default_factory=time.monotonic)
    step: str = ""  # the last progress step it reported
    thread: threading.Thread | None = None
    answered: bool = False  # under the runner's lock: the final reply is claimed

    def view(self) -> dict[str, Any]:
        return {"id": self.command_id, "command": self.command, "step": self.step,
                "running_s": round(time.monotonic() - self.started, 1)}


class JobRunner:
    """The jobs running beside the command worker, one per slot."""

    def __init__(self, grace_s: float = JOB_GRACE_S) -> None:
        self.grace_s = grace_s
        self._lock = threading.Lock()
        self._slots: dict[str, _Running] = {}
        self._stopping = False

    def running(self) -> dict[str, dict[str, Any]]:
        """slot -> the job that holds it: its command's id and name, its last progress
        step and how long it has run (``get-status`` and ``edge-agent status`` show it)."""
        with self._lock:
            return {slot: entry.view() for slot, entry in self._slots.items()}

    def start(self, command_id: str, command: str, job: Job, progress: Progress,
              finish: Finish) -> str | None:
        """Run ``job`` on a thread of its own and ``finish`` with its outcome; when another
        job holds the slot, nothing starts and the id of its command is returned."""
        with self._lock:
            held = self._slots.get(job.slot)
            if held is not None:
                return held.command_id
            entry = _Running(command_id, command, job.slot, finish, threading.Event())
            if self._stopping:
                entry.cancel.set()  # it starts and ends at its first step
            self._slots[job.slot] = entry
        entry.thread = threading.Thread(target=self._body, args=(entry, job, progress),
                                        name=f"job-{job.slot}", daemon=True)
        entry.thread.start()
        return None

    def _body(self, entry: _Running, job: Job, progress: Progress) -> None:
        def step(text: str) -> None:
            if entry.cancel.is_set():
                raise Cancelled()
            with self._lock:
                answered = entry.answered
                entry.step = text
            if not answered:
                progress(text)

        def work() -> dict[str, Any]:
            if entry.cancel.is_set():  # started while the agent stops
                raise Cancelled()
            return job.run(step, entry.cancel)

        outcome = outcome_of(f"the {job.slot} job of command {entry.command_id}", work)
        if isinstance(outcome, Job):
            outcome = (protocol.FAILED, "error", "a job handed back another job", None)
        self._end(entry, outcome)

    def _end(self, entry: _Running, outcome: Outcome) -> None:
        """Free the slot first (a command sent on the final reply is not ``busy``), then
        answer, once: the job's own end and a stop that gave up on it race for this."""
        with self._lock:
            claimed, entry.answered = not entry.answered, True
            if self._slots.get(entry.slot) is entry:
                del self._slots[entry.slot]
        if not claimed:
            return
        try:
            entry.finish(*outcome)
        except Exception:  # the store may be closed by a stop that gave up on the job
            logger.exception("control: answering command %s failed", entry.command_id)

    def cancel(self) -> list[_Running]:
        """Cancel every job, and any started from now on; the ones running."""
        with self._lock:
            self._stopping = True
            entries = list(self._slots.values())
        for entry in entries:
            entry.cancel.set()
        return entries

    def stop(self) -> None:
        """Cancel every job and wait for them, ``grace_s`` in all; answer the rest."""
        entries = self.cancel()
        deadline = time.monotonic() + self.grace_s
        for entry in entries:
            if entry.thread is not None:
                entry.thread.join(max(0.0, deadline - time.monotonic()))
        for entry in entries:
            if entry.thread is not None and entry.thread.is_alive():
                logger.warning("control: the %s job of command %s did not end within %g s "
                               "of the stop: answered cancelled and left behind", entry.slot,
                               entry.command_id, self.grace_s)
                self._end(entry, (protocol.FAILED, "cancelled", "the agent stopped; the job "
                                  f"did not end within {self.grace_s:g} s", None))
