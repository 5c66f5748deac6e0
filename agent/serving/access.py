"""Who may call what: the bearer token of ``serve.token_file``.

The data plane runs as root, so a local user must not swap its models: repository load and
unload need the token even on loopback, and on any other address every call needs it (and
TLS, which the config check insists on).  The file is looked at on each check (read again
whenever its inode, size or times change), so a rotated token works at once; a missing file
admits nobody to what needs it.
"""

from __future__ import annotations

import errno
import hmac
import ipaddress
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from agent.serving.errors import ServeError

MAX_TOKEN_BYTES = 4096


def is_loopback(host: str) -> bool:
    """Whether a listen address only takes local connections (``localhost`` counts)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bearer(header: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` value."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


# a token any local user may read, or a group may rewrite, is nobody's secret: refused, as ssh
# refuses a private key open to others
OPEN_TO_OTHERS = stat.S_IROTH | stat.S_IWOTH | stat.S_IWGRP


def read_token(path: Path) -> bytes:
    """The token in ``path``, stripped (a token over MAX_TOKEN_BYTES is nobody's); OSError
    when it cannot be read, is not a regular file or is open to other users.  O_NONBLOCK: a
    FIFO in its place must not hang the data plane (nor ``config check``, which reads it the
    same way)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as handle:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, "not a regular file")
        if mode & OPEN_TO_OTHERS:
            raise OSError(errno.EPERM, f"mode {stat.S_IMODE(mode):04o} lets other users read "
                          "or change it, so it proves nothing; chmod 0640 (root and the group "
                          "of its clients) or 0600")
        return handle.read(MAX_TOKEN_BYTES + 1).strip()


@dataclass(frozen=True)
class Access:
    """``token_files``: the configured file and any the supervisor adds for itself."""

    token_files: Sequence[Path]
    everything: bool  # a non-loopback listener: the token for every call
    # each file's token by its stat signature: a check costs a stat, not an open and read
    _read: dict[Path, tuple[tuple[int, ...], bytes]] = field(default_factory=dict,
                                                              compare=False, repr=False)

    def _holder(self, presented: str | None) -> Path | None:
        """The token file whose token is ``presented``."""
        if presented is None:
            return None
        given = presented.encode("utf-8", "surrogateescape")
        for path in self.token_files:
            token = self._token(path)
            if token and len(token) <= MAX_TOKEN_BYTES and hmac.compare_digest(given, token):
                return path
        return None

    def _token(self, path: Path) -> bytes:
        """The file's token, b"" when it cannot be read.  A file rewritten between the stat
        and the read is read again at the next check: its signature changed again."""
        try:
            info = path.stat()
            signature = (info.st_ino, info.st_dev, info.st_size, info.st_mtime_ns,
                         info.st_ctime_ns)
            known = self._read.get(path)
            if known is not None and known[0] == signature:
                return known[1]
            token = read_token(path)
        except OSError:
            self._read.pop(path, None)
            return b""
        self._read[path] = (signature, token)
        return token

    def holds(self, presented: str | None) -> bool:
        """Whether ``presented`` is a configured token (for what a token unlocks beyond
        the routes ``check`` guards: the privileged priority levels)."""
        return self._holder(presented) is not None

    def owner(self, presented: str | None) -> tuple[int, int] | None:
        """The uid and gid owning the token file whose token was presented (None: no token
        file holds it): who a token holder is, as far as the data plane can tell over TCP,
        where a caller has no uid (see ``shm.SharedMemoryRegions.register``)."""
        path = self._holder(presented)
        try:
            info = path.stat() if path is not None else None
        except OSError:
            return None
        return (info.st_uid, info.st_gid) if info is not None else None

    def check(self, presented: str | None, control: bool) -> None:
        """Raise UNAUTHENTICATED unless the call may go ahead (``control``: load/unload)."""
        if not (control or self.everything):
            return
        if presented is None:
            # no path: a caller without the token learns nothing of where it lives
            raise ServeError("UNAUTHENTICATED", "token required: this call needs the bearer "
                             "token of serve.token_file")
        if not self.holds(presented):
            raise ServeError("UNAUTHENTICATED", "the bearer token is not the one in "
                             "serve.token_file")
