"""The optimised-graph cache: sessions built from a graph ORT optimised once and stored.

Graph optimisation at level ``all`` costs more than the load itself on small boards, so the
optimised graph is cached on disk.  A cache file is named ``<key>.<sha256 of its bytes>.onnx``
and is only ever created by an atomic rename, so a crash or a torn write can never be loaded:
the digest in the name is checked on every hit.  Files are 0600 in a 0700 directory: they
hold the model's weights.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import stat
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

import onnxruntime as ort

from agent.inference.errors import ort_error
from agent.inference.options import GraphOptimization
from agent.inference.providers import OPENVINO, TENSORRT

logger = logging.getLogger(__name__)

# These EPs compile subgraphs into kernels ORT cannot serialise ("contains compiled nodes"), and
# it only finds out after the compile, which takes minutes for TensorRT: never cache them.
COMPILING_PROVIDERS = frozenset({
    TENSORRT, OPENVINO, "NvTensorRTRTXExecutionProvider", "MIGraphXExecutionProvider",
    "QNNExecutionProvider", "VitisAIExecutionProvider", "CoreMLExecutionProvider",
    "NnapiExecutionProvider",
})

CacheState = Literal["hit", "miss", "off"]
OptionsFactory = Callable[[], "ort.SessionOptions"]
# ORT's ``providers=``: names, or (name, options) pairs
Provider = str | tuple[str, dict[str, str]]


def provider_names(providers: Sequence[Provider]) -> list[str]:
    return [p if isinstance(p, str) else p[0] for p in providers]


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _session(path: Path, model: bytes, options: ort.SessionOptions,
             providers: list[Provider]) -> ort.InferenceSession:
    """ORT's own exceptions carry no common base, so they become one SessionError."""
    try:
        return ort.InferenceSession(model, options, providers=providers)
    except Exception as error:
        raise ort_error(path, error) from error


@functools.cache
def cpu_identity() -> str:
    """The CPU the optimised graph was laid out for: ORT picks kernels and layouts by ISA
    (AVX-512 on x86, the Arm feature list), so a state directory copied to another machine
    must not reuse it."""
    try:
        with open("/proc/cpuinfo") as handle:  # the running CPU's, whatever --root says
            text = handle.read()
    except OSError:
        text = ""
    wanted = ("model name", "flags", "Features", "CPU part", "CPU implementer")
    lines = sorted({line.split(":", 1)[1].strip() for line in text.splitlines()
                    if ":" in line and line.split(":", 1)[0].strip() in wanted})
    return _sha256("|".join([platform.machine(), *lines]).encode())[:16]


def cache_key(model_sha256: str, providers: Sequence[str],
              graph_optimization: GraphOptimization) -> str:
    """What the optimised graph depends on: the model, this ORT, the EPs, the level and the
    CPU."""
    parts = [model_sha256, ort.__version__, ",".join(providers), graph_optimization,
             cpu_identity()]
    return _sha256("|".join(parts).encode())[:32]


def create_session(path: Path, model: bytes, digest: str, providers: list[Provider],
            fresh: OptionsFactory, cache_dir: Path | None,
            graph_optimization: GraphOptimization) -> tuple[ort.InferenceSession, CacheState]:
    """Hit, miss (and store) or off; a broken cache costs a rebuild, never the session.
    Provider options do not enter the key: only CPU/CUDA sessions are cached, and theirs
    (a CUDA device id) do not change the graph ORT optimises."""
    names = provider_names(providers)
    if cache_dir is None or COMPILING_PROVIDERS.intersection(names):
        return _session(path, model, fresh(), providers), "off"
    key = cache_key(digest, names, graph_optimization)
    try:
        _private_dir(cache_dir)
        session = _load_cached(cache_dir, key, providers, fresh)
    except OSError as error:
        logger.warning("optimised-model cache %s unusable (%s); building uncached",
                       cache_dir, error)
        return _session(path, model, fresh(), providers), "off"
    if session is not None:
        return session, "hit"
    return _build_and_store(path, model, providers, fresh, cache_dir, key)


def _private_dir(cache_dir: Path) -> None:
    """The cache directory, 0700 even where an older agent made it 0755: an optimised graph
    holds the model's weights, which are no other local user's to read."""
    cache_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    if stat.S_IMODE(cache_dir.stat().st_mode) != 0o700:
        cache_dir.chmod(0o700)


def _load_cached(cache_dir: Path, key: str, providers: list[Provider],
                 fresh: OptionsFactory) -> ort.InferenceSession | None:
    """The first cache file for ``key`` that verifies and loads; bad ones are deleted."""
    for path in sorted(cache_dir.glob(f"{key}.*.onnx")):
        session = _try_cached(path, providers, fresh)
        if session is not None:
            return session
        path.unlink(missing_ok=True)
    return None


def _try_cached(path: Path, providers: list[Provider],
                fresh: OptionsFactory) -> ort.InferenceSession | None:
    """A session from an already-optimised graph, so optimisation is off; None if unusable.

    A truncated protobuf can still parse, so the digest, not ORT, is the corruption check.
    """
    data = path.read_bytes()
    if _sha256(data) != path.name.split(".")[1]:
        logger.warning("optimised-model cache file %s is corrupt; rebuilding it", path)
        return None
    options = fresh()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        return ort.InferenceSession(data, options, providers=providers)
    except Exception as error:
        logger.warning("optimised-model cache file %s does not load (%s); rebuilding it",
                       path, error)
        return None


def _build_and_store(path: Path, model: bytes, providers: list[Provider], fresh: OptionsFactory,
                     cache_dir: Path, key: str) -> tuple[ort.InferenceSession, CacheState]:
    """Let ORT write the optimised graph to a temporary name, then publish it atomically.

    The temporary name ends in ``.onnx``: ORT picks its own ``.ort`` format from the suffix.
    When the build fails, an uncached build tells a refused save (it loads) from a model ORT
    cannot use (it fails too, and that error names the model file).
    """
    _sweep_stale(cache_dir, key)
    tmp = cache_dir / f".{key}.{os.getpid()}.{uuid.uuid4().hex}.tmp.onnx"
    options = fresh()
    options.optimized_model_filepath = str(tmp)
    try:
        session = ort.InferenceSession(model, options, providers=providers)
    except Exception as error:
        tmp.unlink(missing_ok=True)
        uncached = _session(path, model, fresh(), providers)
        logger.warning("onnxruntime cannot save the optimised model of %s (%s); running it "
                       "uncached", path, error)
        return uncached, "off"
    try:
        _publish(tmp, cache_dir, key)
    except OSError as error:
        tmp.unlink(missing_ok=True)
        logger.warning("cannot store the optimised model in %s: %s", cache_dir, error)
    return session, "miss"


def _publish(tmp: Path, cache_dir: Path, key: str) -> None:
    """Rename into place, 0600 (ORT creates it under the umask), under its content digest,
    then drop older files for the key."""
    tmp.chmod(0o600)
    final = cache_dir / f"{key}.{_sha256(tmp.read_bytes())}.onnx"
    os.replace(tmp, final)
    for other in cache_dir.glob(f"{key}.*.onnx"):
        if other != final:
            other.unlink(missing_ok=True)


def _sweep_stale(cache_dir: Path, key: str) -> None:
    """Remove temporaries left by dead processes: a crash loop must not fill the disk."""
    for tmp in cache_dir.glob(f".{key}.*.tmp.onnx"):
        pid = tmp.name.split(".")[2]
        if pid.isdigit() and not _alive(int(pid)):
            tmp.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    """Signal 0 probes without signalling; EPERM still means the process exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
