"""A data plane still building its engines (TensorRT: minutes on a Jetson) must not be
killed by systemd's start timeout or given up on by the supervisor's first wait.

The data plane rewrites ``building.json`` every few seconds while a compiling provider builds
(session.BUILDING_EVERY_S); each update the control plane sees becomes an
``EXTEND_TIMEOUT_USEC`` (systemd 236: the start timeout runs on from now by that much), so a
build that stops making progress still times out.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from agent.service.systemd import Notifier

logger = logging.getLogger(__name__)

EXTEND_S = 60.0  # well above the data plane's 10 s between reports


class BuildWatch:
    def __init__(self, path: Path, notifier: Notifier) -> None:
        self.path, self.notifier = path, notifier
        self._seen: int | None = None

    def reset(self) -> None:
        """A new data plane: what the last one wrote is gone."""
        self.path.unlink(missing_ok=True)
        self._seen = None

    def check(self) -> bool:
        """Whether the data plane reported progress since the last check (and systemd was
        told to wait EXTEND_S more)."""
        try:
            changed = self.path.stat().st_mtime_ns
            seconds = float(json.loads(self.path.read_text())["seconds"])
        except (OSError, ValueError, KeyError, TypeError):
            return False
        if changed == self._seen:
            return False
        self._seen = changed
        logger.info("data plane still building engines (%.0f s so far)", seconds)
        self.notifier.notify(EXTEND_TIMEOUT_USEC=int(EXTEND_S * 1e6),
                             STATUS=f"starting: the data plane is building engines "
                             f"({seconds:.0f} s so far)")
        return True
