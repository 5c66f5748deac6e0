"""The data plane's sockets as a process resource: its descriptor limit, failed accepts, and
an address that is taken (its one line goes to START_ERROR_FILE too).

Any local process can open connections to the data plane.  Under the default soft limit of
1024 descriptors a thousand idle ones fill the table, and then every new client (and the
supervisor's health check) is refused; the hard limit is the operator's (systemd's
``LimitNOFILE=``), so the server takes all of it.  Accepts that fail because the table is
full are counted and summarised, not logged one traceback each (asyncio's default).
"""

from __future__ import annotations

import errno
import json
import logging
import resource
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import asyncio

logger = logging.getLogger(__name__)

# beside the ready file: ``{pid, error}`` of a server that could not listen, for its supervisor
# (light to import, as the control plane reads it)
START_ERROR_FILE = "start-error.json"
ACCEPT_LOG_S = 10.0  # at most one line per listener this often
# asyncio's context message for an accept that failed for lack of descriptors or memory
# (selector_events._accept_connection); the listener is paused 1 s and tried again
_ACCEPT_MESSAGE = "socket.accept() out of system resource"


def raise_descriptor_limit() -> tuple[int, int]:
    """Soft RLIMIT_NOFILE up to the hard one; (soft before, soft now).  An unlimited hard
    limit cannot be a soft one (the kernel caps descriptors at fs.nr_open): left as it is."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard and hard != resource.RLIM_INFINITY:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as error:
            logger.warning("descriptors: the soft limit stays %d (hard %d): %s",
                           soft, hard, error)
            return soft, soft
    now = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    logger.info("descriptors: soft limit %d (was %d), hard limit %d", now, soft, hard)
    return soft, now


def read_start_error(directory: Path, pid: int) -> str | None:
    """What the server ``pid`` wrote to START_ERROR_FILE in ``directory`` before it exited
    because it could not listen; None when it wrote nothing."""
    try:
        said = json.loads((directory / START_ERROR_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(said, dict) or said.get("pid") != pid:
        return None
    return str(said.get("error") or "") or None


def address_in_use(key: str, address: str, error: OSError) -> str | None:
    """``serve.http 127.0.0.1:8000: address already in use`` for a bind that failed because
    the address is taken or not this host's; None for any other error."""
    if error.errno == errno.EADDRINUSE:
        return f"{key} {address}: address already in use"
    if error.errno == errno.EADDRNOTAVAIL:
        return f"{key} {address}: not an address of this host"
    return None


class AcceptErrors:
    """The event loop's exception handler for failed accepts: a count per listener and one
    line per ``interval_s`` naming it; every other context goes to asyncio's default.

    ``listeners`` maps a bound address (``host:port``) to the config key that asked for it,
    filled in as the front ends start."""

    def __init__(self, interval_s: float = ACCEPT_LOG_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self.listeners: dict[str, str] = {}
        self.totals: dict[str, int] = {}  # listener -> failed accepts so far
        self._pending: dict[str, tuple[int, str]] = {}  # listener -> (count, last error)
        self._logged_at: dict[str, float] = {}
        self._clock = clock

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.set_exception_handler(self.handle)

    def handle(self, loop: asyncio.AbstractEventLoop, context: Mapping[str, Any]) -> None:
        if context.get("message") != _ACCEPT_MESSAGE:
            loop.default_exception_handler(dict(context))
            return
        name = self._listener(context.get("socket"))
        self.totals[name] = self.totals.get(name, 0) + 1
        count, _ = self._pending.get(name, (0, ""))
        error = context.get("exception")
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        self._pending[name] = (count + 1, reason)
        now = self._clock()
        last = self._logged_at.get(name)
        if last is None or now - last >= self.interval_s:
            self._flush(name)
        elif count == 0:  # the first since the last line: its summary at the interval's end
            loop.call_later(self.interval_s - (now - last), self._flush, name)

    def _flush(self, name: str) -> None:
        count, reason = self._pending.pop(name, (0, ""))
        if not count:
            return
        self._logged_at[name] = self._clock()
        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        logger.error("%s: %d connection(s) not accepted in the last %.0f s: %s (descriptor "
                     "limit %d)", name, count, self.interval_s, reason, limit)

    def _listener(self, sock: Any) -> str:
        try:
            host, port = sock.getsockname()[:2]
        except (AttributeError, OSError, TypeError, ValueError):
            return "a listener"
        address = f"{host}:{port}"
        key = self.listeners.get(address)
        return f"{key} {address}" if key else address
