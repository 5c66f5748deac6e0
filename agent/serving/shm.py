"""Triton's system shared memory extension: the regions clients register, each a window of a
POSIX shared memory object under /dev/shm that requests read inputs from and write outputs to.

The data plane runs as root, so what it opens is fenced: a plain name (no "/", no "..") that
starts with ``serve.shm_prefix``, never through a symbolic link or a second hard link, only a
regular file, only within its size; registering and unregistering need the bearer token (the
front ends check it), so a local user cannot point the data plane at another process's memory.

A region is read and written with pread/pwrite on the object's descriptor rather than through a
mapping: a client that shrinks its object after registering would make a mapped access fault
(SIGBUS kills the whole process) where pread only comes back short.  An input is copied out
when the request is decoded, so the model sees one snapshot however the client writes on.  A
request holds the regions it resolved: unregistering takes the name away at once and closes
the descriptor when the last request using it is done, so no request ever reads through a
descriptor number the process has since reused.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from agent.serving.errors import ServeError, invalid, not_found

SHM_DIR = Path("/dev/shm")
DEFAULT_PREFIX = "edge-agent-"  # serve.shm_prefix's default
# The regions together may span this many times serve.max_request_mb: a client gains from
# shared memory with tensors larger than one body, and each request still copies at most what
# its regions hold.
BYTES_PER_REQUEST_BYTE = 16
MAX_REGIONS = 256
NAME_MAX = 255  # bytes of one file name
MAX_REGION_NAME = 1024
# O_NONBLOCK and O_NOCTTY: opening something that is no shared memory object must not block
# nor take a terminal before fstat refuses it.
_OPEN_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY


class Region:
    """One registered region: ``byte_size`` bytes from ``offset`` of the object ``key``."""

    def __init__(self, name: str, key: str, offset: int, byte_size: int, fd: int) -> None:
        self.name = name
        self.key = key
        self.offset = offset
        self.byte_size = byte_size
        self._fd = fd
        self._lock = threading.Lock()
        self._users = 0
        self._retired = False

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "key": self.key, "offset": self.offset,
                "byte_size": self.byte_size}

    @contextmanager
    def held(self) -> Iterator[int]:
        """The descriptor, kept open until the block ends even if the region is unregistered
        meanwhile; INVALID_ARGUMENT once it has been."""
        with self._lock:
            if self._retired:
                raise invalid(f"shared memory region {self.name!r} was unregistered while the "
                              "request ran")
            self._users += 1
        try:
            yield self._fd
        finally:
            with self._lock:
                self._users -= 1
                if self._retired and self._users == 0:
                    os.close(self._fd)

    def retire(self) -> None:
        """Unregistered: the descriptor closes now, or when the last request is done."""
        with self._lock:
            if self._retired:
                return
            self._retired = True
            if self._users == 0:
                os.close(self._fd)

    def read(self, start: int, size: int) -> bytes:
        """``size`` bytes from ``start`` within the region (bounds checked by the caller)."""
        with self.held() as fd:
            try:
                data = os.pread(fd, size, self.offset + start)
            except OSError as error:
                raise invalid(f"shared memory region {self.name!r}: {error.strerror}") from None
        if len(data) != size:
            raise invalid(f"shared memory region {self.name!r}: its object {self.key!r} shrank "
                          "below the region after it was registered")
        return data

    def write(self, start: int, data: bytes) -> None:
        with self.held() as fd:
            try:
                written = os.pwrite(fd, data, self.offset + start)
            except OSError as error:
                raise invalid(f"shared memory region {self.name!r}: {error.strerror}") from None
        if written != len(data):
            raise invalid(f"shared memory region {self.name!r}: only {written} of "
                          f"{len(data)} bytes written")


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class SharedMemoryRegions:
    """The regions of one data plane, by name; thread-safe.  ``max_bytes`` bounds the bytes
    all regions span together (and so what requests may copy from them); ``max_regions`` the
    descriptors they hold."""

    def __init__(self, prefix: str, *, max_bytes: int, max_regions: int = MAX_REGIONS) -> None:
        if not prefix or "/" in prefix:
            raise ValueError(f"shared memory prefix {prefix!r} must be a non-empty plain name")
        self.prefix = prefix
        self.max_bytes = max_bytes
        self.max_regions = max_regions
        self._regions: dict[str, Region] = {}
        self._lock = threading.Lock()

    def _object_name(self, key: str) -> str:
        """The file under /dev/shm that ``key`` names (one leading "/", as shm_open takes
        it), refused unless it is a plain name under the prefix."""
        shown = key[:300]
        name = key[1:] if key.startswith("/") else key
        if not name or "/" in name or ".." in name or "\0" in name or not _encodable(name):
            raise invalid(f"key {shown!r} must be a plain name (no '/', no '..') starting with "
                          f"serve.shm_prefix {self.prefix!r}")
        if len(name.encode("utf-8")) > NAME_MAX:
            raise invalid(f"key {shown!r} is longer than {NAME_MAX} bytes")
        if not name.startswith(self.prefix):
            raise ServeError("PERMISSION_DENIED", f"key {shown!r} is outside serve.shm_prefix "
                             f"{self.prefix!r}: the data plane opens no other objects")
        return name

    @staticmethod
    def _open(path: Path, key: str, offset: int, byte_size: int,
              owner: tuple[int, int]) -> int:
        """The object's descriptor, refused unless it is a regular file with one link that
        holds the whole region and that ``owner`` may use (see ``register``)."""
        try:
            fd = os.open(path, _OPEN_FLAGS)
        except FileNotFoundError:
            raise not_found(f"key {key!r}: no shared memory object {path}") from None
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise ServeError("PERMISSION_DENIED", f"key {key!r}: {path} is a symbolic "
                                 "link, which the data plane does not follow") from None
            raise invalid(f"key {key!r}: cannot open {path} ({error.strerror})") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise invalid(f"key {key!r}: {path} is not a regular file")
            if info.st_nlink != 1:
                raise ServeError("PERMISSION_DENIED", f"key {key!r}: {path} has "
                                 f"{info.st_nlink} hard links (a second name of an object "
                                 "is not taken)")
            _check_owner(info, key, path, owner)
            if offset + byte_size > info.st_size:
                raise invalid(f"key {key!r}: a region of {byte_size} bytes at offset {offset} "
                              f"is beyond the object's {info.st_size} bytes")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def register(self, name: str, key: str, offset: int, byte_size: int,
                 owner: tuple[int, int] | None = None) -> None:
        """Open ``key`` and serve ``byte_size`` bytes of it from ``offset`` as ``name``.

        ``owner``: the uid and gid owning the token file of the caller's token
        (``Access.owner``); None: the data plane's own.  The object is attached only when
        that uid owns it, or when it belongs to that group and grants the group read and
        write.  The data plane (root) would otherwise read and write, for any token holder,
        memory that holder could not open: over loopback TCP a caller has no uid to match,
        but its token does; and since the token file is shared by a group (mode 0640), an
        object every member may open anyway gives no member more than it had.  A client
        that is not the token file's owner shares its object with the group
        (``fchown(fd, -1, gid)``, ``fchmod(fd, 0o660)``)."""
        if not name or len(name) > MAX_REGION_NAME:
            raise invalid(f"a region name must be 1 to {MAX_REGION_NAME} characters")
        if offset < 0 or byte_size <= 0:
            raise invalid(f"region {name!r}: offset must be 0 or above and byte_size above 0")
        path = SHM_DIR / self._object_name(key)
        fd = self._open(path, key, offset, byte_size,
                        owner if owner is not None else (os.geteuid(), os.getegid()))
        try:
            with self._lock:
                if name in self._regions:
                    raise ServeError("ALREADY_EXISTS", f"shared memory region {name!r} is "
                                     "already registered (unregister it first)")
                if len(self._regions) >= self.max_regions:
                    raise ServeError("RESOURCE_EXHAUSTED", f"{self.max_regions} shared "
                                     "memory regions are registered, the most there may be")
                spanned = sum(region.byte_size for region in self._regions.values())
                if spanned + byte_size > self.max_bytes:
                    raise ServeError("RESOURCE_EXHAUSTED", f"region {name!r} of {byte_size} "
                                     f"bytes would take the registered regions beyond "
                                     f"{self.max_bytes} bytes")
                self._regions[name] = Region(name, key, offset, byte_size, fd)
        except BaseException:
            os.close(fd)
            raise

    def unregister(self, name: str = "") -> None:
        """One region, or every region for ""; a name not registered is no error (as in
        Triton), so a client's cleanup may repeat itself."""
        with self._lock:
            if name:
                gone = [self._regions.pop(name)] if name in self._regions else []
            else:
                gone = list(self._regions.values())
                self._regions.clear()
        for region in gone:
            region.retire()

    def status(self, name: str = "") -> list[dict[str, Any]]:
        """Every region's ``{name, key, offset, byte_size}``, or the one named."""
        with self._lock:
            if not name:
                return [region.status() for region in self._regions.values()]
            region = self._regions.get(name)
        if region is None:
            raise not_found(f"no shared memory region {name!r} is registered")
        return [region.status()]

    def get(self, name: str) -> Region:
        """The region a request references; INVALID_ARGUMENT naming it if there is none."""
        with self._lock:
            region = self._regions.get(name)
        if region is None:
            raise invalid(f"shared memory region {name!r} is not registered")
        return region

    def close(self) -> None:
        self.unregister()


def _check_owner(info: os.stat_result, key: str, path: Path, owner: tuple[int, int]) -> None:
    uid, gid = owner
    group_rw = stat.S_IRGRP | stat.S_IWGRP
    if info.st_uid == uid or (info.st_gid == gid and info.st_mode & group_rw == group_rw):
        return
    raise ServeError("PERMISSION_DENIED", f"key {key!r}: {path} belongs to uid {info.st_uid}, "
                     f"not to the owner of the caller's token file (uid {uid}), nor is it "
                     f"shared read-write with that file's group (gid {gid}): the data plane "
                     "attaches only memory the token's holders may open themselves")


def bounded_regions(prefix: str, max_request_bytes: int) -> SharedMemoryRegions:
    """The regions of a data plane whose bodies may be ``max_request_bytes`` long."""
    return SharedMemoryRegions(prefix, max_bytes=max_request_bytes * BYTES_PER_REQUEST_BYTE)


class RegionLookup(Protocol):
    """What a request's decoding needs of the regions: one by name."""

    def get(self, name: str) -> Region: ...


class CallerRegions:
    """The regions as one request may use them: only with the token.  A region is another
    process's memory; the data plane runs as root, so a request may read or write one only
    when it could have registered it (``check`` raises UNAUTHENTICATED otherwise)."""

    def __init__(self, regions: SharedMemoryRegions, check: Callable[[], None]) -> None:
        self.regions, self.check = regions, check
        self._checked = False  # the token passed once: the request's other regions need no stat

    def get(self, name: str) -> Region:
        if not self._checked:
            self.check()
            self._checked = True
        return self.regions.get(name)
