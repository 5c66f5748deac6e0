"""The one error a request can end in, and how each front end spells it.

The registry and the codecs raise ``ServeError`` with a gRPC status name; HTTP maps the same
name to its status code, so both front ends answer a fault alike and nothing else reaches
a client (any other exception is a bug, answered 500 / ``INTERNAL`` and logged).
"""

from __future__ import annotations

HTTP_STATUS = {
    "INVALID_ARGUMENT": 400,
    # a shared memory region name registered twice: 400, as Triton answers it (after
    # INVALID_ARGUMENT, so that an HTTP client reads a 400 as that)
    "ALREADY_EXISTS": 400,
    "UNAUTHENTICATED": 401,
    "PERMISSION_DENIED": 403,
    "NOT_FOUND": 404,
    # a load whose new version failed its canary (the old one serves): 409, so that an HTTP
    # client tells it from a bad request
    "FAILED_PRECONDITION": 409,
    "RESOURCE_EXHAUSTED": 413,  # a body above serve.max_request_mb
    "INTERNAL": 500,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
}


class ServeError(Exception):
    """A request refused or failed, with the gRPC status name (``HTTP_STATUS`` keys)."""

    def __init__(self, code: str, message: str, http_status: int | None = None) -> None:
        """``http_status``: where HTTP spells this refusal apart from the code's usual one
        (the memory budget's RESOURCE_EXHAUSTED is a 503, busy, not a 413, too big)."""
        if code not in HTTP_STATUS:
            raise ValueError(f"unknown status {code}")
        super().__init__(message)
        self.code = code
        self.message = message
        self.http_status = HTTP_STATUS[code] if http_status is None else http_status


def invalid(message: str) -> ServeError:
    return ServeError("INVALID_ARGUMENT", message)


def not_found(message: str) -> ServeError:
    return ServeError("NOT_FOUND", message)


def unavailable(message: str) -> ServeError:
    return ServeError("UNAVAILABLE", message)
