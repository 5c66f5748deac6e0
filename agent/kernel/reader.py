"""Tolerant reads over a :class:`~agent.kernel.fsroot.Root` that turn failures into warnings.

Discovery must never raise on a board nobody has fixtures for: a missing file is normal
(no ``scaling_available_frequencies`` under intel_pstate, no /proc/pressure without
CONFIG_PSI, no nv_tegra_release in a container) and silently yields ``None``; an unreadable
file (EACCES on debugfs, EBUSY on an inactive cpufreq policy, EINVAL from a powered-down
sensor) or a value that does not parse yields ``None`` plus a warning naming the path and
the reason.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from typing import TypeVar

from agent.kernel import parsers
from agent.kernel.fsroot import Root, RootError

T = TypeVar("T")

_MISSING = (errno.ENOENT, errno.ENOTDIR)


class SysReader:
    """Reads kernel files relative to a root and collects warnings about what failed."""

    def __init__(self, root: Root, max_warnings: int = 200) -> None:
        self.root = root
        self.warnings: list[str] = []
        self.max_warnings = max_warnings  # telemetry reads for weeks: keep the list bounded
        self.suppressed = 0

    def warn(self, message: str) -> None:
        if message in self.warnings:
            return
        if len(self.warnings) < self.max_warnings:
            self.warnings.append(message)
        else:
            self.suppressed += 1

    def _failed(self, path: str, error: OSError) -> None:
        if isinstance(error, RootError):
            self.warn(str(error))
        elif error.errno in (errno.EACCES, errno.EPERM):
            self.warn(f"{path}: permission denied (needs root, or debugfs is locked down)")
        elif error.errno not in _MISSING:
            name = errno.errorcode.get(error.errno or 0, "error")
            self.warn(f"{path}: unreadable ({name}: {os.strerror(error.errno or 0)})")

    def raw(self, path: str, tolerate: tuple[int, ...] = ()) -> bytes | None:
        """File bytes, or None; errnos in ``tolerate`` are expected states, not warnings."""
        try:
            return self.root.read_bytes(path)
        except OSError as error:
            if error.errno not in tolerate:
                self._failed(path, error)
            return None

    def text(self, path: str, tolerate: tuple[int, ...] = ()) -> str | None:
        """File content without the trailing newline/padding, or None."""
        data = self.raw(path, tolerate)
        return None if data is None else data.decode("utf-8", errors="replace").strip()

    def parsed(self, path: str, parser: Callable[[str], T],
               tolerate: tuple[int, ...] = ()) -> T | None:
        """Apply a pure parser; garbage becomes None and a warning quoting the value."""
        content = self.text(path, tolerate)
        if content is None:
            return None
        try:
            return parser(content)
        except ValueError as error:
            self.warn(f"{path}: {error}")
            return None

    def integer(self, path: str, tolerate: tuple[int, ...] = ()) -> int | None:
        return self.parsed(path, parsers.parse_int, tolerate)

    def integers(self, path: str) -> list[int] | None:
        return self.parsed(path, parsers.parse_int_list)

    def words(self, path: str) -> list[str] | None:
        content = self.text(path)
        return None if content is None else content.split()

    def cpulist(self, path: str) -> list[int] | None:
        return self.parsed(path, parsers.parse_cpulist)

    def dt_strings(self, path: str) -> list[str] | None:
        data = self.raw(path)
        return None if data is None else parsers.parse_dt_strings(data)

    def listdir(self, path: str) -> list[str]:
        """Entries of a directory; a missing directory is an empty list."""
        try:
            return self.root.listdir(path)
        except OSError as error:
            self._failed(path, error)
            return []

    def glob(self, pattern: str) -> list[str]:
        return self.root.glob(pattern)

    def exists(self, path: str) -> bool:
        return self.root.exists(path)

    def link_name(self, path: str) -> str | None:
        """Basename of a symlink's target (e.g. the driver bound to a device), or None."""
        try:
            return os.path.basename(self.root.readlink(path))
        except OSError as error:
            self._failed(path, error)
            return None

    def driver(self, device: str) -> str | None:
        """Name of the kernel driver bound to a sysfs device directory, or None if unbound."""
        link = f"{device}/driver"
        return self.link_name(link) if self.root.exists(link) else None

    def realpath(self, path: str) -> str | None:
        """Resolved logical path if it exists, else None."""
        try:
            resolved = self.root.realpath(path)
        except OSError as error:
            self._failed(path, error)
            return None
        return resolved if self.root.exists(resolved) else None

    def of_node_name(self, device: str) -> str | None:
        """The device-tree node name of a device, without its ``@unit`` address.

        Uses the ``name`` property when the kernel still exposes it, else the node's
        directory name (newer kernels dropped the property).
        """
        names = self.dt_strings(f"{device}/of_node/name")
        if names:
            return names[0]
        node = self.realpath(f"{device}/of_node")
        return os.path.basename(node).split("@")[0] if node else None
