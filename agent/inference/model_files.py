"""Model files are data, not paths: a model and the external data it names are opened, checked
and hashed here, and ONNX Runtime is handed their bytes, never a path of its own to open.

An ONNX tensor may keep its data in another file (``external_data``: ``location``, ``offset``,
``length``).  Given a model's bytes, ORT resolves such a location against the process's
working directory (older releases follow ``..`` and absolute paths too; under systemd the
working directory is ``/``), so a model file could make the root data plane read
``/etc/shadow`` into an initializer, answer it to any client and copy it into the
optimised-graph cache.  Here every location must be relative, without ``..``, name a regular
file inside the directory holding the model, and keep its ``offset``/``length`` within that
file; ORT then gets each file's contents from memory
(``add_external_initializers_from_files_in_memory``), so what it builds from is exactly what
was hashed and a pin covers it.  The files are mapped, not read: their pages are the page
cache's, and ORT copies what it keeps while the session is built (as it keeps the weights of
a model without external data).

Symbolic links: a file is opened (following links) and then the path of the open descriptor
(``/proc/self/fd``) must lie inside the allowed directory.  ``O_NOFOLLOW`` alone guards only
the last component and refuses links that stay inside (weights shared by two versions); a
``realpath`` check before the open races with a rename.  Checking what was actually opened
does neither.  A repository's model file is checked the same way against the repository
(serving/build.py); a built-in (the demo model, ``inference.model``) lies outside it by design.

A model's digest (what ``sha256`` pins and the caches are keyed by) is the sha256 of
``model.onnx`` when it names no external file, so pins of such models keep their value;
otherwise it is the sha256 of ``sha256sum``'s lines (``<hex>  <name>\\n``) for the model file
and then each external file by its normalised location, sorted, which an operator can
compute: ``cd <model>/<version> && sha256sum model.onnx weights.bin | sha256sum``.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import posixpath
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx
from google.protobuf.message import DecodeError  # type: ignore[import-untyped]

from agent.inference.errors import SessionError, model_error

IN_MEMORY = "add_external_initializers_from_files_in_memory"
FOLDER = "session.model_external_initializers_file_folder_path"
INLINE_BYTES = 1 << 16  # shape tensors are a few bytes; weights are what external data is for
RKNN_SUFFIX = ".rknn"  # a Rockchip NPU build, served beside its model.onnx


@dataclass(frozen=True)
class ExternalFile:
    """One external data file, mapped: ``spellings`` are the locations the model writes for
    it (ORT looks a file up by the location as written)."""

    name: str  # the normalised location
    spellings: tuple[str, ...]
    data: mmap.mmap | bytes  # bytes when empty: an empty file cannot be mapped
    sha256: str


@dataclass(frozen=True)
class ModelFiles:
    """A model's bytes, its external files and its digest; close it (or use ``with``) once
    the session is built, which unmaps the files."""

    path: Path
    model: bytes  # what ORT builds from: small external tensors inlined (_inline_small)
    sha256: str
    external: tuple[ExternalFile, ...] = ()

    def attach(self, options: Any) -> Any:
        """``options`` (an ``ort.SessionOptions``) with the external files' contents, so
        ORT opens no file of its own; the same options back."""
        if not self.external:
            return options
        if not hasattr(options, IN_MEMORY):
            import onnxruntime as ort

            raise model_error(self.path, f"keeps tensors in external data files, which "
                              f"onnxruntime {ort.__version__} cannot take from memory; "
                              "upgrade onnxruntime or save the model with its data inside")
        names = [spelling for file in self.external for spelling in file.spellings]
        buffers = [file.data for file in self.external for _ in file.spellings]
        getattr(options, IN_MEMORY)(names, buffers, [len(data) for data in buffers])
        # should a release ever miss a name in memory, it reads the checked directory, not
        # the working directory
        options.add_session_config_entry(FOLDER, str(self.path.parent))
        return options

    def close(self) -> None:
        for file in self.external:
            if isinstance(file.data, mmap.mmap):
                file.data.close()

    def __enter__(self) -> ModelFiles:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def open_model(path: Path, *, root: Path | None = None) -> ModelFiles:
    """The model at ``path`` with its external files, checked; SessionError naming the file
    (and the initializer) when it is refused.  ``root``: the directory the model file must
    lie in (the repository); None for a built-in, which is outside it by design."""
    fd = _open_inside(path, root)
    try:
        with os.fdopen(fd, "rb") as file:
            model = file.read()
    except OSError as error:
        raise model_error(path, f"cannot read it: {error.strerror or error}") from error
    digest = hashlib.sha256(model).hexdigest()
    proto, references = _references(path, model)
    if proto is None or not references:
        return ModelFiles(path, model, digest)
    external = _map_external(path, references)
    lines = [f"{digest}  {path.name}\n"]
    lines += [f"{file.sha256}  {file.name}\n" for file in external]
    return ModelFiles(path, _inline_small(model, proto, references, external),
                      hashlib.sha256("".join(lines).encode()).hexdigest(), external)


def model_sha256(path: Path, *, root: Path | None = None) -> str:
    """The model's digest, as ``open_model`` defines it."""
    with open_model(path, root=root) as files:
        return files.sha256


@dataclass(frozen=True)
class _Reference:
    """A tensor's external data, as the model writes it, and the tensor itself."""

    tensor: str  # how errors name it
    location: str
    name: str  # the location normalised
    offset: str
    length: str | None
    proto: onnx.TensorProto = field(compare=False, repr=False)


def _references(path: Path, model: bytes) -> tuple[Any, list[_Reference]]:
    """Every tensor's external data reference, wherever ONNX lets a tensor be (initializers,
    sparse initializers, Constant and other node attributes, subgraphs, functions, training
    graphs): the walk goes through every message field, so none is forgotten."""
    if path.suffix == RKNN_SUFFIX or b"location" not in model:
        # an NPU build is no protobuf; the key is stored as this literal string, so a model
        # without it names no file, and an embedded model is not parsed twice (the parse
        # copies every weight)
        return None, []
    try:
        proto = onnx.ModelProto.FromString(model)
    except DecodeError as error:
        # ORT may read what this parser refuses (nesting limits): unchecked, it is refused
        raise model_error(path, f"not an ONNX model (its external data cannot be checked: "
                          f"{error}); refused") from None
    return proto, [_reference(path, label, tensor) for label, tensor in _tensors(proto, "")]


def _tensors(message: Any, where: str) -> Iterator[tuple[str, onnx.TensorProto]]:
    for descriptor, value in message.ListFields():
        if descriptor.type != descriptor.TYPE_MESSAGE:
            continue
        # a single message has fields of its own; a repeated field is a container of them
        for item in (value,) if hasattr(value, "ListFields") else value:
            if isinstance(item, onnx.TensorProto):
                if item.data_location == onnx.TensorProto.EXTERNAL or item.external_data:
                    yield (f"initializer {item.name}" if item.name else where), item
            elif isinstance(item, onnx.NodeProto):
                yield from _tensors(item, f"node {item.name or item.op_type}'s tensor")
            else:
                yield from _tensors(item, where)


def _reference(path: Path, label: str, tensor: onnx.TensorProto) -> _Reference:
    entries = {entry.key: entry.value for entry in tensor.external_data}
    location = entries.get("location")
    if not location:
        raise model_error(path, f"{label}: external data names no location; refused")
    for key in ("offset", "length"):
        value = entries.get(key)
        if value is not None and not (value.isascii() and value.isdigit()):
            raise model_error(path, f"{label}: external data {key} {value!r} is not a "
                              "non-negative integer; refused")
    return _Reference(label, location, _normalised(path, label, location),
                      entries.get("offset", "0"), entries.get("length"), tensor)


def _map_external(path: Path, references: list[_Reference]) -> tuple[ExternalFile, ...]:
    """Each distinct file the references name, opened inside the model's directory, mapped,
    hashed, and checked against every reference's offset and length."""
    first: dict[str, _Reference] = {}  # the first tensor naming each file names it in errors
    spellings: dict[str, list[str]] = {}
    for reference in references:
        first.setdefault(reference.name, reference)
        if reference.location not in spellings.setdefault(reference.name, []):
            spellings[reference.name].append(reference.location)
    mapped: dict[str, ExternalFile] = {}
    try:
        for name in sorted(spellings):
            mapped[name] = _map_file(path, first[name], name, tuple(spellings[name]))
        for reference in references:
            _check_range(path, reference, len(mapped[reference.name].data))
    except BaseException:
        for file in mapped.values():
            if isinstance(file.data, mmap.mmap):
                file.data.close()
        raise
    return tuple(mapped.values())


def _inline_small(model: bytes, proto: Any, references: list[_Reference],
                  files: tuple[ExternalFile, ...]) -> bytes:
    """The model ORT is given: external tensors up to INLINE_BYTES are copied into it from
    the checked files, because ORT's shape inference reads a Reshape's shape (and the like)
    from the graph, before it looks at files in memory; the weights stay external."""
    data = {file.name: file.data for file in files}
    inlined = False
    for reference in references:
        start = int(reference.offset)
        size = len(data[reference.name]) - start
        length = int(reference.length) if reference.length is not None else size
        if length > INLINE_BYTES:
            continue
        tensor = reference.proto
        tensor.raw_data = bytes(data[reference.name][start:start + length])
        del tensor.external_data[:]
        tensor.data_location = onnx.TensorProto.DEFAULT
        inlined = True
    return proto.SerializeToString() if inlined else model


def _check_range(path: Path, reference: _Reference, size: int) -> None:
    offset = int(reference.offset)
    end = offset + (int(reference.length) if reference.length is not None else 0)
    if end > size:
        raise model_error(path, f"{reference.tensor}: external data {reference.location!r} "
                          f"offset {offset} length {reference.length or 'absent'} goes past "
                          f"the file's {size} bytes; refused")


def _normalised(path: Path, label: str, location: str) -> str:
    """The location as a plain relative name; refused when absolute or leaving the model's
    directory."""
    normal = posixpath.normpath(location)
    if "\0" in location or posixpath.isabs(location) or normal in (".", "..") or (
            normal.startswith("../")):
        raise model_error(path, f"{label}: external data location {location!r} is not a "
                          f"file inside {path.parent}; refused")
    return normal


def _map_file(path: Path, reference: _Reference, name: str,
              spellings: tuple[str, ...]) -> ExternalFile:
    directory = path.parent
    where = f"{reference.tensor}: external data location {reference.location!r}"
    try:
        fd = _open_inside(directory / name, directory)
    except SessionError as error:
        raise model_error(path, f"{where}: {error}") from None
    try:
        size = os.fstat(fd).st_size
        data: mmap.mmap | bytes = mmap.mmap(fd, size, access=mmap.ACCESS_READ) if size else b""
    except OSError as error:
        raise model_error(path, f"{where}: cannot map it: {error.strerror or error}") from None
    finally:
        os.close(fd)
    return ExternalFile(name, spellings, data, hashlib.sha256(data).hexdigest())


def _open_inside(path: Path, directory: Path | None) -> int:
    """A read descriptor of the regular file ``path``, which (its links followed) must lie
    inside ``directory`` when one is given.  O_NONBLOCK: a FIFO planted as a model file
    must not hang the open."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as error:
        raise model_error(path, f"cannot read it: {error.strerror or error}") from None
    try:
        problem = _problem(fd, directory)
    except OSError as error:
        problem = f"cannot check it: {error.strerror or error}"
    if problem:
        os.close(fd)
        raise model_error(path, problem)
    return fd


def _problem(fd: int, directory: Path | None) -> str:
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        return "is not a regular file; refused"
    if directory is None:
        return ""
    opened = os.readlink(f"/proc/self/fd/{fd}")
    inside = os.path.realpath(directory)
    if os.path.commonpath([opened, inside]) != inside:
        return f"is {opened}, outside {inside}; refused"
    return ""
