"""A Mosquitto for this run when the configured broker is this machine's and nothing will
start one: a container or CI runner has no init system, so the quickstart's first
``edge-agent run`` would otherwise report to nobody.

Only for ``mqtt.local_broker: auto``, a loopback ``mqtt.host`` where nothing accepts on the
port, a ``mosquitto`` on PATH, not under systemd (a device's broker is the OS's job) and no
enabled or active mosquitto unit.  The broker keeps nothing on disk: its config is written
to a private temporary directory, removed as soon as it accepts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from agent.kernel.process import stop_child
from agent.serving.access import is_loopback

logger = logging.getLogger(__name__)

STARTUP_S = 10.0  # how long Mosquitto may take to accept, on a loaded board
STOP_S = 10.0  # SIGTERM, then SIGKILL
SYSTEMD_DIR = Path("/run/systemd/system")  # exists when systemd is the init system


class BrokerStartError(RuntimeError):
    """The Mosquitto started for this run did not come up: its own words, one line."""


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def _init_will_start_it(environ: dict[str, str], systemd_dir: Path) -> str | None:
    """Why the init system, not this run, owns the broker (None: nothing will start one)."""
    if environ.get("INVOCATION_ID") or environ.get("NOTIFY_SOCKET"):
        return "running as a systemd service"
    systemctl = shutil.which("systemctl")
    if not systemd_dir.is_dir() or systemctl is None:
        return None
    for verb in ("is-enabled", "is-active"):
        answer = subprocess.run([systemctl, verb, "--quiet", "mosquitto.service"],
                                capture_output=True, timeout=10, check=False)
        if answer.returncode == 0:
            return f"systemd's mosquitto.service {verb.removeprefix('is-')}"
    return None


def needed(mode: str | bool, host: str, port: int, environ: dict[str, str] | None = None,
           systemd_dir: Path = SYSTEMD_DIR) -> str | None:
    """The ``mosquitto`` to start for this run, or None when the agent must not start one."""
    if mode is False or not is_loopback(host) or _accepts(host, port):
        return None
    mosquitto = shutil.which("mosquitto") or shutil.which("mosquitto", path="/usr/sbin:/sbin")
    if mosquitto is None:
        return None
    owner = _init_will_start_it(dict(os.environ) if environ is None else environ, systemd_dir)
    if owner is not None:
        logger.debug("no broker on %s:%d, not starting one: %s", host, port, owner)
        return None
    return mosquitto


def _dies_with_us() -> list[str]:
    """A prefix that ends the broker with this process even when it is killed (SIGKILL, no
    cleanup): setpriv(1) sets the parent-death signal and execs, where a ``preexec_fn``
    would run Python between fork and exec, unsafe with threads."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "TERM", "--"] if setpriv else []


def _bind_address(host: str) -> str:
    return "::1" if host in ("::1", "[::1]") else "127.0.0.1"


@contextlib.contextmanager
def local_broker(mode: str | bool, host: str, port: int) -> Iterator[int | None]:
    """``with local_broker(config.mqtt.local_broker, host, port) as pid:`` a Mosquitto for
    the duration of the block when ``needed`` says so (``pid``; None when not started),
    stopped when the block ends however it ends."""
    mosquitto = needed(mode, host, port)
    if mosquitto is None:
        yield None
        return
    address = _bind_address(host)
    process = _started(mosquitto, address, port)
    try:
        logger.info("no MQTT broker on %s:%d; started mosquitto (pid %d) for this run, "
                    "stopped when it ends (mqtt.local_broker: false to never do this)",
                    address, port, process.pid)
        yield process.pid
    finally:
        stop_child(process, STOP_S)


def _started(mosquitto: str, address: str, port: int) -> subprocess.Popen[bytes]:
    """Mosquitto, accepting on ``address:port``.  Its private directory is gone once it
    accepts (it has read its config, and its log is an open descriptor), so not even a
    killed agent leaves a file behind."""
    with tempfile.TemporaryDirectory(prefix="edge-agent-mosquitto-") as private:
        config = Path(private) / "mosquitto.conf"
        # as the user this runs as: Mosquitto started as root would switch to its own user,
        # and a change of user clears the parent-death signal below
        config.write_text(f"listener {port} {address}\nallow_anonymous true\n"
                          "persistence false\nlog_dest stderr\n"
                          f"user {pwd.getpwuid(os.geteuid()).pw_name}\n")
        log = Path(private) / "mosquitto.log"
        with log.open("wb") as output:
            # a session of its own: Ctrl-C in the terminal reaches the agent, which still
            # delivers its last records before it stops the broker
            process = subprocess.Popen([*_dies_with_us(), mosquitto, "-c", str(config)],
                                       stdin=subprocess.DEVNULL, stdout=output, stderr=output,
                                       start_new_session=True)
        try:
            _wait_accepting(process, address, port, log)
        except BaseException:
            stop_child(process, STOP_S)
            raise
    return process


def _wait_accepting(process: subprocess.Popen[bytes], address: str, port: int,
                    log: Path) -> None:
    """Until Mosquitto accepts on ``port``; BrokerStartError when it exits or never does."""
    deadline = time.monotonic() + STARTUP_S
    while not _accepts(address, port):
        try:
            process.wait(timeout=0.05)  # its exit ends the wait at once
        except subprocess.TimeoutExpired:
            if time.monotonic() < deadline:
                continue
        said = log.read_text(errors="replace").strip().splitlines()
        raise BrokerStartError(
            f"mosquitto started for this run (no broker on {address}:{port}) "
            + (f"exited {process.returncode}" if process.returncode is not None
               else f"did not accept within {STARTUP_S:g} s")
            + (f": {said[-1]}" if said else "") + "; set mqtt.local_broker: false to run "
            "without it")
