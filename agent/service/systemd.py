"""Talking to systemd: sd_notify messages and a watchdog that only pings a healthy agent.

Under ``Type=notify`` systemd waits for ``READY=1`` and, with ``WatchdogSec=``, restarts the
service when ``WATCHDOG=1`` stops coming.  The ping is sent only while the inference loop and
the MQTT link are alive and making progress, so a hung loop gets the agent restarted instead
of reported healthy.  Outside systemd (no ``NOTIFY_SOCKET``) every call is a no-op.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)


class Notifier:
    """sd_notify(3) over the datagram socket systemd passes in ``NOTIFY_SOCKET``."""

    def __init__(self, address: str | None = None) -> None:
        address = address if address is not None else os.environ.get("NOTIFY_SOCKET")
        self.address: str | None = None
        if address:
            # "@name" is an abstract socket: a leading NUL byte on Linux
            self.address = "\0" + address[1:] if address.startswith("@") else address
        self._socket: socket.socket | None = None
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, **fields: object) -> None:
        """``notify(READY=1, STATUS="running")``; errors are logged, never raised."""
        if self.address is None:
            return
        message = "\n".join(f"{key}={value}" for key, value in fields.items()).encode()
        with self._lock:
            try:
                if self._socket is None:
                    self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                self._socket.sendto(message, self.address)
            except OSError as error:
                logger.warning("sd_notify to %s failed: %s", self.address, error)


def watchdog_interval_s(environ: dict[str, str] | None = None) -> float | None:
    """Half of ``WATCHDOG_USEC`` (systemd's advice), when the watchdog is meant for us."""
    env = os.environ if environ is None else environ
    usec, pid = env.get("WATCHDOG_USEC"), env.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 2 / 1e6
    except ValueError:
        return None


class Watchdog:
    """Pings every ``interval_s`` while ``problem()`` says nothing is wrong."""

    def __init__(self, notifier: Notifier, problem: Callable[[], str | None],
                 interval_s: float) -> None:
        self.notifier, self.problem, self.interval_s = notifier, problem, interval_s
        self.withheld: str | None = None  # why the last ping was not sent
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def check_once(self) -> bool:
        """One round: ping if healthy; returns whether it pinged."""
        reason = self.problem()
        if reason is None:
            self.withheld = None
            self.notifier.notify(WATCHDOG=1)
            return True
        if reason != self.withheld:
            logger.error("watchdog: not pinging systemd: %s", reason)
            self.notifier.notify(STATUS=f"unhealthy: {reason}")
        self.withheld = reason
        return False

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.check_once()
