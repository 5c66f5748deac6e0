"""An HTTP request's body, read as the data plane can afford it: refused before a byte is read
when it is compressed (415) or says it is too big (413), admitted against the memory budget
before it is read (503 when it does not fit), and read within its time.

Compressed bodies (any Content-Encoding but identity) are refused on every route that reads
a body, not only inference: inflating is work and memory that a few compressed bytes
command (a 1 MB gzip body inflates to 1 GiB, and aiohttp inflated it on the event loop, so
the front end stopped answering), no Triton client compresses unless asked, and the other
routes' bodies are a few bytes of JSON that gain nothing from it.  One rule for every route
is also one fewer thing for a client to learn.  The listener turns aiohttp's decompression
off (http_listener), so a refused body is never inflated, not even in part.

A body with Content-Length is reserved whole before it is read and read into one buffer of
that size, which decoding views rather than copies (aiohttp's ``read`` joins its chunks and
then copies them); a chunked one is reserved chunk by chunk as it arrives.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from agent.serving.budget import Reservation
from agent.serving.errors import ServeError, invalid
from agent.serving.http_listener import ConnectionLimits


def compression_refused(request: web.Request) -> ServeError | None:
    """415 for a compressed body (see the module)."""
    encoding = request.headers.get("Content-Encoding", "identity").strip()
    if encoding.lower() in ("", "identity"):
        return None
    return ServeError("INVALID_ARGUMENT", f"request body in Content-Encoding "
                      f"{encoding[:40]!r}: this server takes bodies uncompressed only; send "
                      "it again without Content-Encoding", http_status=415)


def too_big(length: int | None, limit: int) -> ServeError | None:
    """413 for a body that says it is above ``limit`` (serve.max_request_mb)."""
    if length is None or length <= limit:
        return None
    return ServeError("RESOURCE_EXHAUSTED", f"request body of {length} bytes is above the "
                      f"limit of {limit} (serve.max_request_mb)")


async def read_body(request: web.Request, limit: int, reservation: Reservation,
                    limits: ConnectionLimits) -> bytearray:
    """The whole body, refused before a byte is read when it is compressed, too big or
    beyond the budget; a body not all there within ``limits.transfer_s`` of its size loses
    its connection."""
    refusal = compression_refused(request) or too_big(request.content_length, limit)
    if refusal is not None:
        raise refusal
    length = request.content_length
    reservation.grow(length or 0, "the request body")
    transport = request.transport
    deadline = None if transport is None else asyncio.get_running_loop().call_later(
        limits.transfer_s(limit if length is None else length), transport.abort)
    try:
        if length is None:
            return await _chunked(request.content, limit, reservation)
        return await _exactly(request.content, length)
    except (HttpProcessingError, web.RequestPayloadError) as error:
        # a chunked body not in its framing: the cause says how
        cause = error.__cause__ if isinstance(error, web.RequestPayloadError) else error
        detail = cause.message if isinstance(cause, HttpProcessingError) else str(error)
        raise invalid(f"request body unreadable ({detail.strip()})") from None
    except ConnectionError:
        raise invalid("request body cut short") from None
    finally:
        if deadline is not None:
            deadline.cancel()


async def _chunked(content: Any, limit: int, reservation: Reservation) -> bytearray:
    """A body without Content-Length, admitted chunk by chunk as it arrives."""
    body = bytearray()
    while chunk := await content.readany():
        if len(body) + len(chunk) > limit:
            raise ServeError("RESOURCE_EXHAUSTED", f"request body is above the limit of "
                             f"{limit} bytes (serve.max_request_mb)")
        reservation.grow(len(chunk), "the request body")
        body += chunk
    return body


async def _exactly(content: Any, length: int) -> bytearray:
    """``length`` bytes of ``content`` into one buffer of that size, a copy of each chunk
    as it arrives and none of the whole."""
    body = bytearray(length)
    view = memoryview(body)
    got = 0
    while got < length:
        chunk = await content.readany()
        if not chunk:
            break
        view[got:got + len(chunk)] = chunk
        got += len(chunk)
    view.release()
    if got != length:
        raise invalid("request body cut short")
    return body
