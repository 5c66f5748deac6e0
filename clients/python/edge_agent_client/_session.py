"""One thread's session: a sealed shared memory region and the connection that handed it to
the server.

The region is a memfd sealed against shrinking and growing: the server maps it only with
that seal, since a region that could shrink under its mapping would crash it.  The
descriptor stays open here for the session's life, so that a reconnect hands the server the
SAME memory and every view already given out stays valid.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import socket
from typing import Any

import numpy as np

from edge_agent_client import _wire
from edge_agent_client.errors import (
    DeadlineExceeded,
    PermissionDenied,
    ServerError,
    ServerGone,
    from_reply,
)

CONNECT_TIMEOUT_S = 5.0


class Region:
    """``size`` bytes of anonymous shared memory, sealed, mapped here read/write."""

    def __init__(self, size: int) -> None:
        self.fd = os.memfd_create("edge-agent-client", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS,
                        fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            self.memory = mmap.mmap(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise
        self.size = size
        self.bytes = np.frombuffer(self.memory, np.uint8)
        self.address = int(self.bytes.ctypes.data)

    def offset_of(self, array: np.ndarray) -> int | None:
        """Where ``array`` lies in the region, if it is a contiguous view of it."""
        start = int(array.__array_interface__["data"][0])
        if not array.flags.c_contiguous or not self.address <= start <= start + array.nbytes \
                <= self.address + self.size:
            return None
        return start - self.address

    def view(self, datatype: str, shape: Any, offset: int) -> np.ndarray:
        array: np.ndarray = np.ndarray(tuple(shape), np.dtype(_wire.DATATYPES[datatype]),
                                       buffer=self.memory, offset=offset)
        return array

    def close(self) -> None:
        """The descriptor now; the mapping once no view of it is left (numpy's arrays keep
        it alive, so a view handed out never points at unmapped memory)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Connection:
    """The socket of one session; every wait on it is bounded."""

    def __init__(self, path: str, region: Region, token: str | None) -> None:
        self.path = path
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self.socket.settimeout(CONNECT_TIMEOUT_S)
        try:
            self.socket.connect(path)
        except PermissionError:
            self.close()
            raise PermissionDenied(f"{path}: permission denied: the data plane's socket is "
                                   "for root and the group of its serve.local.group "
                                   "(edge-agent by default); add this user to that group") \
                from None
        except OSError as error:
            self.close()
            raise ServerGone(f"{path}: no data plane listens there ({error.strerror}); is "
                             "edge-agent running with serve.local on?") from None
        hello: dict[str, Any] = {"op": "hello", "protocol": _wire.PROTOCOL}
        if token is not None:
            hello["token"] = token
        try:
            # refused at once (too many sessions): the reply says why
            with contextlib.suppress(OSError):
                socket.send_fds(self.socket, [_wire.encode(hello)], [region.fd])
            self.hello = self.receive(CONNECT_TIMEOUT_S)
        except BaseException:
            self.close()
            raise

    def call(self, message: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Send ``message`` and return the reply; ServerGone if the connection broke,
        DeadlineExceeded if no reply came within ``timeout_s``; the reply's error raised."""
        try:
            self.socket.sendall(_wire.encode(message))
        except OSError as error:
            raise ServerGone(f"{self.path}: the data plane went away "
                             f"({error.strerror})") from None
        return self.receive(timeout_s)

    def receive(self, timeout_s: float) -> dict[str, Any]:
        self.socket.settimeout(timeout_s)
        try:
            data = self.socket.recv(_wire.MAX_MESSAGE)
        except socket.timeout:
            raise DeadlineExceeded(f"no answer within {timeout_s:g} s",
                                   answered=False) from None
        except OSError as error:
            raise ServerGone(f"{self.path}: the data plane went away "
                             f"({error.strerror})") from None
        if not data:
            raise ServerGone(f"{self.path}: the data plane closed the session")
        try:
            reply = _wire.decode(data)
        except ValueError as error:
            raise ServerError(f"the server's reply is not JSON: {error}", "INTERNAL",
                              answered=False) from None
        if "error" in reply:
            raise from_reply(reply["error"])
        return reply

    def close(self) -> None:
        self.socket.close()
