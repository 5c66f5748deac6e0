"""The control plane's side of the data plane: spawn ``edge-agent serve``, watch it, restart
it with backoff, and read its figures for telemetry.

A data-plane fault (exit, kill -9, OOM kill, a hung server or a stuck call) makes the agent
``degraded`` and restarts the process; it never stops the control plane or its watchdog
pings, because the fleet needs the control plane to fix the node.  Every exit is an
``event`` with the status or signal, and ``restarts`` counts them in telemetry.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.kernel.process import stop_child
from agent.service.building import EXTEND_S, BuildWatch
from agent.service.systemd import Notifier
from agent.serving.building import BUILDING_FILE
from agent.serving.connections import START_ERROR_FILE, read_start_error
from agent.serving.threads import write_sched_file

if TYPE_CHECKING:
    from agent.config import Config
    from agent.kernel.sched import ThreadSched
    from agent.service.parts import Ending
    from agent.serving.http_client import HttpClient
    from agent.tuning.placement import Placement

logger = logging.getLogger(__name__)

POLL_S = 1.0  # readiness and statistics
INDEX_S = 10.0  # the repository index, when nothing says it changed
FIRST_READY_S = 300.0  # a first load may build an engine for minutes (TensorRT)
HUNG_S = 15.0  # a listening server that stops answering this long is killed
NOT_READY_S = 30.0  # a loaded server whose self-probe keeps failing this long is restarted
BACKOFF_MIN_S, BACKOFF_MAX_S = 1.0, 30.0
STEADY_S = 60.0  # ready this long: the backoff starts from its minimum again
STOP_S = 10.0  # SIGTERM, then SIGKILL


def exit_reason(returncode: int) -> dict[str, Any]:
    """An exit status as the event carries it: ``{exit_status}`` or ``{signal}``."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return {"signal": name}
    return {"exit_status": returncode}


def own_child_tls(cert: str | None, key: str | None,
                  client_ca: str | None) -> ssl.SSLContext:
    """TLS to the data plane this process started, at the address that child wrote: its
    certificate is not checked (it is the one the config gives it), and with ``client_ca``
    the control plane shows the same certificate, which that CA must then have issued."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    if client_ca and cert and key:
        context.load_cert_chain(cert, key)
    return context


class Supervisor:
    """One ``serve`` child at a time; ``start`` waits (bounded) for the first ready."""

    def __init__(self, config: Config, state_dir: Path, on_event: Callable[..., None],
                 sched: ThreadSched | None = None, wait_ready_s: float = FIRST_READY_S,
                 placement: Placement | None = None) -> None:
        self.config, self.on_event = config, on_event
        self.placement = placement  # its cgroup: a systemd scope, a leaf, or none
        self.placement_error: str | None = None
        self.spawns = 0
        self.directory = state_dir / "serve"
        self.state_dir = state_dir
        self.sched = sched
        self.wait_ready_s = wait_ready_s
        self.process: subprocess.Popen[bytes] | None = None
        self.addresses: dict[str, str] = {}
        self.state = "stopped"  # starting | ready | not_ready | restarting | stopped
        self.reason: str | None = None
        self.last_exit: str | None = None  # how the last process ended, for the problem
        self.restarts = 0
        self.stats: list[dict[str, Any]] = []  # the last statistics read
        self.index: list[Any] = []  # IndexEntry rows, the last read
        self._index_key: tuple[set[Any], bool] | None = None  # what served when it was read
        self._index_at = 0.0
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._token = self.directory / "control-token"
        self._resched_pending = False  # a new sched file the running server has not heard of
        self.building = BuildWatch(self.directory / BUILDING_FILE, Notifier())

    # -- files the child reads -----------------------------------------------------------------

    def _prepare(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        config_file = self.directory / "agent.json"
        config_file.write_text(json.dumps(self.config.raw))
        fd = os.open(self._token, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:  # the control plane's own key to load/unload
            handle.write(secrets.token_urlsafe(32))
        write_sched_file(self.directory / "sched.json", self.sched)

    def _command(self) -> list[str]:
        d = self.directory
        return [sys.executable, "-m", "agent", "serve", "--config", str(d / "agent.json"),
                "--state-dir", str(self.state_dir), "--ready-file", str(d / "ready.json"),
                "--sched-file", str(d / "sched.json"), "--token-file", str(self._token),
                "--parent-pid", str(os.getpid())]

    def token(self) -> str:
        return self._token.read_text().strip()

    def client(self, timeout_s: float = 5.0) -> HttpClient:
        """A client of its own for the caller (a client is not thread-safe)."""
        from agent.serving.http_client import HttpClient

        tls = self.config.serve.tls
        if tls is None:
            return HttpClient(self.base_url(), token=self.token(), timeout_s=timeout_s)
        return HttpClient(self.base_url(), token=self.token(), timeout_s=timeout_s,
                          ssl_context=own_child_tls(tls.cert, tls.key, tls.client_ca))

    def base_url(self) -> str:
        address = self.addresses.get("http") or self.config.serve.http
        return f"{'https' if self.config.serve.tls is not None else 'http'}://{address}"

    # -- lifecycle -------------------------------------------------------------------------------

    def launch(self) -> None:
        """The child spawned and watched; its first ready is ``wait_ready``'s."""
        self._prepare()
        self.prepare_placement()
        self._stop.clear()
        self._spawn()
        self._thread = threading.Thread(target=self._watch, name="data-plane", daemon=True)
        self._thread.start()

    def wait_ready(self) -> None:
        """Until the first ready, the child's exit, or ``wait_ready_s`` (extended while
        engines build, as systemd's start timeout is)."""
        deadline = time.monotonic() + self.wait_ready_s
        while time.monotonic() < deadline and not self._ready.is_set():
            process = self.process
            if process is None or process.poll() is not None or self._ready.wait(0.1):
                break
            if self.building.check():  # engines still building: wait on, as systemd does
                deadline = max(deadline, time.monotonic() + EXTEND_S)

    def _spawn(self) -> None:
        (self.directory / "ready.json").unlink(missing_ok=True)
        (self.directory / START_ERROR_FILE).unlink(missing_ok=True)
        self.building.reset()
        self.addresses = {}
        self._index_key = None  # a new process: its index is read at its first poll
        self._ready.clear()
        # systemd hears the control plane only (NotifyAccess=main): the child must not try
        env = {k: v for k, v in os.environ.items()
               if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
        # its own session: a terminal's Ctrl-C reaches the control plane, which stops it;
        # it ends with the control plane anyway (--parent-pid: PR_SET_PDEATHSIG)
        self.spawns += 1
        command = self._command()
        if self.placement is not None:  # systemd-run --scope execs it: still our child
            command = self.placement.command(command, self.spawns)
        self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, env=env,
                                        start_new_session=True)
        self._adopt(self.process.pid)
        self.state, self.started_at = "starting", time.monotonic()
        self.reason = None if self.last_exit is None else f"starting again ({self.last_exit})"
        logger.info("data plane started (pid %d)", self.process.pid)

    def _adopt(self, pid: int) -> None:
        """Without systemd the child moves into its leaf at once (it is still importing);
        a failure leaves it running where the agent runs, reported as a problem."""
        if self.placement is None:
            return
        try:
            self.placement.adopt(pid)
            self.placement_error = None
        except OSError as error:
            self.placement_error = f"not in its cgroup ({error})"
            logger.error("data plane (pid %d): %s", pid, self.placement_error)

    def prepare_placement(self) -> None:
        """The data plane's cgroup, before the first start (idempotent)."""
        if self.placement is None:
            return
        try:
            self.placement.prepare()
        except OSError as error:
            self.placement_error = f"its cgroup cannot be prepared ({error})"
            logger.error("data plane: %s", self.placement_error)

    def stop(self, ending: Ending | None = None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=STOP_S + 5)
        self._terminate()
        self.state = "stopped"

    def _terminate(self) -> None:
        if self.process is not None:
            stop_child(self.process, STOP_S)

    def restart(self) -> None:
        """``restart-inference``: a fresh process, waited for like the first."""
        with self._lock:
            self._terminate()
            self._spawn()
        self._ready.wait(self.wait_ready_s)

    def resched(self, sched: ThreadSched | None) -> None:
        """A profile switch or rollback: the new scheduling for the inference threads.

        The file first; SIGHUP only to a server that wrote its ready file, so it has its
        handler (before that SIGHUP's default action would end it): one starting now reads
        the file, or is signalled by ``_watch`` once it is ready."""
        if sched == self.sched:
            return
        self.sched = sched
        write_sched_file(self.directory / "sched.json", sched)
        self._resched_pending = True
        if self.addresses:
            self._send_resched()

    def _send_resched(self) -> None:
        self._resched_pending = False
        process = self.process
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGHUP)

    # -- watching --------------------------------------------------------------------------------

    def _watch(self) -> None:
        """The supervisor's thread: nothing it meets may end it."""
        backoff = BACKOFF_MIN_S
        client: HttpClient | None = None
        last_answer = last_ready = time.monotonic()
        while not self._stop.wait(POLL_S if self.addresses else 0.1):
            try:
                with self._lock:
                    process = self.process
                    assert process is not None
                    code = process.poll()
                if code is not None:
                    client = None
                    backoff = self._exited(process, code, backoff)
                    continue
                if not self.addresses:
                    self._read_addresses()
                    last_answer = time.monotonic()
                    if not self.addresses:
                        self._check_first_load(process)
                        continue
                    if self._resched_pending:
                        self._send_resched()
                    # listening: asked for readiness now, not a POLL_S later (start and a
                    # restart wait for the first ready)
                if client is None or client.base_url != self.base_url():  # a new process
                    client = self.client(timeout_s=2.0)
                if self._poll(client):
                    last_answer = time.monotonic()
                    if self.state == "ready":
                        last_ready = last_answer
                        if last_answer - self.started_at > STEADY_S:
                            backoff = BACKOFF_MIN_S
                    elif self._first_loading():  # the first start's budget, not NOT_READY_S
                        last_ready = last_answer
                        self._check_first_load(process)
                    elif last_answer - max(last_ready, self.started_at) > NOT_READY_S:
                        self._kill(process, f"not ready for {NOT_READY_S:.0f} s "
                                   f"({self.reason})")
                elif time.monotonic() - last_answer > HUNG_S:
                    self._kill(process, f"the server did not answer for {HUNG_S:.0f} s")
            except Exception:  # the supervisor must go on; the next round tries again
                logger.exception("data plane: supervision round failed")
                client = None

    def _read_addresses(self) -> None:
        try:
            data = json.loads((self.directory / "ready.json").read_text())
        except (OSError, ValueError):
            return
        if data.get("pid") == (self.process.pid if self.process else None):
            self.addresses = {"http": str(data["http"]), "grpc": str(data["grpc"]),
                              **({"metrics": str(data["metrics"])} if "metrics" in data
                                 else {})}

    def _check_first_load(self, process: subprocess.Popen[bytes]) -> None:
        if time.monotonic() - self.started_at > self.wait_ready_s:
            doing = "not listening" if not self.addresses else f"still {self.reason}"
            self._kill(process, f"{doing} after {self.wait_ready_s:.0f} s")

    def _first_loading(self) -> bool:
        """The process listens and has not been ready yet: its models still load."""
        return not self._ready.is_set() and any(e.state == "LOADING" for e in self.index)

    def _poll(self, client: HttpClient) -> bool:
        """Readiness, statistics and the index; False when the server did not answer.  On a
        fresh connection each round: a kept-alive one answers when no new client gets in."""
        from agent.serving.errors import ServeError

        client.close()
        try:
            ready = client.ready()
            stats = client.statistics()
            served = {(s.get("name"), s.get("version")) for s in stats}
            # the index rescans the repository: read it when what serves or readiness
            # changed, else every INDEX_S (a failed load leaves both as they were)
            if (served, ready) != self._index_key or \
                    time.monotonic() - self._index_at > INDEX_S:
                self.index = client.index()
                self._index_key, self._index_at = (served, ready), time.monotonic()
            self.stats = stats
        except ServeError as error:
            self.reason = f"the server does not answer: {error}"
            return False
        # "stuck": a run cancelled that the runtime has not given back (scheduler.CANCEL_GRACE_S)
        stuck = [f"{s['name']} version {s['version']}" for s in self.stats
                 if s.get("edge_agent", {}).get("stuck")]
        if stuck:
            assert self.process is not None
            self._kill(self.process, f"an inference run on {stuck[0]} was cancelled and the "
                       "runtime did not give it back")
            return True
        failed = [e.reason for e in self.index
                  if e.state != "READY" and e.reason and e.reason != "unloaded"]
        loading = [e.name for e in self.index if e.state == "LOADING"]
        self.state = "ready" if ready else "not_ready"
        self.reason = None if ready and not failed else (
            "; ".join(failed) or (f"loading {', '.join(loading)}" if loading else
                                  "the server is not ready (a model's self-probe failed)"))
        if ready:
            self._ready.set()
        return True

    def _kill(self, process: subprocess.Popen[bytes], why: str) -> None:
        logger.error("data plane (pid %d): %s; killing it", process.pid, why)
        self.on_event("data_plane_killed", pid=process.pid, reason=why)
        process.kill()

    def _exited(self, process: subprocess.Popen[bytes], code: int, backoff: float) -> float:
        """Report the exit, wait out the backoff (or the stop), start it again."""
        self.restarts += 1
        reason = exit_reason(code)
        uptime = round(time.monotonic() - self.started_at, 1)
        self.state, self.stats, self.index = "restarting", [], []
        self.last_exit = read_start_error(self.directory, process.pid) or (
            "the last one exited with "
            + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in reason.items()))
        self.reason = f"{self.last_exit}; restarting in {backoff:.0f} s"
        logger.error("data plane (pid %d): %s", process.pid, self.reason)
        self.on_event("data_plane_exited", pid=process.pid, **reason, uptime_s=uptime,
                      restarts=self.restarts, restart_in_s=backoff)
        if self._stop.wait(backoff):
            return backoff
        with self._lock:
            if self.process is process:
                self._spawn()
        return min(backoff * 2, BACKOFF_MAX_S)

    # -- what the rest of the agent reads ----------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    def problems(self) -> list[str]:
        placed = [f"data plane: {self.placement_error}"] if self.placement_error else []
        if self.state in ("ready", "stopped") and self.reason is None:
            return placed
        return [f"data plane: {self.reason or self.state}", *placed]

    def status(self) -> dict[str, Any]:
        process = self.process
        return {"state": self.state, "pid": process.pid if process else None,
                "restarts": self.restarts, **self.addresses,
                **({"placement": self.placement.describe()} if self.placement else {})}
