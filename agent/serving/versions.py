"""One served version of a model: its sessions, its tensor specs, the scheduler its calls
queue on, and its statistics.

A version is built once (build.py) and never changed afterwards, apart from its counters,
its last probe and the QoS controller's levers that need no new sessions (the instant ones,
and the CPUs its threads run on); a request holds the version it started on until it ends,
and a version the registry drops is closed (its queue drained, its workers gone), so a swap
never pulls a session from under a queued or running call.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from agent.inference.backends import Backend
from agent.inference.loop import all_finite
from agent.inference.stats import LatencyStats
from agent.serving.batching import signature
from agent.serving.core import DATATYPES, InferRequest, InferResult, Tensor, TensorSpec
from agent.serving.counters import Counters
from agent.serving.errors import ServeError, invalid
from agent.serving.levers import LeverChange, retuned, view
from agent.serving.pending import Pending, Retired
from agent.serving.placement import Scheduling, spinning_workers, worker_tids
from agent.serving.policy import SchedulePolicy
from agent.serving.scheduler import Scheduler
from agent.serving.settings import Instance, ModelSettings
from agent.serving.tensors import ORT_DATATYPES, check_inputs, element_count, ort_message

# Triton's default for ONNX models whose every input has a dynamic first dimension
# (its ONNX autocomplete); 0 (no batch dimension) otherwise.
AUTO_MAX_BATCH_SIZE = 4
# The most elements one input of a request may hold when it has dynamic dimensions besides
# the batch one and config.yaml sets no max_input_elements: a 1080p RGB frame (6.2 M) fits,
# a [1, 3, 2000, 2000] tensor (12 M, 46 MB; its run took ~1 GB) does not.  Per request, not
# per row: a model exported with dynamic batch *and* H/W batches by default, and four such
# rows would let the report's request through.
DYNAMIC_INPUT_ELEMENTS = 1 << 23
RELEASE_WAIT_S = 60.0  # a dropped version's queued runs finish before its backends go
# what each instance's statistics say of its backend: the status and Prometheus labels
INSTANCE_KEYS = ("backend", "device", "precision", "providers")
logger = logging.getLogger(__name__)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _specs(args: Sequence[Any]) -> tuple[TensorSpec, ...]:
    return tuple(TensorSpec(arg.name, ORT_DATATYPES.get(arg.type, arg.type),
                            tuple(d if isinstance(d, int) and d >= 0 else -1
                                  for d in arg.shape)) for arg in args)


def max_batch_size(settings: ModelSettings, inputs: Sequence[TensorSpec]) -> int:
    """The configured size, else Triton's autocomplete default; ValueError when a size above
    0 is configured for a model whose inputs have no dynamic first dimension."""
    batching = bool(inputs) and all(spec.shape and spec.shape[0] == -1 for spec in inputs)
    if settings.max_batch_size is None:
        return AUTO_MAX_BATCH_SIZE if batching else 0
    if settings.max_batch_size > 0 and not batching:
        fixed = next(s for s in inputs if not s.shape or s.shape[0] != -1)
        raise ValueError(f"max_batch_size {settings.max_batch_size} needs a dynamic first "
                         f"dimension in every input; input {fixed.name} has "
                         f"{list(fixed.shape)}")
    return settings.max_batch_size


def input_caps(inputs: Sequence[TensorSpec], max_batch: int,
               configured: int | None) -> dict[str, int]:
    """The most elements each input of one request may hold: config.yaml's
    ``max_input_elements``, else the input's static shape with the batch dimension at
    ``max_batch``, else DYNAMIC_INPUT_ELEMENTS for an input with other dynamic
    dimensions."""
    caps = {}
    for spec in inputs:
        dims = spec.shape[1:] if max_batch and spec.shape else spec.shape
        if configured is not None:
            caps[spec.name] = configured
        elif all(dim >= 0 for dim in dims):
            caps[spec.name] = max(1, max_batch) * math.prod(dims)
        else:
            caps[spec.name] = DYNAMIC_INPUT_ELEMENTS
    return caps


def version_key(path: Path, digest: str, settings: ModelSettings, threads: int | None = None
                ) -> object:
    """What makes a loaded version "unchanged" for a later load: the same file and the same
    settings its sessions, limits and queue were built with (a change to dynamic_batching
    alone, a tuned queue delay, builds the version anew: its queue's policy is built with
    it), and the threads lever (rebuild.py), so a load puts config.yaml's back.  Not its
    CPUs: a load unpins an unchanged version where it is (``set_levers``)."""
    return (path, digest, settings.instances, settings.providers, settings.max_batch_size,
            settings.precision, settings.max_run_ms, settings.max_input_elements,
            settings.dynamic_batching, threads)


def synthetic(specs: Sequence[TensorSpec]) -> tuple[Tensor, ...]:
    """Inputs shaped from the specs (dynamic dimensions 1): a probe needs a call the model
    accepts, not meaningful data."""
    tensors = []
    for spec in specs:
        dtype = DATATYPES.get(spec.datatype)
        if dtype is None:
            raise ValueError(f"input {spec.name}: datatype {spec.datatype} cannot be probed")
        shape = tuple(1 if dim < 0 else dim for dim in spec.shape)
        fill = 0.5 if dtype.kind == "f" else 0
        tensors.append(Tensor(spec.name, np.full(shape, fill, dtype=dtype)))
    return tuple(tensors)


class Version:
    """A model version that serves: built by ``build``, then read-only but for its figures
    and the levers that need no new sessions (``set_levers``).

    Requests go through its scheduler (one queue, a worker per session); the background
    probe goes around it, straight to a session, so a full queue never reads as a broken
    version.
    """

    def __init__(self, model: str, number: int, path: Path, digest: str,
                 instances: Sequence[tuple[Instance, Backend]],
                 settings: ModelSettings,
                 worker_start: Callable[[], None] | None = None, *,
                 configured: Sequence[int | None] = (), threads: int | None = None) -> None:
        """``instances``: each backend with the instance (config.yaml) it was built for;
        one queue feeds them all, whatever device each runs on.  ``configured``: each
        session's threads as config.yaml gives them (None: the factory's choice);
        ``threads``: the lever it was built with (None: config.yaml's).  Its threads run
        on any CPU until ``place``."""
        self.model, self.number, self.path, self.digest = model, number, path, digest
        self.instances = tuple(instances)
        self.sessions = tuple(backend for _, backend in self.instances)
        first = self.sessions[0]
        self.inputs = _specs(first.get_inputs())
        self.outputs = _specs(first.get_outputs())
        self.output_names = tuple(spec.name for spec in self.outputs)
        self.max_batch_size = max_batch_size(settings, self.inputs)
        self.max_elements = input_caps(self.inputs, self.max_batch_size,
                                       settings.max_input_elements)
        self.policy = SchedulePolicy.of(settings, self.max_batch_size)
        self.key = version_key(path, digest, settings, threads)
        self.threads: int | None = threads
        self.cpus: tuple[int, ...] | None = None
        self.realtime = False  # its threads lifted to SCHED_FIFO (the realtime lever)
        self._lifter: Scheduling | None = None  # what lifted them, to put them back on close
        self._lift_lock = threading.Lock()  # a lift, a put-back and close, one at a time
        self._lift_refused, self._closed = "", False  # a lift the kernel refused; closing
        self._spins = spinning_workers(self.instances)  # its sessions' options never change
        self.configured_threads = max((n for n in configured if n), default=None)
        self.stats = LatencyStats()
        self.counters = Counters(len(self.sessions))
        self.probe_error = ""  # the last probe's failure; "" : it passed
        self.canary = False  # while judged: a non-finite output counts as an error
        self._turn = itertools.count()
        self._record_lock = threading.Lock()
        self.scheduler = Scheduler(self.label, f"infer-{model}", self.sessions,
                                   self.output_names, self.policy, self.counters,
                                   worker_start, self._probe, max_run_ms=settings.max_run_ms)

    @property
    def label(self) -> str:
        return f"model {self.model} version {self.number}"

    def probe(self) -> str:
        """One call on synthetic inputs: "" when it ran, else why not."""
        return self._probe(self.sessions[next(self._turn) % len(self.sessions)])

    def _probe(self, session: Any) -> str:
        try:
            feeds = {t.name: t.array for t in synthetic(self.inputs)}
            session.run(list(self.output_names), feeds)
        except Exception as error:  # any failure is the probe's answer
            return ort_message(error)
        return ""

    def check_elements(self, name: str, shape: Sequence[Any]) -> None:
        """INVALID_ARGUMENT when input ``name`` of this shape would hold more elements than
        the version takes (``max_elements``), or a dimension alone is larger: for the front
        ends to call with a request's declared shape *before* decoding its tensor, and for
        ``infer`` as the backstop."""
        cap = self.max_elements.get(name)
        if cap is None:
            raise invalid(f"model {self.model} has no input {name!r} (its inputs: "
                          f"{', '.join(self.max_elements)})")
        count = element_count(name, shape)
        if count > cap:
            raise invalid(f"input {name}: shape {list(shape)} holds {count} elements, above "
                          f"the {cap} {self.label} takes for it (config.yaml "
                          "max_input_elements)")
        if any(dim > cap for dim in shape):
            raise invalid(f"input {name}: shape {list(shape)} has a dimension above the "
                          f"{cap} elements {self.label} takes for it (config.yaml "
                          "max_input_elements)")

    def infer(self, request: InferRequest, privileged_priority: int = 0) -> InferResult:
        """Check a request, queue it and wait for its run; every call counted, ok or not.
        ``privileged_priority``: serve.privileged_priority (policy.level)."""
        start = time.perf_counter_ns()
        try:
            item = self._pending(request, privileged_priority)
            arrays = self.scheduler.submit(item)
        except Retired:
            raise  # not this version's call: the registry sends it on
        except Exception:
            self._record(start, ok=False, failed=True)
            raise
        outputs = tuple(Tensor(name, arrays[name]) for name in item.outputs)
        # under a canary a non-finite output is an error of the version, though the client
        # still gets what it computed
        self._record(start, ok=not self.canary or all_finite([t.array for t in outputs]))
        return InferResult(self.model, str(self.number), request.id, outputs)

    def _record(self, start: int, ok: bool, failed: bool = False) -> None:
        end = time.perf_counter_ns()
        if failed:
            self.counters.failed(end - start)
        with self._record_lock:  # LatencyStats records from one thread at a time
            self.stats.call_started(start)
            self.stats.record(end - start, ok)

    def _pending(self, request: InferRequest, privileged: int) -> Pending:
        """The request checked against the model and the queue's policy, ready to queue."""
        check_inputs(self.model, self.inputs, request.inputs)
        rows = self._batch(request.inputs)
        for tensor in request.inputs:
            self.check_elements(tensor.name, tensor.array.shape)
        names = tuple(out.name for out in request.outputs) or self.output_names
        for index, name in enumerate(names):
            if name not in self.output_names:
                raise invalid(f"{self.label} has no output {name!r} (its outputs: "
                              f"{', '.join(self.output_names)})")
            if name in names[:index]:
                raise invalid(f"output {name} is asked for twice")
        key = signature(request.inputs) if self.policy.batching else ()  # runs alone
        level = self.policy.level(request.parameters, request.trusted, privileged)
        return Pending(request.inputs, names, rows, level, key,
                       self.policy.timeout(request.parameters))

    def _batch(self, inputs: Sequence[Tensor]) -> int:
        """The batch size the request carries (1 without a batch dimension)."""
        if self.max_batch_size == 0:
            return 1
        sizes = {t.name: int(t.array.shape[0]) for t in inputs}
        if len(set(sizes.values())) > 1:
            raise invalid(f"{self.label}: inputs disagree on the batch size ("
                          + ", ".join(f"{n}: {s}" for n, s in sizes.items()) + ")")
        batch = next(iter(sizes.values()), 1)
        if batch > self.max_batch_size:
            raise invalid(f"{self.label}: batch size {batch} is above its max_batch_size "
                          f"{self.max_batch_size}")
        return batch

    def set_levers(self, change: LeverChange | None, sched: Scheduling | None = None
                   ) -> dict[str, Any]:
        """The QoS controller's levers but threads, live (levers.py), or config.yaml's
        (None: a load serves the file's); the levers now served.  ``sched``: how the
        threads are pinned and lifted (None: where they are, whatever the change's ``cpus``
        and ``realtime``).  ``policy`` stays config.yaml's."""
        queue = self.scheduler.queue
        policy = self.policy if change is None else retuned(queue.policy, change, self.label)
        if sched is not None and (change is None or change.lift):
            self.lift(change is not None and change.realtime, sched)  # refused: no change
        queue.retune(policy)
        if change is None or change.admit:
            self.scheduler.admission.set_rate(None if change is None else change.admit_rps)
        cpus = None if change is None else change.cpus
        moved = change is None or (change.place and not change.rebuilds)
        if sched is not None and moved and cpus != self.cpus:
            self.place(cpus, sched)
        return self.levers()

    def place(self, cpus: tuple[int, ...] | None, sched: Scheduling) -> None:
        """The ``cpus`` lever, in place (placement.py): the threads that compute its runs
        (its scheduler's workers, its sessions' intra-op workers) pinned to ``cpus``, or
        back to the profile's (None), and its runs kept off the front ends' threads while
        placed (a placed model runs on its pinned workers only).  No new sessions: the
        kernel moves the threads at once, where a rebuild took a quarter of a second of CPU
        from the models it was meant to help."""
        self.scheduler.inline = False  # no run starts on an unpinned caller meanwhile
        sched.place([*self.scheduler.tids(), *worker_tids(self.instances)], cpus)
        self.cpus = cpus
        self.scheduler.inline = cpus is None

    @property
    def liftable(self) -> bool:
        """Whether ``realtime`` is a lever here: not where workers spin or the kernel refused."""
        return not self._lift_refused and not self._spins

    def lift(self, on: bool, sched: Scheduling) -> None:
        """The ``realtime`` lever (placement.py): the threads that compute its runs at
        SCHED_FIFO, or back to the profile's scheduling.  FAILED_PRECONDITION for a version
        whose workers spin, or where the kernel refuses a thread (those lifted are put
        back: the lever is all or nothing)."""
        with self._lift_lock:
            if on == self.realtime or (on and self._closed):
                return
            if on and self._lift_refused:
                raise ServeError("FAILED_PRECONDITION", self._lift_refused)
            if on and not self.liftable:
                raise ServeError("FAILED_PRECONDITION", f"{self.label}: its intra-op workers "
                                 "spin between a run's ops, which no real-time thread may: "
                                 "realtime needs threads 1, or sessions built under a "
                                 "real-time rt.inference (no spinning)")
            tids = [*self.scheduler.tids(), *worker_tids(self.instances)]
            refused = sched.lift(tids, on)
            if refused and on:
                sched.lift(tids, False)
                self._lift_refused = (f"{self.label}: realtime refused: {refused[0]} (needs "
                                      "CAP_SYS_NICE or RLIMIT_RTPRIO)")
                raise ServeError("FAILED_PRECONDITION", self._lift_refused)
            self.realtime, self._lifter = on, sched if on else None

    def levers(self) -> dict[str, Any]:
        """The levers served now: the instant ones, the sessions' intra-op threads (the
        most, where instances differ), the CPUs its threads are pinned to (None: any) and
        whether they are lifted (None: not a lever for it)."""
        return view(self.scheduler.queue.policy, self.scheduler.admission) | {
            "threads": max(backend.intra_op for backend in self.sessions),
            "cpus": None if self.cpus is None else list(self.cpus),
            "realtime": self.realtime if self.liftable else None}

    def close(self) -> None:
        """Stop taking requests; the queued ones are still served, then the workers exit
        and the backends are released (an NPU context is not freed under a run).  Lifted
        threads are put back first: the front ends stay lifted only while a served model
        is."""
        with self._lift_lock:
            self._closed = True
            if self._lifter is not None:  # what lifted them puts them back
                self._lifter.lift([*self.scheduler.tids(), *worker_tids(self.instances)], False)
            self.realtime, self._lifter = False, None
        self.scheduler.close()
        threading.Thread(target=self._release, name=f"release-{self.model}",
                         daemon=True).start()

    def _release(self) -> None:
        self.scheduler.join(RELEASE_WAIT_S)
        for backend in self.sessions:
            try:
                backend.close()
            except Exception as error:  # one backend's release must not keep the others
                logger.warning("%s: releasing %s failed: %s", self.label, backend.device,
                               error)

    @property
    def closed(self) -> bool:
        return self.scheduler.queue.closed

    def stuck(self) -> bool:
        """Whether a run was cancelled and has not come back within the grace (scheduler):
        the runtime no longer answers.  A merely slow run is cancelled, not stuck."""
        return self.scheduler.stuck()

    def statistics(self) -> dict[str, Any]:
        """Triton's model_stats entry, plus ours under ``edge_agent``."""
        entry: dict[str, Any] = {"name": self.model, "version": str(self.number)}
        entry.update(self.counters.view())
        queue = self.scheduler.queue
        entry["edge_agent"] = {
            "snapshot": self.stats.snapshot(),
            "window": self.stats.window().to_dict(),  # the control plane's guards compare it
            "stuck": self.stuck(),
            "providers": list(self.instances[0][1].providers),
            "threads": [backend.intra_op for _, backend in self.instances],
            "instances": [figures | {key: described.get(key) for key in INSTANCE_KEYS}
                          for figures, described in zip(
                              self.counters.instances(),
                              (backend.describe() for backend in self.sessions),
                              strict=True)],
            "cancelled": self.scheduler.cancelled,  # runs cut short at their deadline
            "max_run_ms": self.scheduler.max_run_ms,
            "queue": {"depth": queue.depth, "max_size": self.policy.max_queue,
                      "full": queue.refused, "shed": queue.shed, "expired": queue.expired,
                      "wait_ms": self.counters.queue_snapshot()["latency_ms"],
                      "window": self.counters.queue_window()},
            "sha256": self.digest,
            "levers": self.levers(),
            # config.yaml's, which a relaxation or a reload returns to
            "configured": view(self.policy) | {"threads": self.configured_threads,
                                               "cpus": None,
                                               "realtime": False if self.liftable else None},
        }
        return entry

