"""One session of the local front end: a client's connection, its shared region, and the
thread that answers its requests one after another.

The region comes as a descriptor over SCM_RIGHTS (never a name: a client can only hand over
memory it holds) and is mapped, so that ONNX Runtime reads the inputs in place and the
outputs are written straight into it.  A mapping is what shm.py avoids for Triton's regions,
because a client that shrinks its object makes the next access SIGBUS the whole data plane;
here a region is taken only with the F_SEAL_SHRINK seal (a memfd made with
MFD_ALLOW_SEALING), which the kernel keeps for the life of the memory, so no client can make
a mapped page vanish.  Anything else (a regular file, a pipe, a socket, an unsealed memfd)
is refused with a message saying how to make a region that is taken.

A request is handled inline on the session's thread (decode, ``Models.infer``, write the
outputs, reply): the client waits for its answer anyway, and a hand-off would cost two more
wakeups.  The thread is an inference thread (the profile's scheduling).  One bad message
costs that message an error reply; only a closed or broken connection ends the session,
which then closes its mapping and descriptor.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import socket
import stat
from dataclasses import dataclass
from typing import Any

import numpy as np

from agent.serving import local_wire as wire
from agent.serving.access import Access
from agent.serving.budget import MemoryBudget
from agent.serving.core import InferRequest, Models, OutputRequest, Tensor
from agent.serving.errors import ServeError, invalid

logger = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 5.0  # a connection that says nothing holds a session slot no longer
HOW = ("make the region with os.memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING), "
       "ftruncate it, then fcntl F_ADD_SEALS F_SEAL_SHRINK | F_SEAL_GROW (edge_agent_client "
       "does this)")


@dataclass(frozen=True)
class Peer:
    """Who is on the other end (SO_PEERCRED, taken at connect)."""

    pid: int
    uid: int
    gid: int


def peer_of(connection: socket.socket) -> Peer:
    raw = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
    pid, uid, gid = np.frombuffer(raw, dtype=np.int32)
    return Peer(int(pid), int(uid), int(gid))


class Region:
    """A client's sealed shared memory, mapped read/write."""

    def __init__(self, fd: int, max_bytes: int) -> None:
        """Takes ``fd`` (closed here, whatever happens); INVALID_ARGUMENT for anything that
        is not a shrink-sealed memory object within ``max_bytes``."""
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise invalid(f"the descriptor is not shared memory: {HOW}")
            try:
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            except OSError:
                raise invalid(f"the descriptor cannot be sealed, so it could shrink under "
                              f"the server: {HOW}") from None
            if not seals & fcntl.F_SEAL_SHRINK:
                raise invalid(f"the region is not sealed against shrinking: {HOW}")
            if not 0 < info.st_size <= max_bytes:
                raise invalid(f"the region holds {info.st_size} bytes; allowed: 1.."
                              f"{max_bytes} (serve.local.max_region_mb)")
            try:
                self.memory = mmap.mmap(fd, info.st_size, mmap.MAP_SHARED,
                                        mmap.PROT_READ | mmap.PROT_WRITE)
            except OSError as error:
                raise invalid(f"the region cannot be mapped read/write ({error.strerror}): "
                              "it must not carry F_SEAL_WRITE") from None
            self.size = info.st_size
        finally:
            os.close(fd)  # the mapping keeps the memory (and a descriptor of its own)

    def close(self) -> None:
        """Unmapped once no array of a request still in a queue points into it."""
        with contextlib.suppress(BufferError):
            self.memory.close()  # else it goes with the last such array


class Session:
    """One connection's requests; ``run`` returns when the client goes or ``end`` is called."""

    def __init__(self, connection: socket.socket, peer: Peer, models: Models, access: Access,
                 budget: MemoryBudget, max_region_bytes: int) -> None:
        self.connection = connection
        self.peer = peer
        self.models = models
        self.access = access
        self.budget = budget
        self.max_region_bytes = max_region_bytes
        self.region: Region | None = None
        self.trusted = False

    def run(self) -> None:
        self.connection.settimeout(HELLO_TIMEOUT_S)
        try:
            while True:
                try:
                    data, fds, flags, _ = socket.recv_fds(self.connection, wire.MAX_MESSAGE,
                                                          wire.MAX_FDS, socket.MSG_CMSG_CLOEXEC)
                except TimeoutError:
                    return  # no hello in time
                if not data and not fds:
                    return  # the client closed its end (or died)
                reply = self._answer(data, fds, flags)
                self.connection.sendall(reply)
                if self.region is not None:
                    self.connection.settimeout(None)  # a session may idle between frames
        except OSError:
            return  # a client gone mid-request: its reply has nowhere to go
        finally:
            self.end()

    def end(self) -> None:
        """Close the connection and the region (from any thread: it wakes ``run``)."""
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)
        if self.region is not None:
            self.region.close()

    def _answer(self, data: bytes, fds: list[int], flags: int) -> bytes:
        """The reply to one message; a refusal is the reply, never an exception."""
        try:
            if flags & socket.MSG_TRUNC:
                raise invalid(f"a message is at most {wire.MAX_MESSAGE} bytes")
            message = wire.decode(data)
            op = message["op"]
            if op == "hello":
                return self._hello(message, self._one_descriptor(fds, flags))
            self._one_descriptor(fds, flags, wanted=False)
            if op == "metadata":
                return wire.metadata_reply(self.models.model_metadata(
                    _text(message, "model"), _text(message, "version")))
            if op == "infer":
                return self._infer(wire.infer_call(message))
            raise invalid(f"op {op!r} is not one of hello, infer, metadata")
        except ServeError as error:
            return wire.error_reply(error)
        except Exception:
            logger.exception("local session of pid %d failed", self.peer.pid)
            return wire.error_reply(ServeError("INTERNAL", "the request failed inside the "
                                               "server (a bug: the agent's log has the details)"))
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)

    @staticmethod
    def _one_descriptor(fds: list[int], flags: int, wanted: bool = True) -> int:
        """The message's one descriptor (taken out of ``fds``: the caller owns it now);
        INVALID_ARGUMENT for none, several, one cut off, or one where none belongs."""
        if flags & socket.MSG_CTRUNC or len(fds) > 1:
            raise invalid("a hello carries exactly one descriptor (the region)")
        if not wanted:
            if fds:
                raise invalid("only a hello carries a descriptor")
            return -1
        if not fds:
            raise invalid(f"a hello carries the region's descriptor (SCM_RIGHTS): {HOW}")
        return fds.pop()

    def _hello(self, message: dict[str, Any], fd: int) -> bytes:
        """A new region for this session (a second hello replaces the first)."""
        if message.get("protocol", wire.PROTOCOL) != wire.PROTOCOL:
            os.close(fd)
            raise invalid(f"protocol {message.get('protocol')!r}: this server speaks "
                          f"{wire.PROTOCOL}")
        token = message.get("token")
        region = Region(fd, self.max_region_bytes)
        if self.region is not None:
            self.region.close()
        self.region = region
        self.trusted = isinstance(token, str) and self.access.holds(token)
        return wire.encode({"size": region.size, "trusted": self.trusted,
                            "protocol": wire.PROTOCOL})

    def _infer(self, call: wire.InferCall) -> bytes:
        region = self.region
        if region is None:
            raise invalid("no region yet: send hello with its descriptor first")
        wire.check_placement(call.area[0], call.area[1], 1, region.size, "the output area")
        arrays = [wire.view(region.memory, region.size, placed, f"input {placed.name}")
                  for placed in call.inputs]
        parameters: dict[str, Any] = {}
        if call.priority:
            parameters["priority"] = call.priority
        if call.timeout_us:
            parameters["timeout"] = call.timeout_us
        request = InferRequest(call.model, call.version,
                               tuple(Tensor(p.name, a) for p, a in zip(call.inputs, arrays,
                                                                       strict=True)),
                               tuple(OutputRequest(name) for name in call.outputs),
                               parameters=parameters, trusted=self.trusted)
        # inputs are read in place; a batch joins them into one copy, and the outputs exist
        # until they are written into the region
        with self.budget.reserve(sum(a.nbytes for a in arrays), "the request's inputs") \
                as reservation:
            result = self.models.infer(request)
            reservation.count(sum(t.array.nbytes for t in result.outputs))
            placed, needed = wire.place_outputs(result.outputs, call.area)
            if needed > call.area[1]:
                raise wire.OutputsTooLarge(needed, call.area[1])
            for where, tensor in zip(placed, result.outputs, strict=True):
                target = np.ndarray(tensor.array.shape, tensor.array.dtype,
                                    buffer=region.memory, offset=where.offset)
                np.copyto(target, tensor.array)
        return wire.encode({"model_version": result.version,
                            "outputs": [p.to_list() for p in placed]})


def _text(message: dict[str, Any], key: str) -> str:
    value = message.get(key, "")
    if not isinstance(value, str) or len(value) > wire.MAX_NAME:
        raise invalid(f"{key}: a string of at most {wire.MAX_NAME} characters")
    return value
