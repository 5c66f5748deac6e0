"""The HTTP front end served for a test: its own event loop in a background thread, a free
loopback port, and raw requests to it that fail the test rather than hang."""

from __future__ import annotations

import asyncio
import concurrent.futures
import http.client
import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from agent.serving.access import Access
from agent.serving.core import Models
from agent.serving.http_api import make_app
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
    """``make_app`` over ``models`` on 127.0.0.1 at a free port, until ``stop``."""

    def __init__(self, models: Models, access: Access, max_request_bytes: int = 1 << 20,
                 regions: SharedMemoryRegions | None = None) -> None:
        self.models = models
        self.executor = concurrent.futures.ThreadPoolExecutor(2)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        app = make_app(models, access, max_request_bytes=max_request_bytes,
                       executor=self.executor, regions=regions)
        self.runner = web.AppRunner(app)
        self._call(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self._call(site.start())
        host, port = self.runner.addresses[0][:2]
        self.host, self.port = host, port
        self.url = f"{host}:{port}"

    def _call(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(TIMEOUT_S)

    def stop(self) -> None:
        self._call(self.runner.cleanup())
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
    return path
