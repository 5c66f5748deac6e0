"""Boot-loader files below ``<root>/boot`` (and other confined config files): written atomically.

Boot files are not kernel knobs, so they stay out of :class:`agent.kernel.fsroot.Root`'s sysfs
allowlist and its single-write(2) semantics: a boot config must be replaced whole (temp file,
fsync, rename, fsync of the directory) so a power cut leaves the old file or the new one,
never half of one.  Paths are resolved with ``Root.resolve`` (links followed inside the
root, ``..`` above it refused) and must still lie below ``/boot`` afterwards.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from collections.abc import Callable

from agent.kernel.fsroot import PathEscapesRoot, Root, WriteRefused
from agent.kernel.regular import read_regular

BOOT = "/boot"


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Make a rename or unlink in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ConfinedFiles:
    """Reads and atomically replaces the files of a root that ``allowed`` admits, before and
    after resolving links inside the root, and nothing else."""

    def __init__(self, root: Root, allowed: Callable[[str], bool], what: str) -> None:
        self.root = root
        self._allowed = allowed
        self._what = what  # "/boot", for the refusals

    def host_path(self, path: str) -> str:
        """The host path of an admitted logical path; refused if it leaves the admitted set."""
        if ".." in path.split("/") or not self._allowed(path):
            raise WriteRefused(errno.EPERM, f"{path}: edge-agent writes nothing outside "
                               f"{self._what}")
        resolved = self.root.resolve(path)
        if not self._allowed(resolved):
            where = os.path.join(self.root.base, path.lstrip("/"))
            try:  # the link as an operator sees it with ls -l, when the file itself is one
                why = f"a link to {os.readlink(where)}"
            except OSError:  # a directory above it is the link
                why = f"resolves to {self.root.host_path(resolved)}"
            raise PathEscapesRoot(errno.EACCES, f"{where}: {why}, which leaves "
                                  f"{self._what}")
        return self.root.host_path(resolved)

    def read(self, path: str) -> bytes | None:
        """The file's bytes, or None when it does not exist."""
        try:
            return read_regular(self.host_path(path))  # a FIFO there must not hang it
        except FileNotFoundError:
            return None

    def write(self, path: str, data: bytes) -> bool:
        """Replace the file atomically; False (and nothing written) when it already holds it."""
        if self.read(path) == data:
            return False
        target = self.host_path(path)
        directory = os.path.dirname(target)
        os.makedirs(directory, exist_ok=True)
        try:
            mode = stat.S_IMODE(os.stat(target).st_mode)
        except FileNotFoundError:
            mode = 0o644
        fd, temp = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.",
                                    suffix=".edge-agent-tmp", dir=directory)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.chmod(temp, mode)
            os.replace(temp, target)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
            raise
        fsync_dir(directory)
        return True

    def remove(self, path: str) -> bool:
        """Delete the file; False when it was not there."""
        target = self.host_path(path)
        try:
            os.unlink(target)
        except FileNotFoundError:
            return False
        fsync_dir(os.path.dirname(target))
        return True


class BootFiles(ConfinedFiles):
    """Files below ``/boot`` of a root, and nothing else."""

    def __init__(self, root: Root) -> None:
        super().__init__(root, lambda path: path.startswith(BOOT + "/"), BOOT)
