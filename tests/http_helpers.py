"""The HTTP front end served for a test: its own event loop in a background thread, a free
loopback port, and raw requests to it that fail the test rather than hang."""

from __future__ import annotations

import asyncio
import concurrent.futures
import http.client
import json
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.serving.access import Access
from agent.serving.budget import MemoryBudget
from agent.serving.core import Models
from agent.serving.http_api import make_app
from agent.serving.http_listener import ConnectionLimits, HttpListener
from agent.serving.shm import SharedMemoryRegions

TIMEOUT_S = 10.0


@dataclass
class Reply:
    status: int
    headers: http.client.HTTPMessage
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class HttpServer:
    """``make_app`` over ``models`` on 127.0.0.1 at a free port, until ``stop``, served as
    the data plane serves it (``HttpListener``)."""

    def __init__(self, models: Models, access: Access, max_request_bytes: int = 1 << 20,
                 regions: SharedMemoryRegions | None = None,
                 budget: MemoryBudget | None = None,
                 limits: ConnectionLimits | None = None) -> None:
        self.models = models
        self.executor = concurrent.futures.ThreadPoolExecutor(2)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.budget = budget or MemoryBudget(1 << 30)
        limits = limits or ConnectionLimits()
        app = make_app(models, access, max_request_bytes=max_request_bytes,
                       executor=self.executor, regions=regions, budget=self.budget,
                       limits=limits)
        self.listener = HttpListener(app, limits)
        self.host = "127.0.0.1"
        self.port = self._call(self.listener.start(self.host, 0))
        self.url = f"{self.host}:{self.port}"

    def _call(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(TIMEOUT_S)

    def stop(self) -> None:
        self._call(self.listener.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(TIMEOUT_S)
        assert not self.thread.is_alive()
        self.loop.close()
        self.executor.shutdown(wait=True)

    def request(self, method: str, path: str, body: bytes | str | None = None,
                headers: dict[str, str | bytes] | None = None) -> Reply:
        """One request on a fresh connection; a socket timeout fails the caller."""
        connection = http.client.HTTPConnection(self.host, self.port, timeout=TIMEOUT_S)
        try:
            connection.request(method, path, body=body, headers=headers or {})
            response = connection.getresponse()
            return Reply(response.status, response.headers, response.read())
        finally:
            connection.close()


def token_file(directory: Path, token: str = "s3cret-token") -> Path:
    path = directory / "token"
    path.write_text(token + "\n")
    path.chmod(0o600)  # the data plane refuses a token other users may read
    return path


def exchange(host: str, port: int, data: bytes, timeout: float = TIMEOUT_S) -> tuple[bytes, bool]:
    """``data`` sent on a fresh connection, then everything the server answers until it
    closes the connection: (the bytes, whether it closed it within ``timeout``).  A server
    that closes with the rest of a body unread resets the connection: what came before the
    reset is the answer."""
    received = b""
    with socket.create_connection((host, port), timeout=timeout) as sock:
        try:
            sock.sendall(data)
            while chunk := sock.recv(65536):
                received += chunk
        except (ConnectionResetError, BrokenPipeError):
            pass
        except TimeoutError:
            return received, False
    return received, True


def status_of_raw(answer: bytes) -> tuple[int, dict[str, str], bytes]:
    """The status, headers (lower-case names) and body of a raw HTTP/1.1 answer."""
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(lines[0].split()[1]), headers, body
