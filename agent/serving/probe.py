"""The background probe: every served version runs one synthetic call now and then, so a
session that breaks while serving (a lost device, a runtime gone bad) shows as not ready
before a client finds out, and a version that recovers is ready again."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable

from agent.serving.versions import Version

logger = logging.getLogger(__name__)


class Prober:
    def __init__(self, interval_s: float, targets: Callable[[], Iterable[Version]],
                 stopping: threading.Event) -> None:
        self.interval_s = interval_s
        self.targets = targets
        self.stopping = stopping
        self._thread: threading.Thread | None = None
        self._round_lock = threading.Lock()  # a test's probe_now and the thread, one at a time

    def run_once(self) -> None:
        """Probe every served version once; record its outcome on the version."""
        with self._round_lock:
            for version in list(self.targets()):
                reason = version.probe()
                if reason != version.probe_error:
                    if reason:
                        logger.warning("%s failed its probe: %s", version.label, reason)
                    else:
                        logger.info("%s passes its probe again", version.label)
                version.probe_error = reason

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="serve-probe", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self.stopping.wait(self.interval_s):
            try:
                self.run_once()
            except Exception:  # a probe round must never end the thread
                logger.exception("probe round failed")

    def join(self, timeout: float = 10.0) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
