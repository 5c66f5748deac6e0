"""The inference runtimes installed here and their versions, for the engine-cache fingerprint
and the RKNN version check: read from the running system (packages, library file names,
CUDA's version file), each one None when absent.

Discovery reports the same runtimes for the topology; this is the data plane's own reading,
taken where the libraries are loaded.
"""

from __future__ import annotations

import glob
import importlib.metadata
import json
import re
from pathlib import Path

from agent.inference.backends.rknn_file import read_runtime_version
from agent.inference.provider_options import RuntimeVersions

LIBRARY_DIRS = ("/usr/lib/aarch64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/usr/lib",
                "/usr/local/cuda/lib64", "/usr/local/lib")
_SONAME = re.compile(r"\.so\.(\d+\.\d+\.\d+)$")


def _distribution(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _library(stem: str, dirs: tuple[str, ...] = LIBRARY_DIRS) -> str | None:
    """The highest ``<stem>.so.X.Y.Z`` found (libnvinfer.so.10.3.0 -> 10.3.0)."""
    found = [m.group(1) for d in dirs for path in glob.glob(f"{d}/{stem}.so.*")
             if (m := _SONAME.search(path))]
    return max(found, key=lambda v: tuple(map(int, v.split("."))), default=None)


def parse_cuda_version(text: str) -> str | None:
    """``version.json`` (CUDA 11.1+) or ``version.txt`` (``CUDA Version 10.2.89``)."""
    try:
        document = json.loads(text)
    except ValueError:
        found = re.search(r"CUDA Version (\d+\.\d+(?:\.\d+)?)", text)
        return found.group(1) if found else None
    version = document.get("cuda", {}).get("version") if isinstance(document, dict) else None
    return str(version) if version else None


def _cuda(root: Path = Path("/usr/local/cuda")) -> str | None:
    for name in ("version.json", "version.txt"):
        try:
            return parse_cuda_version((root / name).read_text())
        except OSError:
            continue
    return _library("libcudart")


def installed_versions(onnxruntime: str) -> RuntimeVersions:
    return RuntimeVersions(
        onnxruntime=onnxruntime,
        tensorrt=_distribution("tensorrt") or _library("libnvinfer"),
        cuda=_cuda(),
        openvino=_distribution("openvino"),
        librknnrt=read_runtime_version())
