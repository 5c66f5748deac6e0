"""Inference runtimes on the root: librknnrt, TensorRT, CUDA, OpenVINO, this onnxruntime.

Everything is read as files through the root, nothing is loaded or imported:

- librknnrt embeds ``librknnrt version: X.Y.Z (<commit>@<date>)``; the library is scanned
  in bounded chunks (it is megabytes; the string's offset differs between releases).
- TensorRT: dpkg's ``libnvinfer<N>`` package (JetPack, NVIDIA's apt repository), else the
  ``libnvinfer.so.X.Y.Z`` file name.
- CUDA: ``/usr/local/cuda/version.json`` (11.1+) or ``version.txt`` (older).
- OpenVINO: a python ``openvino-X.Y.Z.dist-info`` directory, else ``libopenvino.so.X.Y.Z``.
- onnxruntime: which distribution (onnxruntime, -gpu, -openvino) this interpreter has,
  from its metadata: on the host root only, a fixture tree has no interpreter.

A missing runtime is None, an unreadable file a warning, never an exception.
"""

from __future__ import annotations

import json
import os
import re

from agent.discovery.model import Runtimes, RuntimeVersion
from agent.kernel.reader import SysReader

LIB_DIRS = ("/usr/lib", "/usr/lib/aarch64-linux-gnu", "/usr/lib/x86_64-linux-gnu",
            "/usr/local/lib", "/lib", "/lib64", "/usr/lib64")
RKNNRT_VERSION = re.compile(rb"librknnrt version: ?(\d+\.\d+\.\d+[\w.+-]*)")
RKNNRT_SCAN_BYTES = 64 * 1024 * 1024  # the real library is ~7 MB; stop well after that
_CHUNK = 1024 * 1024
DPKG_STATUS = "/var/lib/dpkg/status"
CUDA_DIR = "/usr/local/cuda"
OPENVINO_LIB_DIRS = (*LIB_DIRS, "/opt/intel/openvino/runtime/lib/intel64")
SITE_GLOBS = ("/usr/lib/python3*/site-packages", "/usr/lib/python3*/dist-packages",
              "/usr/local/lib/python3*/dist-packages", "/usr/local/lib/python3*/site-packages",
              "/opt/edge-agent/lib/python3*/site-packages")
ORT_DISTRIBUTIONS = ("onnxruntime", "onnxruntime-gpu", "onnxruntime-openvino",
                     "onnxruntime-directml", "onnxruntime-qnn")
_SO_VERSION = re.compile(r"\.so\.(\d+(?:\.\d+)+)$")


_SCANNED: dict[tuple[str, int, int, bytes, int], str | None] = {}


def scan_version(reader: SysReader, path: str, pattern: re.Pattern[bytes],
                 limit: int = RKNNRT_SCAN_BYTES) -> str | None:
    """The first match of ``pattern`` in at most ``limit`` bytes of a (binary) file.  Kept
    per file size and mtime: discovery runs again on every hot-plug event and data-plane
    start, and a library is megabytes that rarely change."""
    try:
        host = reader.root.host_path(path)
        status = os.stat(host)
        key = (host, status.st_size, status.st_mtime_ns, pattern.pattern, limit)
        if key not in _SCANNED:
            _SCANNED[key] = _scan(host, pattern, limit)
        return _SCANNED[key]
    except OSError as error:  # not kept: said again by the next discovery
        reader.warn(f"{path}: unreadable ({error.strerror or error})")
        return None


def _scan(host: str, pattern: re.Pattern[bytes], limit: int) -> str | None:
    with open(host, "rb") as handle:
        tail, read = b"", 0
        while read < limit:
            chunk = handle.read(min(_CHUNK, limit - read))
            if not chunk:
                return None
            read += len(chunk)
            match = pattern.search(tail + chunk)
            if match:
                return match.group(1).decode("ascii", errors="replace")
            tail = chunk[-256:]  # a string cut by the chunk boundary
    return None


def _librknnrt(reader: SysReader) -> RuntimeVersion | None:
    for directory in LIB_DIRS:
        path = f"{directory}/librknnrt.so"
        if reader.exists(path):
            return RuntimeVersion(version=scan_version(reader, path, RKNNRT_VERSION),
                                  path=reader.realpath(path) or path, source="library")
    return None


def dpkg_packages(reader: SysReader) -> dict[str, str]:
    """Installed package -> version from dpkg's status file (``install ok installed``)."""
    text = reader.text(DPKG_STATUS) or ""
    found = {}
    for stanza in text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in stanza.splitlines()
                      if ": " in line and not line.startswith(" "))
        if "Package" in fields and fields.get("Status", "").endswith(" installed"):
            found[fields["Package"]] = fields.get("Version", "")
    return found


def _upstream(debian_version: str) -> str:
    """``10.3.0.30-1+cuda12.5`` -> ``10.3.0.30`` (epoch and Debian revision dropped)."""
    return debian_version.split(":", 1)[-1].split("-", 1)[0].split("+", 1)[0]


def _so_versions(reader: SysReader, dirs: tuple[str, ...], stem: str) -> RuntimeVersion | None:
    """The longest ``<stem>.so.X.Y.Z`` in ``dirs`` (the real file, not its SONAME link)."""
    best: tuple[int, str, str] | None = None
    for directory in dirs:
        for path in reader.glob(f"{directory}/{stem}.so.*"):
            match = _SO_VERSION.search(path)
            if match and (best is None or match.group(1).count(".") > best[0]):
                best = (match.group(1).count("."), match.group(1), path)
    return RuntimeVersion(version=best[1], path=best[2], source="library") if best else None


def _tensorrt(reader: SysReader, packages: dict[str, str]) -> RuntimeVersion | None:
    for name in sorted(packages, reverse=True):
        if re.fullmatch(r"libnvinfer\d+", name):
            return RuntimeVersion(version=_upstream(packages[name]), path=DPKG_STATUS,
                                  source="dpkg")
    return _so_versions(reader, LIB_DIRS, "libnvinfer")


def _cuda(reader: SysReader) -> RuntimeVersion | None:
    path = f"{CUDA_DIR}/version.json"
    if reader.exists(path):
        try:
            data = json.loads(reader.text(path) or "")
            version = data["cuda"]["version"]
        except (ValueError, KeyError, TypeError):
            reader.warn(f"{path}: no cuda.version in it")
            version = None
        return RuntimeVersion(version=str(version) if version else None, path=path,
                              source="version.json")
    path = f"{CUDA_DIR}/version.txt"
    if reader.exists(path):
        match = re.search(r"CUDA Version\s+(\d+(?:\.\d+)*)", reader.text(path) or "")
        return RuntimeVersion(version=match.group(1) if match else None, path=path,
                              source="version.txt")
    return None


def _openvino(reader: SysReader) -> RuntimeVersion | None:
    for pattern in SITE_GLOBS:
        for path in reader.glob(f"{pattern}/openvino-*.dist-info"):
            match = re.search(r"/openvino-([\d.]+)\.dist-info$", path)
            if match:
                return RuntimeVersion(version=match.group(1), path=path, source="dist-info")
    return _so_versions(reader, OPENVINO_LIB_DIRS, "libopenvino")


def _onnxruntime(reader: SysReader) -> RuntimeVersion | None:
    """The onnxruntime distribution this interpreter imports (host root only)."""
    if not reader.root.is_host:
        return None
    from importlib.metadata import PackageNotFoundError, distribution

    for name in ORT_DISTRIBUTIONS:
        try:
            found = distribution(name)
        except PackageNotFoundError:
            continue
        return RuntimeVersion(version=found.version, path=str(found.locate_file("")),
                              source=f"dist-info:{name}")
    return None


def discover_runtimes(reader: SysReader) -> Runtimes:
    packages = dpkg_packages(reader) if reader.exists(DPKG_STATUS) else {}
    return Runtimes(librknnrt=_librknnrt(reader), tensorrt=_tensorrt(reader, packages),
                    cuda=_cuda(reader), openvino=_openvino(reader),
                    onnxruntime=_onnxruntime(reader))
