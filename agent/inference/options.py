"""How the ONNX Runtime session runs: its thread pools, sized from the board's CPUs, and its
session options (execution mode, graph optimisation level, spinning).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import onnxruntime as ort

from agent.discovery.model import Topology
from agent.inference.errors import SessionError
from agent.kernel.sched import ThreadSched, is_realtime

GraphOptimization = Literal["disabled", "basic", "extended", "all"]

_LEVELS = {
    "disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}
_SPINNING_KEY = "session.intra_op.allow_spinning"
_SPINNING_STOP_KEY = "session.force_spinning_stop"


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


def session_options(intra_op: int, inter_op: int, graph_optimization: GraphOptimization = "all",
                    allow_spinning: bool | None = None,
                    stop_spinning_after_run: bool = False,
                    memory_arena: bool = True) -> ort.SessionOptions:
    """Sequential execution with explicit pools; spinning stays ORT's default unless set.

    Spinning trades idle CPU for wake-up latency: turn it off where inference shares cores.
    ``stop_spinning_after_run`` keeps the spin between a run's ops (without it each parallel
    op waits for a sleeping worker to wake: 0.5-2 ms a MobileNetV3 run on a busy 2-core box)
    but not past the run, where a server's front ends and clients need the cores.
    ``memory_arena=False``: activations come from the C allocator rather than ORT's arena,
    which never gives back what its largest batch took; then without ORT's memory pattern
    too, which takes all of a run's activations as one block per run: for a batch of 8
    images that block is beyond glibc's largest mmap threshold, so it was mapped afresh
    every run (1254 page faults, 5 MB, a MobileNetV3 batch-8 run), where tensor by tensor
    they come from the heap the data plane keeps (no faults, no slower at batch 1 or 8).
    """
    options = ort.SessionOptions()
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.intra_op_num_threads = intra_op
    options.inter_op_num_threads = inter_op
    options.graph_optimization_level = optimisation_level(graph_optimization)
    if allow_spinning is not None:
        options.add_session_config_entry(_SPINNING_KEY, "1" if allow_spinning else "0")
    if stop_spinning_after_run:
        options.add_session_config_entry(_SPINNING_STOP_KEY, "1")
    options.enable_cpu_mem_arena = memory_arena
    options.enable_mem_pattern = memory_arena
    return options


def spinning_for(sched: ThreadSched | None) -> bool | None:
    """``allow_spinning`` for sessions whose threads get ``sched``: off for SCHED_FIFO/RR.

    ORT's intra-op workers busy-wait for the next op by default; a real-time one that spins
    never yields its CPU to anything of lower priority (kernel threads included), and with
    ``sched_rt_runtime_us: -1`` nothing throttles it (Documentation/scheduler/
    sched-rt-group.rst).  None keeps ORT's default."""
    return False if sched is not None and is_realtime(sched) else None


def session_spins(session: ort.InferenceSession) -> bool:
    """Whether a built session's intra-op workers spin (ORT's default when unset)."""
    try:
        entry = session.get_session_options().get_session_config_entry(_SPINNING_KEY)
        return str(entry) != "0"
    except RuntimeError:  # never set: ORT's default, which spins
        return True


def optimisation_level(graph_optimization: str) -> ort.GraphOptimizationLevel:
    """The ORT enum for a profile's level name; a typo is a configuration error."""
    if graph_optimization not in _LEVELS:
        raise SessionError(f"unknown graph optimisation {graph_optimization!r}; "
                           f"choose one of {list(_LEVELS)}")
    return _LEVELS[graph_optimization]
