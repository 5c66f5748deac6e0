"""A passed build into the repository as the next version of its model, whole or not at all:
the files go into a hidden staging directory, are flushed, and the directory is renamed to
the version number (the data plane never sees a version without its model file)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Collection, Mapping
from pathlib import Path

from agent.modelbuild.report import MODEL_FILE, REPORT_FILE, RKNN_FILE, BuildReport
from agent.modelbuild.request import BuildError

INSTALLED_FILES = (MODEL_FILE, RKNN_FILE, REPORT_FILE)


def next_version(directory: Path, builtin: bool) -> int:
    """One above every version directory (and above the built-in file's version 1)."""
    numbers = [int(p.name) for p in directory.iterdir()
               if p.name.isascii() and p.name.isdigit()] if directory.is_dir() else []
    return max([*numbers, *([1] if builtin else [])], default=0) + 1


def install(report: BuildReport, workdir: Path, repository: Path,
            builtins: Collection[str] = ()) -> int:
    """The version number the build went in as; the report gets it (and is rewritten)."""
    if not report.passed:
        raise BuildError("a build that did not pass its gate is not installed")
    name = report.request.name
    directory = repository / name
    try:
        directory.mkdir(parents=True, exist_ok=True)
        version = next_version(directory, name in builtins)
        report.version = version
        report.write(workdir)
        stage(directory, version, {file: workdir / file for file in INSTALLED_FILES
                                   if (workdir / file).is_file()})
    except OSError as error:
        report.version = None
        raise BuildError(f"{directory}: could not install ({error.strerror or error})") \
            from None
    return version


def stage(directory: Path, version: int, files: Mapping[str, bytes | Path],
          marker: str | None = None) -> Path:
    """``<directory>/<version>`` holding ``files`` (name -> bytes, or a file to copy), each
    flushed to disk in a hidden staging directory that is then renamed; on an error the
    staging directory goes and the error is raised.  ``marker``: an empty file put in first
    (an install that is not committed until a later step removes it)."""
    staging = directory / f".{version}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        staging.mkdir(parents=True)
        if marker is not None:
            (staging / marker).touch()
        for file, data in files.items():
            if isinstance(data, bytes):
                _write(data, staging / file)
            else:
                _copy(data, staging / file)
        staging.rename(directory / str(version))
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return directory / str(version)


def _write(data: bytes, target: Path) -> None:
    with open(target, "wb") as writer:
        writer.write(data)
        writer.flush()
        os.fsync(writer.fileno())


def _copy(source: Path, target: Path) -> None:
    with open(source, "rb") as reader, open(target, "wb") as writer:
        shutil.copyfileobj(reader, writer, 1 << 20)
        writer.flush()
        os.fsync(writer.fileno())
