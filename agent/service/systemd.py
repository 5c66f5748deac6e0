"""Talking to systemd: sd_notify messages and a watchdog that only pings a healthy agent.

Under ``Type=notify`` systemd waits for ``READY=1`` and, with ``WatchdogSec=``, restarts the
service when ``WATCHDOG=1`` stops coming.  The ping is sent only while the inference loop and
the MQTT link are alive and making progress, so a hung loop gets the agent restarted instead
of reported healthy.  Outside systemd (no ``NOTIFY_SOCKET``) every call is a no-op.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


class Notifier:
    """sd_notify(3) through sdnotify, wrapped so that a failure is logged instead of being
    swallowed (sdnotify's default) or raised into the agent (its ``debug`` mode), and so
    that the health gating stays ours (see ``Watchdog``)."""

    def __init__(self, enabled: bool = True) -> None:
        self._notifier: Any = None
        self.address = os.environ.get("NOTIFY_SOCKET") if enabled else None
        if self.address:
            import sdnotify

            try:  # debug: errors are raised to us, to be logged
                self._notifier = sdnotify.SystemdNotifier(debug=True)
            except OSError as error:
                logger.warning("sd_notify: cannot reach systemd at %s: %s", self.address,
                               error)
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self._notifier is not None

    def notify(self, **fields: object) -> None:
        """``notify(READY=1, STATUS="running")``; errors are logged, never raised."""
        if self._notifier is None:
            return
        text = "\n".join(f"{key}={value}" for key, value in fields.items())
        # sdnotify encodes as Latin-1, systemd wants UTF-8 (a STATUS= that is not UTF-8 is
        # dropped): hand it the UTF-8 bytes spelled as Latin-1 characters.
        message = text.encode("utf-8", "replace").decode("latin-1")
        with self._lock:
            try:
                self._notifier.notify(message)
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
