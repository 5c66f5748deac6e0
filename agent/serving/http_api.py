"""The Open Inference Protocol (KServe v2) over HTTP, as Triton's clients speak it: health,
metadata, config, statistics, the model-repository and system-shared-memory extensions and
inference with the binary tensor extension, in front of ``Models``.

One middleware answers for every route: the bearer token first (load and unload and
registering or unregistering shared memory always need it, everything else only on a
non-loopback listener), then the handler; a ``ServeError``
becomes ``{"error": …}`` with its status, aiohttp's own refusals (404, 405, 413) the same
shape, and anything else is a bug: logged and answered 500, never left to hang a client.
Decoding, inference and encoding run in ``executor`` together, so a large body or a slow
model never stalls the loop that answers health probes.

Each request holds a reservation on the data plane's memory budget from its head to its
last byte sent: its body before a byte of it is read (http_body, which also refuses
compressed bodies on every route, 415, and says why), then what decoding and encoding make
(http_codec); one that does not fit is refused 503 at once, and the reservation is given
back once the response is written, whatever the outcome.  A body refused or left unread
(413, 415, 503, a refusal before the body was needed) closes its connection at once
(``Connection: close``, no lingering read: see http_listener).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import Any, TypeVar

from aiohttp import web

from agent.serving import http_codec as codec
from agent.serving.access import Access, bearer
from agent.serving.budget import MemoryBudget, Reservation, default_limit_bytes
from agent.serving.core import Models
from agent.serving.errors import ServeError, invalid
from agent.serving.http_body import compression_refused, read_body, too_big
from agent.serving.http_listener import ConnectionLimits, in_request
from agent.serving.json_body import loads
from agent.serving.levers import parse_change
from agent.serving.shm import (
    DEFAULT_PREFIX,
    CallerRegions,
    SharedMemoryRegions,
    bounded_regions,
)

log = logging.getLogger(__name__)

# the routes that always need the token
CONTROL_ROUTES = frozenset({"load", "unload", "levers", "shm_register", "shm_unregister",
                            "shm_unregister_one"})
# the budget reservation of the request this task answers (aiohttp runs each in a task)
_RESERVATION: ContextVar[Reservation] = ContextVar("reservation")
_T = TypeVar("_T")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_response(status: int, message: str) -> web.Response:
    return web.Response(status=status, body=codec.dumps({"error": message}),
                        content_type="application/json")


def json_response(document: Any) -> web.Response:
    return web.Response(body=codec.dumps(document), content_type="application/json")


def _version(request: web.Request) -> str:
    return request.match_info.get("version", "")


class _Api:
    """The handlers, over one ``Models``; each returns a response or raises ServeError."""

    def __init__(self, models: Models, access: Access, max_request_bytes: int,
                 executor: concurrent.futures.Executor, regions: SharedMemoryRegions,
                 budget: MemoryBudget, limits: ConnectionLimits) -> None:
        self.budget = budget
        self.models = models
        self.regions = regions
        self.access = access
        self.max_request_bytes = max_request_bytes
        self.executor = executor
        self.limits = limits

    async def _blocking(self, call: Callable[..., _T], *args: Any) -> _T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, call, *args)

    async def _body(self, request: web.Request) -> bytearray:
        return await read_body(request, self.max_request_bytes, _RESERVATION.get(),
                               self.limits)

    async def expect(self, request: web.Request) -> web.StreamResponse | None:
        """``Expect: 100-continue`` answered here rather than by aiohttp's default, which
        runs outside the middleware and fails (500) on a header that is not UTF-8; a body
        that is compressed, too big or beyond the budget now is refused before the client
        sends it (the budget is held from the middleware on, when the body comes)."""
        if request.headers.get("Expect", "").lower() != "100-continue":
            return error_response(417, "only Expect: 100-continue is understood")
        refusal = (compression_refused(request)
                   or too_big(request.content_length, self.max_request_bytes))
        if refusal is None:
            try:
                self.budget.reserve(request.content_length or 0, "the request body").release()
            except ServeError as error:
                refusal = error
        if refusal is not None:
            response = error_response(refusal.http_status, refusal.message)
            response.force_close()
            return response
        if request.version >= (1, 1):
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0
        return None

    @web.middleware
    async def guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """The request's connection marked busy and its reservation held until its
        response is written (see the module)."""
        reservation = Reservation(self.budget)
        _RESERVATION.set(reservation)
        with in_request(request), reservation:
            response = await self._answer(request, handler)
            if not request.content.is_eof():  # refused before its body was read
                response.force_close()
            await self._send(request, response)
            return response

    async def _answer(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Token check, then the handler, every outcome a JSON answer (see the module)."""
        try:
            route = request.match_info.route.name
            self.access.check(bearer(request.headers.get("Authorization")),
                              control=route in CONTROL_ROUTES)
            return await handler(request)
        except ServeError as error:
            return error_response(error.http_status, error.message)
        except web.HTTPException as error:
            if error.status < 400:
                raise
            return error_response(error.status, error.reason)
        except Exception:
            log.exception("HTTP %s %s failed", request.method, request.path)
            return error_response(500, "internal error")

    async def _send(self, request: web.Request, response: web.StreamResponse) -> None:
        """Written here, so that the reservation lasts until it is; a client that does not
        take it within its time (ConnectionLimits.transfer_s) loses its connection."""
        transport = request.transport
        if transport is None:
            return
        deadline = asyncio.get_running_loop().call_later(
            self.limits.transfer_s(response.content_length or 0), transport.abort)
        try:
            await response.prepare(request)
            await response.write_eof()
        except ConnectionError:
            pass  # gone, or cut off: nobody to answer
        finally:
            deadline.cancel()

    async def live(self, request: web.Request) -> web.StreamResponse:
        return web.Response(status=200 if self.models.live() else 503)

    async def ready(self, request: web.Request) -> web.StreamResponse:
        return web.Response(status=200 if self.models.ready() else 503)

    async def server_metadata(self, request: web.Request) -> web.StreamResponse:
        return json_response(self.models.server_metadata())

    async def model_metadata(self, request: web.Request) -> web.StreamResponse:
        meta = self.models.model_metadata(request.match_info["model"], _version(request))
        return json_response(codec.metadata_json(meta))

    async def model_ready(self, request: web.Request) -> web.StreamResponse:
        """200 ready, 400 known but not ready (Triton's answer; the protocol's "4xx is
        false"), 404 for a model the repository does not hold."""
        ready = self.models.model_ready(request.match_info["model"], _version(request))
        return web.Response(status=200 if ready else 400)

    async def model_config(self, request: web.Request) -> web.StreamResponse:
        name, version = request.match_info["model"], _version(request)
        if version:
            self.models.model_ready(name, version)  # NOT_FOUND for a version it lacks
        return json_response(codec.config_json(self.models.model_config(name)))

    async def statistics(self, request: web.Request) -> web.StreamResponse:
        stats = self.models.statistics(request.match_info.get("model", ""), _version(request))
        return json_response({"model_stats": stats})

    def _infer(self, model: str, version: str, body: bytearray, header: str | None,
               authorization: str | None, reservation: Reservation
               ) -> tuple[bytes, int | None]:
        token = bearer(authorization)
        regions = CallerRegions(self.regions, lambda: self.access.check(token, control=True))
        decoded = codec.decode_infer(model, version, body,
                                     codec.header_length(header, len(body)), regions=regions,
                                     reservation=reservation,
                                     trusted=token is not None and self.access.holds(token),
                                     check=functools.partial(self.models.check_elements,
                                                             model, version))
        return codec.encode_infer(self.models.infer(decoded.request), decoded, reservation)

    async def infer(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        payload, head = await self._blocking(
            self._infer, request.match_info["model"], _version(request), body,
            request.headers.get(codec.HEADER_LENGTH), request.headers.get("Authorization"),
            _RESERVATION.get())
        del body  # not held while the response is written
        if head is None:
            return web.Response(body=payload, content_type="application/json")
        return web.Response(body=payload, content_type="application/octet-stream",
                            headers={codec.HEADER_LENGTH: str(head)})

    async def index(self, request: web.Request) -> web.StreamResponse:
        document = codec.optional_object(await self._body(request), "the index request",
                                          _RESERVATION.get())
        ready = document.get("ready", False)
        if not isinstance(ready, bool):
            raise invalid("ready must be true or false")
        return json_response(codec.index_json(self.models.index(ready)))

    async def _control(self, request: web.Request, call: Callable[..., None]) -> web.Response:
        document = codec.optional_object(await self._body(request), "the request",
                                          _RESERVATION.get())
        params = codec.parameters(document.get("parameters"), "parameters")
        await self._blocking(call, request.match_info["model"], params)
        return web.Response(status=200)

    async def load(self, request: web.Request) -> web.StreamResponse:
        return await self._control(request, self.models.load)

    async def unload(self, request: web.Request) -> web.StreamResponse:
        return await self._control(request, self.models.unload)

    async def levers(self, request: web.Request) -> web.StreamResponse:
        """The control plane's QoS controller moving a model's levers (token only): the
        instant ones, ``cpus`` and ``realtime`` as now served; ``rebuilding``: a threads
        rebuild started, which the statistics show once it swapped (rebuild.py)."""
        change = parse_change(loads(await self._body(request), "the levers request",
                                    _RESERVATION.get()))
        return json_response({"versions": self.models.set_levers(request.match_info["model"],
                                                                 change),
                              "rebuilding": change.rebuilds})

    async def shm_status(self, request: web.Request) -> web.StreamResponse:
        return json_response(self.regions.status(request.match_info.get("region", "")))

    async def shm_register(self, request: web.Request) -> web.StreamResponse:
        document = loads(await self._body(request), "the register request",
                         _RESERVATION.get())
        if not isinstance(document, dict):
            raise invalid("the register request must be a JSON object")
        key, offset, size = (document.get("key"), document.get("offset", 0),
                             document.get("byte_size"))
        if not isinstance(key, str):
            raise invalid("key must be a string")
        for what, value in (("offset", offset), ("byte_size", size)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise invalid(f"{what} must be an integer")
        owner = self.access.owner(bearer(request.headers.get("Authorization")))
        await self._blocking(self.regions.register, request.match_info["region"], key,
                             offset, size, owner)
        return web.Response(status=200)

    async def shm_unregister(self, request: web.Request) -> web.StreamResponse:
        self.regions.unregister(request.match_info.get("region", ""))
        return web.Response(status=200)


def make_app(models: Models, access: Access, *, max_request_bytes: int,
             executor: concurrent.futures.Executor,
             regions: SharedMemoryRegions | None = None,
             budget: MemoryBudget | None = None,
             limits: ConnectionLimits | None = None) -> web.Application:
    """The application to serve (with ``http_listener.HttpListener``, given the same
    ``limits``); bodies above ``max_request_bytes`` are refused with 413.  Without
    ``regions`` (the data plane shares one with gRPC) the app keeps its own, under the
    default prefix, closed at cleanup; without ``budget`` (shared with gRPC too) one of its
    own, sized for no device."""
    api = _Api(models, access, max_request_bytes, executor,
               regions if regions is not None
               else bounded_regions(DEFAULT_PREFIX, max_request_bytes),
               budget or MemoryBudget(default_limit_bytes(None, max_request_bytes)),
               limits or ConnectionLimits())
    app = web.Application(client_max_size=max_request_bytes, middlewares=[api.guard])
    if regions is None:
        async def close_regions(app: web.Application) -> None:
            api.regions.close()
        app.on_cleanup.append(close_regions)

    def route(method: str, path: str, handler: Handler, name: str | None = None) -> None:
        resource = app.router.add_resource(path, name=name)
        resource.add_route(method, handler, expect_handler=api.expect)
        if method == "GET":
            resource.add_route("HEAD", handler, expect_handler=api.expect)
        if method != "*":  # any other: 405 through our middleware, not aiohttp's fallback
            resource.add_route("*", _wrong_method(method), expect_handler=api.expect)

    model, version = "/v2/models/{model}", "/v2/models/{model}/versions/{version}"
    route("GET", "/v2/health/live", api.live)
    route("GET", "/v2/health/ready", api.ready)
    route("GET", "/v2", api.server_metadata)
    route("GET", "/v2/models/stats", api.statistics)  # before {model} would take it
    for prefix in (model, version):
        route("GET", prefix, api.model_metadata)
        route("GET", prefix + "/ready", api.model_ready)
        route("GET", prefix + "/config", api.model_config)
        route("GET", prefix + "/stats", api.statistics)
        route("POST", prefix + "/infer", api.infer)
    route("POST", "/v2/repository/index", api.index)
    route("POST", "/v2/repository/models/{model}/load", api.load, name="load")
    route("POST", "/v2/repository/models/{model}/unload", api.unload, name="unload")
    route("POST", "/v2/repository/models/{model}/levers", api.levers, name="levers")
    shm, region = "/v2/systemsharedmemory", "/v2/systemsharedmemory/region/{region}"
    route("GET", shm + "/status", api.shm_status)
    route("GET", region + "/status", api.shm_status)
    route("POST", region + "/register", api.shm_register, name="shm_register")
    route("POST", shm + "/unregister", api.shm_unregister, name="shm_unregister")
    route("POST", region + "/unregister", api.shm_unregister, name="shm_unregister_one")
    route("*", "/{path:.*}", _no_route)
    return app


def _wrong_method(allowed: str) -> Handler:
    async def refuse(request: web.Request) -> web.StreamResponse:
        raise web.HTTPMethodNotAllowed(request.method, [allowed])
    return refuse


async def _no_route(request: web.Request) -> web.StreamResponse:
    raise web.HTTPNotFound()
