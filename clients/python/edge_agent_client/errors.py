"""The exceptions a call raises: each carries the server's status code (``.code``, the
names gRPC uses) and its message."""

from __future__ import annotations


class ServerError(Exception):
    """A call the data plane refused or failed (or that could not reach it)."""

    code = "UNKNOWN"

    def __init__(self, message: str, code: str | None = None, *,
                 answered: bool = True, needed: int | None = None) -> None:
        """``answered``: the server said so (False: the client found it, as a timeout or a
        broken connection); ``needed``: the bytes outputs need, on RESOURCE_EXHAUSTED."""
        super().__init__(message)
        self.message = message
        self.answered = answered
        self.needed = needed
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


class InvalidArgument(ServerError):
    """The request is wrong: an input's name, shape or type, an offset, a region."""

    code = "INVALID_ARGUMENT"


class NotFound(ServerError):
    """No such model or version."""

    code = "NOT_FOUND"


class PermissionDenied(ServerError):
    """The socket or the priority asked for is not this caller's."""

    code = "PERMISSION_DENIED"


class ResourceExhausted(ServerError):
    """Busy: too many sessions, the memory budget, a full queue; try again."""

    code = "RESOURCE_EXHAUSTED"


class DeadlineExceeded(ServerError):
    """No answer within the call's timeout (on the server's queue or on the way back)."""

    code = "DEADLINE_EXCEEDED"


class Unavailable(ServerError):
    """The model is not ready, or the server is not there."""

    code = "UNAVAILABLE"


class ServerGone(Unavailable):
    """No data plane at the socket, or it went away and did not come back at once."""

    def __init__(self, message: str) -> None:
        super().__init__(message, answered=False)


_BY_CODE: dict[str, type[ServerError]] = {
    cls.code: cls for cls in (InvalidArgument, NotFound, PermissionDenied, ResourceExhausted,
                              DeadlineExceeded, Unavailable)}


def from_reply(error: dict[str, object]) -> ServerError:
    """The exception for a reply's ``{"error": {"code", "message"}}``."""
    code = str(error.get("code", "UNKNOWN"))
    needed = error.get("needed")
    return _BY_CODE.get(code, ServerError)(str(error.get("message", "")), code,
                                           needed=needed if isinstance(needed, int) else None)
