"""Hot-plug in the running agent: device events are collected off the udev watch's thread
and handed to the service's main loop once they settle.

A device arriving brings a burst of uevents (add, bind, change for the device and its
children); rediscovering once per burst, on the main thread where verify also runs, keeps
discovery off the watch thread and never runs two rediscoveries at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from agent.discovery.udev import HotplugEvent, HotplugWatcher, UdevUnavailable, udev_running

if TYPE_CHECKING:
    from agent.service.parts import Ending

logger = logging.getLogger(__name__)

SETTLE_S = 0.5  # quiet time after the last event of a burst before rediscovering
MAX_PENDING = 256  # events kept per burst; a storm beyond it is counted, not stored


class Hotplug:
    """Watches ``subsystems`` (through udevd when it runs, the kernel's uevents otherwise)
    and hands out each settled burst of events through ``take()``."""

    def __init__(self, subsystems: Iterable[str], settle_s: float = SETTLE_S) -> None:
        self.subsystems = tuple(subsystems)
        self.settle_s = settle_s
        self.error: str | None = None  # why there is no watch
        self.bursts = 0
        self._lock = threading.Lock()
        self._pending: list[HotplugEvent] = []
        self._overflow = 0
        self._last = 0.0
        self._watcher: HotplugWatcher | None = None

    def start(self) -> None:
        """Start the watch; without pyudev, libudev or a uevent socket the agent runs on
        and says so (``error``)."""
        source = "udev" if udev_running() else "kernel"
        watcher = HotplugWatcher(self._on_event, self.subsystems, source)
        try:
            watcher.start()
        except UdevUnavailable as error:
            self.error = str(error)
            logger.warning("hot-plug: %s; devices added later are found only on restart",
                           error)
            return
        self._watcher = watcher
        logger.info("hot-plug: watching %s (%s events)", ", ".join(self.subsystems), source)

    def stop(self, ending: Ending) -> None:
        if self._watcher is not None:
            self._watcher.stop()

    def problems(self) -> list[str]:
        """None: without a watch the agent works, and finds new devices on restart."""
        return []

    def _on_event(self, event: HotplugEvent) -> None:
        with self._lock:
            if len(self._pending) < MAX_PENDING:
                self._pending.append(event)
            else:
                self._overflow += 1
            self._last = time.monotonic()

    def take(self) -> tuple[list[dict[str, Any]], int] | None:
        """The last burst's events (and how many more there were) once no event came for
        ``settle_s``; None while there is none or it is still going on."""
        with self._lock:
            if not (self._pending or self._overflow) or \
                    time.monotonic() - self._last < self.settle_s:
                return None
            events, more = self._pending, self._overflow
            self._pending, self._overflow = [], 0
        self.bursts += 1
        return [{"action": e.action, "subsystem": e.device.subsystem,
                 "name": e.device.sys_name, "devnode": e.device.devnode,
                 "driver": e.device.driver} for e in events], more
