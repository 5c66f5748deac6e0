"""Reading a file that a person, a fleet command or another process may have replaced with
a FIFO, a directory or a device.  open(2) on a FIFO blocks until a writer comes: a FIFO in
place of a model's config.yaml hung the fleet's command worker and every data plane that
scanned the repository.  So the file is opened without blocking and read only when it is a
regular file; anything else is an OSError whose strerror says what it is instead."""

from __future__ import annotations

import errno
import os
import stat


def kind(mode: int) -> str:
    """What a file that is not regular is, in words (``st_mode``)."""
    return ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "a device" if
            stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")


def read_regular(path: str | os.PathLike[str]) -> bytes:
    """The bytes of the regular file ``path`` (links followed); never blocks on a FIFO."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, f"is {kind(mode)}, not a file", os.fspath(path))
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)
