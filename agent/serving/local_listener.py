"""The local front end's socket (``serve.local``): who may connect, how many sessions, and
a thread per session (local_session).

Why a message on an AF_UNIX SOCK_SEQPACKET socket is the doorbell, and not an eventfd or a
futex in the shared region: either way a request costs one wakeup each way, but the socket
also carries what a doorbell cannot: the region's descriptor (SCM_RIGHTS), the caller's
uid/gid (SO_PEERCRED) and, when a client dies, EOF, which ends its session and frees its
region at once.  A futex would need a thread per client waiting on it (or one polling every
region), and a dead client's futex says nothing.  Measured (Python on both ends, a 2-core
x86_64 VM): an empty message's round trip between two threads is about 11-12 us, a whole
metadata request's (JSON both ways, the registry's look-up) 45 us.

Access is the file's: the socket is mode 0660, group ``serve.local.group``, in a directory
anyone may enter, so root and that group connect and nobody else does (connect() needs
write permission on the socket).  A group that does not exist leaves it owner-only, with one
warning naming the key.  The socket is bound under a temporary name, given its mode and
group, then renamed into place, so that it is never reachable with looser permissions.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import logging
import os
import socket
import stat
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agent.serving import local_wire as wire
from agent.serving.access import Access
from agent.serving.budget import MemoryBudget
from agent.serving.core import Models
from agent.serving.errors import ServeError
from agent.serving.local_session import Peer, Session, peer_of

logger = logging.getLogger(__name__)

KEY = "serve.local.socket"
MAX_PATH = 107  # bytes of a socket path (sun_path, with its terminating NUL)
BACKLOG = 64
REFUSALS = 16  # refused connections told why at once; beyond, closed without a reason
REFUSAL_WAIT_S = 1.0


@dataclass(frozen=True)
class LocalSettings:
    socket: Path
    group: str = "edge-agent"
    max_sessions: int = 64
    max_region_bytes: int = 256 << 20


def default_socket(state_dir: Path) -> Path:
    """/run/edge-agent/infer.sock for root; a user's own runtime directory otherwise (the
    state directory when there is none), so a data plane run by a user still listens."""
    if os.geteuid() == 0:
        return Path("/run/edge-agent/infer.sock")
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return (Path(runtime) / "edge-agent" if runtime else state_dir / "serve") / "infer.sock"


class LocalListenError(Exception):
    """The socket cannot be made where the config says (the message names the key)."""


def _replace_stale(path: Path) -> None:
    """Remove a socket left by a server that died; LocalListenError for a live one (or
    anything that is not a socket)."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise LocalListenError(f"{KEY} {path}: something other than a socket is there; "
                               "remove it or choose another path")
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as probe:
        try:
            probe.connect(str(path))
        except OSError as error:
            if error.errno not in (errno.ECONNREFUSED, errno.ENOENT):
                raise LocalListenError(f"{KEY} {path}: cannot tell whether a server "
                                       f"listens there: {error.strerror}") from None
        else:
            raise LocalListenError(f"{KEY} {path}: another data plane listens there "
                                   "(address in use); stop it or choose another path")
    path.unlink(missing_ok=True)


def bind(path: Path, group: str) -> socket.socket:
    """The listening socket at ``path``, mode 0660 and group ``group`` (owner-only without
    that group); LocalListenError naming the key."""
    if len(os.fsencode(path)) > MAX_PATH:
        raise LocalListenError(f"{KEY} {path}: a socket path is at most {MAX_PATH} bytes")
    try:
        path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        _replace_stale(path)
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        partial.unlink(missing_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            listener.bind(str(partial))
            try:
                gid = grp.getgrnam(group).gr_gid
            except KeyError:
                os.chmod(partial, 0o600)
                logger.warning("%s: group %s does not exist (serve.local.group): only the "
                               "data plane's own user may connect", path, group)
            else:
                os.chown(partial, -1, gid)
                os.chmod(partial, 0o660)
            os.rename(partial, path)
            listener.listen(BACKLOG)
        except BaseException:
            listener.close()
            partial.unlink(missing_ok=True)
            raise
    except OSError as error:
        raise LocalListenError(f"{KEY} {path}: cannot listen there: "
                               f"{error.strerror or error}") from None
    return listener


class LocalListener:
    """The socket, its accept thread and one thread per session."""

    def __init__(self, settings: LocalSettings, models: Models, access: Access,
                 budget: MemoryBudget, thread_start: Callable[[], None]) -> None:
        self.settings = settings
        self.models = models
        self.access = access
        self.budget = budget
        self.thread_start = thread_start  # makes a session thread an inference thread
        self.sessions: dict[int, Session] = {}
        self.by_uid: Counter[int] = Counter()
        self.refused = 0
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._socket: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self._inode = 0
        self._numbers = iter(range(1 << 62))
        self._refusing = threading.BoundedSemaphore(REFUSALS)

    @property
    def path(self) -> Path:
        return self.settings.socket

    def start(self) -> None:
        """Listen (LocalListenError: where the config says cannot be had)."""
        self._socket = bind(self.settings.socket, self.settings.group)
        self._inode = self.settings.socket.lstat().st_ino
        self._acceptor = threading.Thread(target=self._accept, name="local-accept",
                                          daemon=True)
        self._acceptor.start()

    def _accept(self) -> None:
        assert self._socket is not None
        while not self._stopping.is_set():
            try:
                connection, _ = self._socket.accept()
            except OSError as error:
                if self._stopping.is_set():
                    return
                logger.warning("%s: accept failed: %s", self.path, error.strerror)
                self._stopping.wait(0.1)  # EMFILE and the like: let sessions end first
                continue
            if self._stopping.is_set():
                connection.close()
                return
            self._admit(connection)

    def _admit(self, connection: socket.socket) -> None:
        peer = peer_of(connection)
        problem = self._room_for(peer)
        if problem is not None:
            self.refused += 1
            if self._refusing.acquire(blocking=False):
                threading.Thread(target=self._refuse, args=(connection, problem),
                                 name="local-refuse", daemon=True).start()
            else:
                connection.close()  # a flood of floods: no reason given
            return
        number = next(self._numbers)
        session = Session(connection, peer, self.models, self.access, self.budget,
                          self.settings.max_region_bytes)
        with self._lock:
            self.sessions[number] = session
            self.by_uid[peer.uid] += 1
        thread = threading.Thread(target=self._serve, args=(number, session),
                                  name=f"infer-local_{number}", daemon=True)
        thread.start()

    def _refuse(self, connection: socket.socket, problem: str) -> None:
        """The client's hello read (closing a socket with a message unread would reset the
        connection, losing the reason), then the reason, then the connection closed."""
        try:
            connection.settimeout(REFUSAL_WAIT_S)
            with contextlib.suppress(OSError):
                _, fds, _, _ = socket.recv_fds(connection, wire.MAX_MESSAGE, wire.MAX_FDS)
                for fd in fds:
                    os.close(fd)
            with contextlib.suppress(OSError):
                connection.send(wire.error_reply(ServeError("RESOURCE_EXHAUSTED", problem)))
        finally:
            connection.close()
            self._refusing.release()

    def _room_for(self, peer: Peer) -> str | None:
        """Why ``peer`` gets no session now (None: it does).  One uid other than root may
        hold at most half of them, so that one local user cannot take every session."""
        limit = self.settings.max_sessions
        with self._lock:
            if len(self.sessions) >= limit:
                return (f"{limit} sessions are open (serve.local.max_sessions); close one "
                        "or try again later")
            if peer.uid not in (0, os.geteuid()) and self.by_uid[peer.uid] >= max(1, limit // 2):
                return (f"uid {peer.uid} holds {self.by_uid[peer.uid]} sessions, the most one "
                        f"user may hold (half of serve.local.max_sessions {limit})")
        return None

    def _serve(self, number: int, session: Session) -> None:
        try:
            self.thread_start()
            session.run()
        finally:
            with self._lock:
                self.sessions.pop(number, None)
                self.by_uid[session.peer.uid] -= 1
                if self.by_uid[session.peer.uid] <= 0:
                    del self.by_uid[session.peer.uid]

    def stop(self) -> None:
        """Stop accepting, end every session (its thread returns once its request is
        answered) and remove the socket."""
        self._stopping.set()
        if self._socket is None:
            return
        with contextlib.suppress(OSError), \
                socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as wake:
            wake.connect(str(self.path))  # accept() returns, and sees the flag
        if self._acceptor is not None:
            self._acceptor.join(5.0)
        with contextlib.suppress(OSError):
            if self.path.lstat().st_ino == self._inode:  # ours, not a successor's
                self.path.unlink()
        self._socket.close()
        with self._lock:
            sessions = list(self.sessions.values())
        for session in sessions:
            session.end()
