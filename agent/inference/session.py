"""Builds the ONNX Runtime session: providers, thread counts, a pinned model, a graph cache.

Graph optimisation at level ``all`` costs more than the load itself on small boards, so the
optimised graph is cached on disk.  A cache file is named ``<key>.<sha256 of its bytes>.onnx``
and is only ever created by an atomic rename, so a crash or a torn write can never be loaded:
the digest in the name is checked on every hit.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import re
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import onnxruntime as ort

from agent.discovery.model import Topology

logger = logging.getLogger(__name__)

TENSORRT = "TensorrtExecutionProvider"
CUDA = "CUDAExecutionProvider"
OPENVINO = "OpenVINOExecutionProvider"
CPU = "CPUExecutionProvider"

# These EPs compile subgraphs into kernels ORT cannot serialise ("contains compiled nodes"), and
# it only finds out after the compile, which takes minutes for TensorRT: never cache them.
COMPILING_PROVIDERS = frozenset({
    TENSORRT, OPENVINO, "NvTensorRTRTXExecutionProvider", "MIGraphXExecutionProvider",
    "QNNExecutionProvider", "VitisAIExecutionProvider", "CoreMLExecutionProvider",
    "NnapiExecutionProvider",
})

GraphOptimization = Literal["disabled", "basic", "extended", "all"]
CacheState = Literal["hit", "miss", "off"]

_LEVELS = {
    "disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}
_SPINNING_KEY = "session.intra_op.allow_spinning"

OptionsFactory = Callable[[], "ort.SessionOptions"]


class SessionError(RuntimeError):
    """The session cannot be built as configured (providers, model file, digest).

    ``model`` is set when the model file is the problem; the message then begins with it.
    """

    def __init__(self, message: str, model: str | None = None) -> None:
        super().__init__(message)
        self.model = model


def _model_error(path: Path, what: str) -> SessionError:
    return SessionError(f"{path}: {what}", model=str(path))


_ORT_STATUS = re.compile(r"^\[ONNXRuntimeError\] : \d+ : (\w+) : ")


def _ort_error(path: Path, error: Exception) -> SessionError:
    """ORT's refusal of a model file as one line that names the file.

    ORT reports bytes that are no ONNX protobuf as INVALID_PROTOBUF (a truncated or random
    file) or, for an empty or graph-less one, INVALID_ARGUMENT "No graph was found".
    """
    lines = str(error).strip().splitlines()
    first = lines[0] if lines else type(error).__name__
    status = _ORT_STATUS.match(first)
    code, text = (status.group(1), first[status.end():]) if status else ("", first)
    if code == "INVALID_PROTOBUF" or (code == "INVALID_ARGUMENT" and "No graph" in text):
        return _model_error(path, f"not an ONNX model (onnxruntime: {text})")
    return _model_error(path, f"onnxruntime cannot build a session for it: {text}")


@dataclass(frozen=True)
class BuiltSession:
    """A ready session and how it came to be, for the status report and the logs."""

    session: ort.InferenceSession
    providers: list[str]  # what ORT actually registered, in priority order
    intra_op: int
    inter_op: int
    model_sha256: str
    load_ms: float
    cache: CacheState
    # ORT's intra-op worker threads, born with the session: the loop gives them its own
    # scheduling, or a SCHED_FIFO loop thread could starve the workers it waits for.
    worker_tids: frozenset[int] = frozenset()


# -- providers ---------------------------------------------------------------------------------

def choose_providers(available: Sequence[str], topology: Topology,
                     override: Sequence[str] | None = None) -> list[str]:
    """Accelerator EPs this board can use, best first, CPU last; ``override`` wins if given.

    Only EPs in ``available`` (``onnxruntime.get_available_providers()``) are returned: asking
    ORT for a missing one is an error.  Azure is never picked here: it is a remote endpoint.
    """
    if override:
        return _filter_override(available, override)
    wanted: list[str] = []
    if _has_nvidia(topology):
        wanted += [TENSORRT, CUDA]
    if _has_intel_accelerator(topology):
        wanted.append(OPENVINO)
    wanted.append(CPU)
    return [name for name in wanted if name in available]


def _has_nvidia(topology: Topology) -> bool:
    """Jetsons have an integrated CUDA GPU; elsewhere only a discrete NVIDIA card counts."""
    return topology.board.family == "jetson" or any(
        gpu.vendor == "nvidia" and gpu.kind == "discrete" for gpu in topology.gpus)


def _has_intel_accelerator(topology: Topology) -> bool:
    """OpenVINO pays off on x86 only with an Intel GPU or NPU to offload to."""
    return topology.board.family == "x86" and (
        any(gpu.vendor == "intel" for gpu in topology.gpus)
        or any(npu.driver == "intel_vpu" for npu in topology.npus))


def _filter_override(available: Sequence[str], override: Sequence[str]) -> list[str]:
    """The operator's order, minus EPs this ORT build lacks; an error if none is left."""
    requested = list(dict.fromkeys(override))
    chosen = [name for name in requested if name in available]
    missing = [name for name in requested if name not in available]
    if not chosen:
        raise SessionError(f"none of the requested providers {missing} is available; "
                           f"available: {list(available)}")
    if missing:
        logger.warning("providers %s are not available here; using %s", missing, chosen)
    return chosen


@dataclass(frozen=True)
class UnusedAccelerator:
    """A discovered accelerator inference does not run on, and why, for an operator."""

    kind: Literal["gpu", "npu"]
    name: str  # as discovery names it
    reason: str

    @property
    def device(self) -> str:
        return f"{self.kind} {self.name}"

    def to_dict(self) -> dict[str, str]:
        return {"device": self.device, "kind": self.kind, "name": self.name,
                "reason": self.reason}


def unused_accelerators(available: Sequence[str], topology: Topology,
                        providers: Sequence[str]) -> list[UnusedAccelerator]:
    """The GPUs and NPUs discovery found that ``providers`` (the EPs inference uses) do not
    reach, each with the reason and what would change it.

    GPUs no ONNX Runtime EP runs inference on (an Arm Mali, a VM's display adapter) are
    display devices to edge-agent and are not listed.  OpenVINO is taken to reach the Intel
    GPU and NPU it was chosen for.
    """
    unused = []
    for gpu in topology.gpus:
        reason = None
        if gpu.vendor == "nvidia" and (topology.board.family == "jetson"
                                       or gpu.kind == "discrete"):
            reason = _missing(available, providers, [TENSORRT, CUDA], _nvidia_wheel(topology))
        elif gpu.vendor == "intel" and topology.board.family == "x86":
            reason = _missing(available, providers, [OPENVINO], "install onnxruntime-openvino")
        if reason:
            unused.append(UnusedAccelerator("gpu", gpu.name, reason))
    for npu in topology.npus:
        reason = _npu_reason(available, providers, topology, npu.driver, npu.vendor)
        if reason:
            unused.append(UnusedAccelerator("npu", npu.name, reason))
    return unused


def _npu_reason(available: Sequence[str], providers: Sequence[str], topology: Topology,
                driver: str | None, vendor: str | None) -> str | None:
    if driver == "nvdla":
        if TENSORRT not in providers:
            return "only the TensorRT provider reaches the DLA, and " + _left_out(
                available, providers, [TENSORRT], _nvidia_wheel(topology))
        return ("TensorRT runs the model on the GPU: DLA offload (trt_dla_enable) is not "
                "configured by edge-agent yet")
    if driver == "intel_vpu":
        return _missing(available, providers, [OPENVINO], "install onnxruntime-openvino")
    if vendor == "rockchip" or driver in ("rknpu", "rocket"):
        return ("no ONNX Runtime provider drives the Rockchip NPU: it needs edge-agent's "
                "RKNN backend (a .rknn model), which is not built yet")
    if vendor == "hailo" or driver == "hailo_pci":
        return ("no ONNX Runtime provider drives Hailo devices (they run HEF models through "
                "HailoRT), and edge-agent has no Hailo backend")
    if vendor == "google":
        return ("no ONNX Runtime provider drives the Edge TPU (it runs TFLite models through "
                "libedgetpu), and edge-agent has no Edge TPU backend")
    return f"no ONNX Runtime provider here drives it (driver {driver or 'unknown'})"


_SHORT = {TENSORRT: "TensorRT", CUDA: "CUDA", OPENVINO: "OpenVINO"}


def _missing(available: Sequence[str], providers: Sequence[str], wanted: Sequence[str],
             remedy: str) -> str | None:
    """None when one of ``wanted`` is in use, else why none is."""
    if any(name in providers for name in wanted):
        return None
    return _left_out(available, providers, wanted, remedy)


def _left_out(available: Sequence[str], providers: Sequence[str], wanted: Sequence[str],
              remedy: str) -> str:
    """Whether this ORT lacks ``wanted`` (and what to install) or the configured provider
    list leaves them out."""
    names = "/".join(_SHORT[name] for name in wanted)
    present = [name for name in wanted if name in available]
    if present:
        return (f"the configured providers ({', '.join(providers) or 'none'}) leave out "
                f"{', '.join(present)}")
    return (f"onnxruntime here has no {names} provider (available: "
            f"{', '.join(available) or 'none'}); {remedy}")


def _nvidia_wheel(topology: Topology) -> str:
    if topology.board.family == "jetson":
        jetpack = f" {topology.board.jetpack}" if topology.board.jetpack else ""
        return f"install the onnxruntime-gpu wheel built for JetPack{jetpack}"
    return "install onnxruntime-gpu"


# -- threads -----------------------------------------------------------------------------------

def thread_plan(topology: Topology, inference_cpus: Sequence[int] | None) -> tuple[int, int]:
    """``(intra_op, inter_op)``: one intra-op thread per online CPU given to inference.

    Without a CPU set, the big cores of a big.LITTLE SoC (a thread on a little core makes every
    parallel op wait for it), else every online CPU.  Inter-op is 1: execution is sequential.
    An intra-op count of 0 (ORT's own choice) only results when discovery saw no online CPU.
    """
    return len(_inference_cpus(topology, inference_cpus)), 1


def _inference_cpus(topology: Topology, inference_cpus: Sequence[int] | None) -> list[int]:
    """The online CPUs inference runs on; offline ones (nvpmodel, hotplug) get no thread."""
    online = set(topology.cpu.online)
    if inference_cpus:
        usable = sorted(online.intersection(inference_cpus))
        if not usable:
            raise SessionError(f"none of the inference CPUs {list(inference_cpus)} is online; "
                               f"online: {sorted(online)}")
        return usable
    big = [cpu for cluster in topology.cpu.clusters if cluster.core_type == "big"
           for cpu in cluster.online_cpus]
    return sorted(big) or sorted(online)


# -- model -------------------------------------------------------------------------------------

def load_model(path: Path, expected_sha256: str | None) -> bytes:
    """The model's bytes, refused unless they match the pinned digest (when one is pinned)."""
    return _read_model(path, expected_sha256)[0]


def _read_model(path: Path, expected_sha256: str | None) -> tuple[bytes, str]:
    """Bytes and digest, hashed once: the digest is also the cache key."""
    try:
        data = path.read_bytes()
    except OSError as error:
        raise _model_error(path, f"cannot read it: {error.strerror or error}") from error
    actual = _sha256(data)
    if expected_sha256 is not None and actual != expected_sha256.strip().lower():
        raise _model_error(path, f"has sha256 {actual}, expected {expected_sha256}; "
                           "refusing to load it")
    return data, actual


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- session -----------------------------------------------------------------------------------

def session_options(intra_op: int, inter_op: int, graph_optimization: GraphOptimization = "all",
                    allow_spinning: bool | None = None) -> ort.SessionOptions:
    """Sequential execution with explicit pools; spinning stays ORT's default unless set.

    Spinning trades idle CPU for wake-up latency: turn it off where inference shares cores.
    """
    options = ort.SessionOptions()
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.intra_op_num_threads = intra_op
    options.inter_op_num_threads = inter_op
    options.graph_optimization_level = _level(graph_optimization)
    if allow_spinning is not None:
        options.add_session_config_entry(_SPINNING_KEY, "1" if allow_spinning else "0")
    return options


def _level(graph_optimization: str) -> ort.GraphOptimizationLevel:
    """The ORT enum for a profile's level name; a typo is a configuration error."""
    if graph_optimization not in _LEVELS:
        raise SessionError(f"unknown graph optimisation {graph_optimization!r}; "
                           f"choose one of {list(_LEVELS)}")
    return _LEVELS[graph_optimization]


def build_session(model_path: Path, *, providers: Sequence[str], intra_op: int, inter_op: int,
                  cache_dir: Path | None, expected_sha256: str | None = None,
                  graph_optimization: GraphOptimization = "all",
                  allow_spinning: bool | None = None) -> BuiltSession:
    """Load the (pinned) model and build its session, through the optimised-graph cache."""
    start = time.perf_counter()
    _level(graph_optimization)  # a typo fails before the model is read
    fresh = functools.partial(session_options, intra_op, inter_op, graph_optimization,
                              allow_spinning)
    model, digest = _read_model(model_path, expected_sha256)
    threads_before = _own_threads()
    session, cache = _create(model_path, model, digest, list(providers), fresh, cache_dir,
                             graph_optimization)
    built = BuiltSession(session=session, providers=list(session.get_providers()),
                         intra_op=intra_op, inter_op=inter_op, model_sha256=digest,
                         load_ms=(time.perf_counter() - start) * 1000, cache=cache,
                         worker_tids=frozenset(_own_threads() - threads_before))
    logger.info("model %s: providers %s, threads %d/%d, cache %s, %.1f ms", model_path,
                built.providers, intra_op, inter_op, cache, built.load_ms)
    return built


def _own_threads() -> set[int]:
    """Thread ids of this process (sessions are built from one control thread at a time)."""
    return {int(tid) for tid in os.listdir("/proc/self/task")}


def _session(path: Path, model: bytes, options: ort.SessionOptions,
             providers: list[str]) -> ort.InferenceSession:
    """ORT's own exceptions carry no common base, so they become one SessionError."""
    try:
        return ort.InferenceSession(model, options, providers=providers)
    except Exception as error:
        raise _ort_error(path, error) from error


# -- optimised-graph cache ---------------------------------------------------------------------

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


def _create(path: Path, model: bytes, digest: str, providers: list[str],
            fresh: OptionsFactory, cache_dir: Path | None,
            graph_optimization: GraphOptimization) -> tuple[ort.InferenceSession, CacheState]:
    """Hit, miss (and store) or off; a broken cache costs a rebuild, never the session."""
    if cache_dir is None or COMPILING_PROVIDERS.intersection(providers):
        return _session(path, model, fresh(), providers), "off"
    key = cache_key(digest, providers, graph_optimization)
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        session = _load_cached(cache_dir, key, providers, fresh)
    except OSError as error:
        logger.warning("optimised-model cache %s unusable (%s); building uncached",
                       cache_dir, error)
        return _session(path, model, fresh(), providers), "off"
    if session is not None:
        return session, "hit"
    return _build_and_store(path, model, providers, fresh, cache_dir, key)


def _load_cached(cache_dir: Path, key: str, providers: list[str],
                 fresh: OptionsFactory) -> ort.InferenceSession | None:
    """The first cache file for ``key`` that verifies and loads; bad ones are deleted."""
    for path in sorted(cache_dir.glob(f"{key}.*.onnx")):
        session = _try_cached(path, providers, fresh)
        if session is not None:
            return session
        path.unlink(missing_ok=True)
    return None


def _try_cached(path: Path, providers: list[str],
                fresh: OptionsFactory) -> ort.InferenceSession | None:
    """A session from an already-optimised graph, so optimisation is off; None if unusable.

    A truncated protobuf can still parse, so the digest, not ORT, is the corruption check.
    """
    data = path.read_bytes()
    if _sha256(data) != path.name.split(".")[1]:
        logger.warning("optimised-model cache file %s is corrupt; rebuilding it", path)
        return None
    options = fresh()
    options.graph_optimization_level = _LEVELS["disabled"]
    try:
        return ort.InferenceSession(data, options, providers=providers)
    except Exception as error:
        logger.warning("optimised-model cache file %s does not load (%s); rebuilding it",
                       path, error)
        return None


def _build_and_store(path: Path, model: bytes, providers: list[str], fresh: OptionsFactory,
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
    """Rename into place under its content digest, then drop older files for the key."""
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
