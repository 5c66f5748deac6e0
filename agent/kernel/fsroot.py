"""One root-relative filesystem layer for every hardware read and write.

Production passes ``/``; tests and ``--root DIR`` pass a fixture tree.  Paths given to a
:class:`Root` are always absolute *logical* paths (``/sys/class/thermal``); symlinks are
resolved inside the root, so an absolute link target such as ``/proc/device-tree ->
/sys/firmware/devicetree/base`` lands in the fixture, never on the host.  Writes are refused
unless the logical path matches an allowlisted pattern and its resolved target stays in a
writable kernel tree.
"""

from __future__ import annotations

import errno
import fnmatch
import glob as host_glob
import os
import re
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from agent.kernel import cgroup_model, fixture_kernel
from agent.kernel.allowlist import WRITABLE_PATTERNS, WRITABLE_TREES

_MAX_SYMLINK_HOPS = 40


class RootError(OSError):
    """A path was refused by the filesystem layer (escape, write not allowed, link loop)."""

    def __str__(self) -> str:
        return str(self.strerror)


class PathEscapesRoot(RootError):
    """A ``..`` component or a symlink would leave the root directory."""


class WriteRefused(RootError):
    """A write outside the allowlist of tuning knobs."""


def _components(path: str) -> list[str]:
    if not path.startswith("/"):
        raise RootError(errno.EINVAL, f"{path}: paths inside the root must be absolute")
    return [part for part in path.split("/") if part not in ("", ".")]


def _pattern_regex(patterns: Iterable[str]) -> re.Pattern[str]:
    """One regex for all patterns: ``*`` stays within a component, ``**/`` spans any number."""
    alternatives = []
    for pattern in patterns:
        parts = []
        for part in _components(pattern):
            if part == "**":
                parts.append("(?:[^/]+/)*")
            else:
                parts.append(fnmatch.translate(part).removeprefix("(?s:").removesuffix(
                    ")\\Z").replace(".*", "[^/]*") + "/")
        alternatives.append("/" + "".join(parts)[:-1])
    return re.compile("(?:" + "|".join(alternatives) + ")\\Z" if alternatives else "(?!)")


def _link_target(host_path: str) -> str | None:
    try:
        return os.readlink(host_path)
    except OSError:
        return None


def _within(path: str, tree: str) -> bool:
    return path == tree or path.startswith(tree + "/")


class Root:
    """Reads and writes kernel interfaces relative to a root directory."""

    def __init__(self, base: str | os.PathLike[str] = "/",
                 writable: Iterable[str] = WRITABLE_PATTERNS) -> None:
        resolved = Path(base).resolve()
        if not resolved.is_dir():
            raise FileNotFoundError(errno.ENOENT, "root directory does not exist", str(base))
        self.base = resolved
        self.is_host = resolved == Path("/")
        self.writable = tuple(writable)
        self._writable_parts = [_components(p) for p in self.writable]
        self._writable_regex = _pattern_regex(self.writable)
        self._cache = threading.local()  # .links: this thread's cached_links block, or None

    def __repr__(self) -> str:
        return f"Root({str(self.base)!r})"

    # -- path resolution -------------------------------------------------------------

    def _host(self, logical: str) -> str:
        return logical if self.is_host else str(self.base) + logical

    @contextmanager
    def cached_links(self) -> Iterator[None]:
        """Within the block, the calling thread reads each symbolic link once: one plan
        resolves some 1,800 paths through the same few directories (a readlink per
        component each), and links do not change under one plan or apply.  Another thread,
        and any read after the block, sees the tree as it is; nested blocks share the
        outermost one's cache."""
        if getattr(self._cache, "links", None) is not None:
            yield
            return
        self._cache.links = {}
        try:
            yield
        finally:
            self._cache.links = None

    def _memo(self, key: str, work: Callable[[str], str | None], argument: str) -> str | None:
        """``work(argument)``, once per cached_links block for ``key``."""
        links: dict[str, str | None] | None = getattr(self._cache, "links", None)
        if links is None:
            return work(argument)
        if key not in links:
            links[key] = work(argument)
        return links[key]

    def _realpath(self, path: str) -> str:
        return self._memo("real:" + path, os.path.realpath, path) or path

    def _readlink(self, host_path: str) -> str | None:
        """The link's target; None for anything that is not a link (or is missing)."""
        return self._memo(host_path, _link_target, host_path)

    def resolve(self, path: str, follow_last: bool = True) -> str:
        """Return the logical path with every symlink resolved inside the root.

        Absolute link targets restart from the root; ``..`` above the root is refused.
        Missing components are kept as they are, so opening the result fails naturally.
        """
        links: dict[str, str | None] | None = getattr(self._cache, "links", None)
        if links is None:
            return self._resolve(path, follow_last)
        key = f"resolve:{follow_last:d}:{path}"
        if key not in links:
            links[key] = self._resolve_by_parent(path, follow_last)
        return links[key] or path

    def _resolve_by_parent(self, path: str, follow_last: bool) -> str:
        """Within cached_links: the parent directory through the cache, then the last name
        (walked in full only when it is itself a link, or ``..``)."""
        parts = _components(path)
        if self.is_host or len(parts) < 2 or parts[-1] == "..":
            return self._resolve(path, follow_last)
        parent = self.resolve("/" + "/".join(parts[:-1]))
        joined = ("" if parent == "/" else parent) + "/" + parts[-1]
        if follow_last and self._readlink(self._host(joined)) is not None:
            return self._resolve(joined, True)
        return joined

    def _resolve(self, path: str, follow_last: bool) -> str:
        if self.is_host:
            parts = _components(path)  # validates; the host root cannot be escaped
            if follow_last:
                return self._realpath("/" + "/".join(parts))
            parent = self._realpath("/" + "/".join(parts[:-1]))
            return os.path.join(parent, parts[-1]) if parts else "/"
        pending = deque(_components(path))
        resolved: list[str] = []
        hops = 0
        while pending:
            name = pending.popleft()
            if name in ("", "."):
                continue
            if name == "..":
                if not resolved:
                    raise PathEscapesRoot(errno.EACCES, f"{path}: leaves the root {self.base}")
                resolved.pop()
                continue
            resolved.append(name)
            if not pending and not follow_last:
                break
            target = self._readlink(self._host("/" + "/".join(resolved)))
            if target is None:
                continue  # not a symlink, or missing: keep the name as it is
            hops += 1
            if hops > _MAX_SYMLINK_HOPS:
                raise RootError(errno.ELOOP, f"{path}: too many levels of symbolic links")
            resolved.pop()
            if target.startswith("/"):
                resolved = []
            pending.extendleft(reversed(target.split("/")))
        return "/" + "/".join(resolved)

    def host_path(self, path: str) -> str:
        """The host path of a logical path after resolving it inside the root.

        On the host root the kernel resolves links itself, so the path is used as it is.
        """
        if self.is_host:
            _components(path)  # validates
            return path
        return self._host(self.resolve(path))

    # -- reads -----------------------------------------------------------------------

    def read_bytes(self, path: str) -> bytes:
        with open(self.host_path(path), "rb") as handle:
            return handle.read()

    def read_text(self, path: str) -> str:
        return self.read_bytes(path).decode("utf-8", errors="replace")

    def exists(self, path: str) -> bool:
        try:
            return os.path.exists(self.host_path(path))
        except RootError:
            return False

    def is_dir(self, path: str) -> bool:
        try:
            return os.path.isdir(self.host_path(path))
        except RootError:
            return False

    def listdir(self, path: str) -> list[str]:
        """Sorted entry names of a directory; raises OSError like ``os.listdir``."""
        return sorted(os.listdir(self.host_path(path)))

    def readlink(self, path: str) -> str:
        """The raw target of a symlink, as the kernel wrote it."""
        return os.readlink(self._host(self.resolve(path, follow_last=False)))

    def realpath(self, path: str) -> str:
        """The logical path with all symlinks resolved (``realpath`` inside the root)."""
        return self.resolve(path)

    def glob(self, pattern: str) -> list[str]:
        """Sorted logical paths matching a pattern whose components may contain wildcards."""
        if self.is_host:
            return sorted(host_glob.glob(pattern))
        matches = [""]
        for part in _components(pattern):
            expanded: list[str] = []
            for prefix in matches:
                if not _has_wildcard(part):
                    expanded.append(f"{prefix}/{part}")
                    continue
                try:
                    names = self.listdir(prefix or "/")
                except OSError:
                    continue
                expanded.extend(f"{prefix}/{n}" for n in names if fnmatch.fnmatchcase(n, part))
            matches = expanded
        return sorted(m for m in matches if self.exists(m))

    # -- writes ----------------------------------------------------------------------

    def check_writable(self, path: str) -> str:
        """Return the resolved logical path if writing ``path`` is allowed, else raise."""
        if ".." in path.split("/"):
            raise WriteRefused(errno.EPERM, f"{path}: '..' is not allowed in a write path")
        parts = _components(path)
        if not self._writable_regex.match("/" + "/".join(parts)):
            raise WriteRefused(errno.EPERM, self._refusal(path, parts))
        target = self.resolve(path)
        if not any(_within(target, tree) for tree in WRITABLE_TREES):
            raise WriteRefused(
                errno.EPERM, f"{path}: resolves to {target}, outside the writable kernel trees "
                f"{', '.join(WRITABLE_TREES)}")
        return target

    def _refusal(self, path: str, parts: list[str]) -> str:
        near = [p for p, pp in zip(self.writable, self._writable_parts, strict=True)
                if pp[:2] == parts[:2]]
        allowed = near or sorted({"/" + "/".join(pp[:2]) + "/…" for pp in self._writable_parts})
        return f"{path}: not a writable tuning path (allowed: {', '.join(allowed)})"

    def write_text(self, path: str, value: str) -> None:
        """Write ``value`` in a single write(2), as sysfs, cgroup.procs and procfs expect.

        Below a fixture root the write behaves like the kernel's attribute (see
        ``agent.kernel.fixture_kernel``), so a rollback restores the file byte for byte.
        """
        logical = self.check_writable(path)
        target = self._host(logical)
        if not self.is_host:
            fixture_kernel.write(self.base, path, logical, Path(target), value,
                                 self._fixture_text)
            return
        data = value.encode()
        fd = os.open(target, os.O_WRONLY)
        try:
            written = os.write(fd, data)
        finally:
            os.close(fd)
        if written != len(data):
            raise OSError(errno.EIO, f"{path}: short write ({written} of {len(data)} bytes)")

    def _fixture_text(self, path: str) -> str | None:
        """A sibling file's text for the write emulation (a governor, the command line)."""
        try:
            return self.read_text(path)
        except OSError:
            return None

    def mkdir(self, path: str) -> bool:
        """Create a cgroup directory (cgroupfs fills it in; below a fixture root the cgroup
        v2 model does); False when it already exists."""
        target = self._cgroup_dir(path)
        try:
            if self.is_host or not cgroup_model.is_cgroup_dir(Path(target).parent):
                os.mkdir(target)
            else:
                cgroup_model.make(Path(target))
        except FileExistsError:
            return False
        return True

    def rmdir(self, path: str) -> None:
        """Remove an empty cgroup directory (EBUSY while it holds processes)."""
        target = self._cgroup_dir(path)
        if self.is_host or not cgroup_model.is_cgroup_dir(Path(target)):
            os.rmdir(target)
        else:
            cgroup_model.remove(Path(target))

    def _cgroup_dir(self, path: str) -> str:
        """Only cgroup directories are created or removed: where ``cgroup.procs`` may be
        written."""
        self.check_writable(f"{path.rstrip('/')}/cgroup.procs")
        return self._host(self.resolve(path.rstrip("/")))


def _has_wildcard(part: str) -> bool:
    return any(ch in part for ch in "*?[")
