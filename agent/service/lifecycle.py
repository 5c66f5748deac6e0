"""The main job's life under systemd: start, serve, reload on SIGHUP, stop on SIGTERM/SIGINT.

systemd hears READY=1 once the agent started, STATUS= as it runs, WATCHDOG=1 only while it is
healthy (``health.Liveness``), RELOADING=1 then READY=1 around a reload and STOPPING=1 on the
way out.  A reload builds the whole agent again from the new file; a file that does not load
leaves the running agent as it is and reports a ``config_rejected`` event.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable

from agent.config import Config
from agent.service.node import Service, ServiceError
from agent.service.systemd import Notifier, Watchdog, watchdog_interval_s
from agent.stopping import SIGINT_EXIT, StopSignals
from agent.terminal import TerminalLine, status_line

logger = logging.getLogger(__name__)

STATUS_EVERY_S = 5.0


class ConfigRejected(Exception):
    """A configuration a reload cannot use (the message names the file and key, or the
    flag); the running service stays."""


class Runner:
    """Runs one ``Service`` (and its replacements after reloads) until a stop signal;
    ``load_config`` reads the configuration again for a reload and raises
    ConfigRejected for one that cannot be used."""

    def __init__(self, service: Service, load_config: Callable[[], Config],
                 notifier: Notifier, terminal: TerminalLine | None,
                 signals: StopSignals) -> None:
        self.service, self.load_config = service, load_config
        self.notifier, self.terminal, self.signals = notifier, terminal, signals
        self.stop = signals.event  # SIGTERM, SIGINT, or a reload that cannot go on
        self.reload = threading.Event()
        self.watchdog: Watchdog | None = None
        signal.signal(signal.SIGHUP, lambda number, frame: self.reload.set())

    @property
    def exit_status(self) -> int:
        """0 for a run that ended by itself or on SIGTERM, 130 for Ctrl-C (SIGINT)."""
        return SIGINT_EXIT if self.signals.received == signal.SIGINT else 0

    def run(self, seconds: float | None) -> None:
        """Start, serve for ``seconds`` (None: until stopped), shut down.  Raises
        ServiceError, with nothing started, when the agent cannot run at all."""
        self.notifier.notify(STATUS="starting: discovery, tuning, model")
        self.service.start()
        self.notifier.notify(READY=1, STATUS="running")
        self._start_watchdog()
        try:
            self._serve(seconds)
        finally:
            self._shut_down()

    def _start_watchdog(self) -> None:
        interval = watchdog_interval_s()
        if interval is not None:  # the replacement after a reload is watched as well
            self.watchdog = Watchdog(self.notifier,
                                     lambda: self.service.liveness.problem(), interval)
            self.watchdog.start()

    def _serve(self, seconds: float | None) -> None:
        deadline = None if seconds is None else time.monotonic() + seconds
        last_status = 0.0
        while not self.stop.is_set():
            if self.reload.is_set():
                self.reload.clear()
                self._reload()
            line = status_line(self.service.tick())
            if time.monotonic() - last_status >= STATUS_EVERY_S:
                self.notifier.notify(STATUS=line[:200])
                last_status = time.monotonic()
            if self.terminal is not None:
                self.terminal.show(line)
            if deadline is not None and time.monotonic() >= deadline:
                break
            self.stop.wait(1.0 if deadline is None else
                           max(0.0, min(1.0, deadline - time.monotonic())))
        if self.terminal is not None:
            self.terminal.close()

    def _reload(self) -> None:
        self.notifier.notify(RELOADING=1, STATUS="reloading the configuration")
        try:
            config = self.load_config()
        except ConfigRejected as error:
            logger.error("reload: %s; the running configuration stays", error)
            self.service.event("config_rejected", error=str(error))
            self.notifier.notify(READY=1, STATUS=f"configuration rejected: {error}"[:200])
            return
        self.service.stop(rollback=False)  # the new service plans its profile as a switch
        try:
            replacement = Service(config, notifier=self.notifier)
            replacement.start()
        except ServiceError as error:  # the state directory went away: nothing to run
            logger.error("reload: %s", error)
            self.stop.set()
            return
        self.service = replacement
        self.service.event("config_reloaded", source=config.source)
        self.notifier.notify(READY=1, STATUS="running (configuration reloaded)")

    def _shut_down(self) -> None:
        self.notifier.notify(STOPPING=1, STATUS="stopping")
        if self.watchdog is not None:
            self.watchdog.stop()
        self.service.stop()
