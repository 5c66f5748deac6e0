"""The HTTP front end's socket: aiohttp's request handling behind a listener that bounds what
connections can hold.

aiohttp bounds none of it: it accepts every connection the descriptor table allows (1,100
idle ones filled a table of 1024, and every client of the data plane timed out, gRPC and
metrics too), it has no timeout for a request's head (a slowloris sending a byte a second
held its connection for as long as it liked), and after a refused body it reads on for ten
seconds (its lingering close), inflating a gzip bomb on the event loop.  Here:

- at most ``max_connections`` at once (by default a quarter of the descriptor limit, so the
  other front ends, the models and the repository keep the rest).  A connection beyond it
  takes the place of the one idle the longest, so a flood of idle or slow connections never
  locks a new client out; only when every connection is in a request is the new one
  answered 503 and closed, without a byte of it read;
- a request's head must be whole within ``header_timeout_s`` of its first byte, and a
  connection waits at most ``idle_timeout_s`` for its next request; a sweep every
  ``SWEEP_S`` closes those past their time (aiohttp's own keep-alive timer does not see a
  head that is still arriving);
- no lingering and no decompression: http_api refuses compressed bodies, and a body it
  refuses or leaves unread closes its connection at once.

The requests themselves are timed by http_api (``ConnectionLimits.transfer_s``): a body
and a response each get ``header_timeout_s`` plus their size at MIN_RATE, so a client that
trickles either loses its connection rather than holding it and its budget.
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import ssl
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

SWEEP_S = 0.5
MIN_RATE = 1 << 20  # bytes a second: a body or a response slower than this is cut off
# a connection's share of the descriptor table: HTTP takes a quarter of it by default
CONNECTIONS_PER_DESCRIPTOR = 4
MIN_CONNECTIONS, MAX_CONNECTIONS = 16, 16384


def default_max_connections() -> int:
    """A quarter of this process's descriptor limit (256 under systemd's soft 1024)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    return max(MIN_CONNECTIONS, min(soft // CONNECTIONS_PER_DESCRIPTOR, MAX_CONNECTIONS))


@dataclass(frozen=True)
class ConnectionLimits:
    """What one connection may hold: the listener's cap and its timeouts (see the module)."""

    max_connections: int | None = None  # None: default_max_connections() at start
    header_timeout_s: float = 5.0
    idle_timeout_s: float = 5.0

    def transfer_s(self, nbytes: int) -> float:
        """The time a body or a response of ``nbytes`` may take to cross the socket."""
        return self.header_timeout_s + nbytes / MIN_RATE


class Connection(RequestHandler):
    """aiohttp's handler of one connection, with the state the listener's sweep reads:
    ``since`` is when it became idle, or when the head now arriving began."""

    def __init__(self, listener: HttpListener, manager: Any, **options: Any) -> None:
        super().__init__(manager, **options)
        self._listener = listener
        self.since = time.monotonic()
        self.in_request = False
        self.reading_head = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self._listener.holds(self):  # evicted or swept before it was made
            transport.close()
            return
        self.since = time.monotonic()
        super().connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not (self.in_request or self.reading_head):
            self.reading_head = True
            self._listener.touched(self)
        super().data_received(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._listener.forget(self)
        super().connection_lost(exc)

    def request_started(self) -> None:
        """http_api's middleware has the request: its head is whole."""
        self.in_request, self.reading_head = True, False
        self._listener.busy(self)

    def request_done(self) -> None:
        """Its response is written (or the connection is gone): idle from now."""
        self.in_request = False
        self._listener.touched(self)


@contextlib.contextmanager
def in_request(request: web.BaseRequest) -> Iterator[None]:
    """A request's connection is busy while its handler runs (and its response is
    written): neither evicted at the cap nor swept as idle meanwhile."""
    connection = request.protocol if isinstance(request.protocol, Connection) else None
    if connection is not None:
        connection.request_started()
    try:
        yield
    finally:
        if connection is not None:
            connection.request_done()


class _Refused(asyncio.Protocol):
    """A connection beyond the cap while every connection is in a request: a 503 and
    closed, its request never read."""

    def __init__(self, limit: int) -> None:
        body = (b'{"error":"too many connections: the HTTP front end holds its limit of '
                + str(limit).encode() + b', every one in a request; try again"}')
        self._answer = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json"
                        b"\r\nConnection: close\r\nContent-Length: "
                        + str(len(body)).encode() + b"\r\n\r\n" + body)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        transport.write(self._answer)
        transport.close()


class HttpListener:
    """An aiohttp application served on one address under ``ConnectionLimits``."""

    def __init__(self, app: web.Application, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.max_connections = limits.max_connections or default_max_connections()
        self.runner = web.AppRunner(app, handle_signals=False)
        self.refused = 0  # connections answered 503 at the cap
        self.evicted = 0  # idle ones closed to let a new one in
        self._open: set[Connection] = set()
        self._idle: OrderedDict[Connection, None] = OrderedDict()  # oldest first
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._options: dict[str, Any] = {}

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None
                    ) -> int:
        """Listen; the bound port (0 takes a free one)."""
        await self.runner.setup()
        loop = asyncio.get_running_loop()
        self._options = {"loop": loop, "access_log": None, "lingering_time": 0,
                         "auto_decompress": False,
                         "keepalive_timeout": self.limits.idle_timeout_s}
        self._server = await loop.create_server(
            self._accept, host, port, ssl=ssl_context, reuse_address=True,
            ssl_handshake_timeout=self.limits.header_timeout_s if ssl_context else None)
        self._sweeper = loop.create_task(self._sweep())
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def addresses(self) -> list[Any]:
        """Where it listens, as its sockets name themselves (getsockname)."""
        return [sock.getsockname() for sock in self._server.sockets] if self._server else []

    @property
    def open_connections(self) -> int:
        return len(self._open)

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._server is not None:
            self._server.close()
        await self.runner.cleanup()

    def _accept(self) -> asyncio.BaseProtocol:
        if len(self._open) >= self.max_connections and not self._evict():
            self.refused += 1
            return _Refused(self.max_connections)
        connection = Connection(self, self.runner.server, **self._options)
        self._open.add(connection)
        self._idle[connection] = None
        return connection

    def _evict(self) -> bool:
        """Close the connection idle the longest to make room; False when all are busy."""
        if not self._idle:
            return False
        oldest, _ = self._idle.popitem(last=False)
        self._open.discard(oldest)
        oldest.force_close()
        self.evicted += 1
        return True

    def touched(self, connection: Connection) -> None:
        """Idle again, or a new head began: timed from now, the newest to evict."""
        connection.since = time.monotonic()
        if connection in self._open:
            self._idle[connection] = None
            self._idle.move_to_end(connection)

    def holds(self, connection: Connection) -> bool:
        return connection in self._open

    def busy(self, connection: Connection) -> None:
        self._idle.pop(connection, None)

    def forget(self, connection: Connection) -> None:
        self._open.discard(connection)
        self._idle.pop(connection, None)

    async def _sweep(self) -> None:
        limits = self.limits
        while True:
            await asyncio.sleep(SWEEP_S)
            now = time.monotonic()
            for connection in list(self._idle):
                limit = (limits.header_timeout_s if connection.reading_head
                         else limits.idle_timeout_s)
                if now - connection.since > limit:
                    self.forget(connection)
                    connection.force_close()
