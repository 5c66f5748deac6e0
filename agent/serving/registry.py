"""The model registry: the repository's models as the protocol serves them (core.Models).

Model control is Triton's "explicit" mode: every model loads at ``start`` and later only on
``load``/``unload``.  A load builds and probes the versions it needs beside what serves, then
replaces the model's served set in one assignment, so a request in flight finishes on the
version it started on and none fails because of the load; a load that fails changes nothing
that serves.  Loads and unloads of one model run one at a time (its lock in ``_locks``);
requests, the index and the probe take no lock of the registry's.

The first round loads the models in the background (``start_loading``, loading.load_in_turn);
the front ends answer meanwhile, and the server is ready once the round finished.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import agent
from agent.inference.errors import SessionError
from agent.inference.model_files import model_sha256
from agent.serving import canary as canaries
from agent.serving.build import SessionFactory, build
from agent.serving.core import (
    IndexEntry,
    InferRequest,
    InferResult,
    ModelConfigView,
    ModelMetadata,
)
from agent.serving.errors import ServeError, invalid, not_found, unavailable
from agent.serving.levers import LeverChange
from agent.serving.loading import load_in_turn
from agent.serving.pending import Retired
from agent.serving.placement import Scheduling, Unscheduled
from agent.serving.probe import Prober
from agent.serving.rebuild import Rebuilds, Target, rebuilt, set_all
from agent.serving.repository import (
    BUILTIN_VERSION,
    CONFIG_FILE,
    ModelEntry,
    scan,
    scan_model,
    valid_name,
)
from agent.serving.settings import ModelSettings, instances_problem
from agent.serving.state import Served, Slot, config_view, index_rows, swap, versions_of
from agent.serving.versions import Version, version_key

logger = logging.getLogger(__name__)

STOP_WAIT_S = 5.0  # stop waits this long for a model's load, which then installs nothing
LOAD_ALONE_S = 30.0  # a first load taking longer has the next model start beside it

EXTENSIONS = ["binary_tensor_data", "model_repository", "model_configuration", "parameters",
              "statistics", "system_shared_memory"]


class ModelRegistry:
    def __init__(self, repository: Path, builtins: Mapping[str, Path], factory: SessionFactory,
                 *, probe_interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Any] | None = None,
                 canary_p99_floor_ms: float = 1.0,
                 pins: Mapping[str, str] | None = None,
                 intra_op_threads: int | None = None,
                 worker_start: Callable[[], None] | None = None,
                 device_problem: Callable[[str], str | None] | None = None,
                 privileged_priority: int = 0,
                 load_alone_s: float = LOAD_ALONE_S,
                 sched: Scheduling | None = None) -> None:
        """``clock``/``sleep`` pace a canary (tests inject their own); ``sleep`` defaults to
        a wait that ``stop`` cuts short.  ``intra_op_threads``: the CPUs the profile gives
        inference (one intra-op thread each, options.thread_plan; None: this process's
        CPUs), shared out among a version's instances (build.py) and bounding their
        threads in all (settings.check_threads); ``worker_start`` runs on every worker
        thread as it starts; ``device_problem`` says why an instance's device is not on
        this board (devices.device_problem over the discovered topology; None: every device
        goes); ``privileged_priority``: serve.privileged_priority (policy.level; 0: every
        level is open, as in a registry without front ends); ``sched``: how the ``cpus``
        and ``realtime`` levers pin and lift threads (the server's keeps both through a
        profile switch; None: ``Unscheduled``)."""
        bad = [name for name in builtins if not valid_name(name)]
        if bad:
            raise ValueError(f"built-in model names {bad} are not valid model names")
        self.repository = repository
        self.builtins = dict(builtins)
        self.pins = dict(pins or {})  # a built-in's pinned sha256
        self.factory = factory
        self._intra_op_threads = intra_op_threads
        self._cpus = intra_op_threads or len(os.sched_getaffinity(0))
        self._privileged = privileged_priority
        self._device_problem = device_problem
        self._worker_start = worker_start
        self._sched = sched or Unscheduled()
        self._rebuilds = Rebuilds(self._rebuild)
        self._stopping = threading.Event()
        self._clock = clock
        self._sleep = sleep or self._stopping.wait
        self._p99_floor_ms = canary_p99_floor_ms
        self._slots: dict[str, Slot] = {}
        self._load_lock = threading.Lock()  # guards ``_locks``
        self._locks: dict[str, threading.Lock] = {}  # model -> its loads and unloads
        self._started = False  # the first load round finished
        self._loaded = threading.Event()
        self._load_alone_s = load_alone_s
        self._prober = Prober(probe_interval_s, self._served_versions, self._stopping)

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Load every model of the repository and the built-ins, and return once they all
        finished; one that fails is listed with its reason and the others serve."""
        self.start_loading()
        self._loaded.wait()

    def start_loading(self) -> None:
        """Scan the repository and load its models in the background (see the module);
        the server is ready once all of them finished (``wait_loaded``), each model once it
        serves."""
        entries = scan(self.repository, self.builtins, self.pins)
        for name in entries:
            slot = self._slots.setdefault(name, Slot(name))
            if slot.served is None:
                slot.loading, slot.reason = (0,), "loading"
        threading.Thread(target=self._first_round, args=(entries,), name="load-round",
                         daemon=True).start()
        self._prober.start()

    def _first_round(self, entries: Mapping[str, ModelEntry]) -> None:
        load_in_turn(entries, self._first_load, self._load_alone_s, self._stopping)
        self._started = True
        self._loaded.set()
        logger.info("first load round done: serving %s", ", ".join(
            e.name for e in self.index(ready_only=True)) or "nothing")

    def _first_load(self, name: str, entry: ModelEntry) -> None:
        with self._lock(name):
            try:
                self._load(self._slots[name], entry, None)
            except ServeError as error:
                logger.warning("%s", error.message)
            except Exception as error:  # a loader thread's end must not hide the reason
                slot = self._slots[name]
                slot.failed, slot.loading = {0: f"{type(error).__name__}: {error}"}, ()
                slot.reason = slot.failed[0]
                logger.exception("model %s: load failed", name)

    def wait_loaded(self, timeout_s: float | None = None) -> bool:
        """Whether the first load round finished (within ``timeout_s``)."""
        return self._loaded.wait(timeout_s)

    def _lock(self, name: str) -> threading.Lock:
        with self._load_lock:
            return self._locks.setdefault(name, threading.Lock())

    def stop(self) -> None:
        self._stopping.set()
        self._prober.join()
        self._started = False
        deadline = time.monotonic() + STOP_WAIT_S  # for all loads together
        for name, slot in list(self._slots.items()):
            lock = self._lock(name)
            held = lock.acquire(timeout=max(0.0, deadline - time.monotonic()))
            if not held:  # a load that hangs: it installs nothing once it ends (_load)
                logger.warning("model %s: still loading at stop", name)
            try:
                served = slot.served
                swap(slot, None)
                slot.reason = "the server stopped"
                for version in served.versions.values() if served is not None else ():
                    version.scheduler.join(5.0)
            finally:
                if held:
                    lock.release()

    def probe_now(self) -> None:
        """One probe round now, as the background thread runs every probe_interval_s."""
        self._prober.run_once()

    def _served_versions(self) -> Iterator[Version]:
        for slot in list(self._slots.values()):
            served = slot.served
            if served is not None:
                yield from served.versions.values()

    def executions(self) -> int:
        """Runs so far of the versions serving now: the data plane's sign of activity."""
        return sum(version.counters.execution_count for version in self._served_versions())

    # -- model control ---------------------------------------------------------------------

    def load(self, name: str, parameters: Mapping[str, Any]) -> None:
        limits = canaries.parse_load_parameters(parameters, self._p99_floor_ms)
        with self._lock(name):
            entry = scan_model(self.repository, self.builtins, name, self.pins)
            if entry is None:
                raise not_found(f"model {name!r} is not in the repository {self.repository}")
            slot = self._slots.setdefault(name, Slot(name))
            self._load(slot, entry, limits)

    def _load(self, slot: Slot, entry: ModelEntry, limits: canaries.CanaryLimits | None) -> None:
        """Build what the policy wants that does not serve yet, then swap (or canary)."""
        name = slot.name
        if not entry.error:
            entry = self._check_instances(entry)
        if entry.error:
            slot.failed, slot.loading = {0: entry.error}, ()
            if slot.served is None:
                slot.reason = entry.error
            raise invalid(f"model {name}: {entry.error}")
        old = slot.served
        wanted = entry.wanted()
        versions: dict[int, Version] = {}
        to_build = []
        for number, path in wanted.items():
            current = old.versions.get(number) if old is not None else None
            if current is not None and current.key == self._key(name, number, path, entry):
                versions[number] = current  # unchanged: keeps its sessions and figures
                current.set_levers(None, self._sched)  # but serves the file's levers
            else:
                to_build.append(number)
        slot.loading = tuple(to_build)
        try:
            for number in to_build:
                versions[number] = self._build(name, number, wanted[number], entry.settings)
        except ServeError as error:
            for built in to_build[:to_build.index(number)]:
                versions[built].close()
            slot.failed, slot.loading = {number: error.message}, ()
            if old is None:
                slot.reason = error.message
            raise
        new = Served(versions, max(versions), entry.settings)
        slot.loading = ()
        if self._stopping.is_set():  # stop gave up waiting for this load: serve nothing
            for number in to_build:
                versions[number].close()
            slot.reason = "the server stopped"
            return
        if limits is not None and old is not None and old.default != new.default and (
                new.default in to_build):
            canaries.trial(slot, old, new, limits, self.infer, self._clock, self._sleep,
                           self._stopping)
        swap(slot, new, old)
        slot.failed, slot.reason = {}, ""
        logger.info("model %s serves versions %s (built %s)", name, sorted(versions),
                    to_build or "none")

    def _build(self, name: str, number: int, path: Path, settings: ModelSettings,
               threads: int | None = None, cpus: tuple[int, ...] | None = None) -> Version:
        return build(name, number, path, settings, self.factory,
                     intra_op_threads=self._intra_op_threads, worker_start=self._worker_start,
                     root=self._root(name, number), threads=threads, cpus=cpus,
                     sched=self._sched)

    def _rebuild(self, name: str, wanted: Target) -> None:
        """The ``threads`` lever's rebuild (rebuild.py), swapped in as a load is."""
        with self._lock(name):
            slot, old = self._slots[name], self._slots[name].served
            if old is None or self._stopping.is_set():
                raise unavailable(f"model {name} is not loaded ({slot.reason})")
            new = rebuilt(old, *wanted, lambda *args: self._build(name, *args), self._sched)
            if self._stopping.is_set():  # stop gave up waiting for it: install nothing
                swap(slot, slot.served, new)
                raise unavailable("the server stopped during the rebuild")
            swap(slot, new, old)
            logger.info("model %s serves with threads %s, cpus %s", name, *wanted)

    def _check_instances(self, entry: ModelEntry) -> ModelEntry:
        """The entry, or it with the error settings.instances_problem finds (threads beyond
        this node's inference CPUs, a device discovery did not find)."""
        problem = instances_problem(entry.settings, str(self.repository / entry.name /
                                                        CONFIG_FILE),
                                    self._cpus, self._device_problem)
        return entry if problem is None else dataclasses.replace(entry, error=problem)

    def _root(self, name: str, number: int) -> Path | None:
        """Where a version's model file must lie: the repository, or anywhere for a
        built-in (the operator's file, served in place)."""
        return None if name in self.builtins and number == BUILTIN_VERSION else self.repository

    def _key(self, name: str, number: int, path: Path, entry: ModelEntry) -> object:
        try:
            digest = model_sha256(path, root=self._root(name, number))
        except SessionError as error:
            raise invalid(f"model {name} version {number}: {error}") from None
        return version_key(path, digest, entry.settings)

    def unload(self, name: str, parameters: Mapping[str, Any]) -> None:
        with self._lock(name):
            slot = self._slot(name)
            swap(slot, None)
            slot.failed, slot.loading, slot.reason = {}, (), "unloaded"
            logger.info("model %s unloaded", name)

    # -- requests --------------------------------------------------------------------------

    def live(self) -> bool:
        return True

    def ready(self) -> bool:
        if not self._started or self._stopping.is_set():
            return False
        return all(slot.served.ready for slot in list(self._slots.values())
                   if slot.served is not None)

    def server_metadata(self) -> dict[str, Any]:
        return {"name": "edge-agent", "version": agent.__version__,
                "extensions": list(EXTENSIONS)}

    def _slot(self, name: str) -> Slot:
        """The model's slot (made for one the repository holds but never loaded);
        NOT_FOUND when neither the repository nor the built-ins hold it."""
        slot = self._slots.get(name)
        if slot is not None:
            return slot
        if scan_model(self.repository, self.builtins, name, self.pins) is None:
            raise not_found(f"unknown model {name!r}")
        return self._slots.setdefault(name, Slot(name))

    def _served(self, name: str) -> Served:
        slot = self._slot(name)
        served = slot.served
        if served is None:
            raise unavailable(f"model {name} is not loaded ({slot.reason})")
        return served

    def model_ready(self, name: str, version: str) -> bool:
        """NOT_FOUND for an unknown model, or a version that does not serve."""
        served = self._slot(name).served
        if served is None:
            return False
        if version == "":
            return served.ready
        return not served.pick(name, version).probe_error

    def model_metadata(self, name: str, version: str) -> ModelMetadata:
        served = self._served(name)
        found = served.pick(name, version)
        return ModelMetadata(name, tuple(str(n) for n in sorted(served.versions)),
                             found.inputs, found.outputs)

    def model_config(self, name: str) -> ModelConfigView:
        return config_view(name, self._served(name))

    def infer(self, request: InferRequest) -> InferResult:
        """On the version that serves the request; one dropped between the look-up and the
        submit (a swap) hands the request to its successor, so a swap fails no request."""
        while True:
            found = self._served(request.model).pick(request.model, request.version)
            if found.probe_error:
                raise unavailable(f"{found.label} is not ready: probe failed: "
                                  f"{found.probe_error}")
            try:
                return found.infer(request, self._privileged)
            except Retired:
                continue  # the look-up now finds what serves, or says why nothing does

    def check_elements(self, model: str, version: str, name: str,
                       shape: Sequence[Any]) -> None:
        """For a front end, with an input's declared shape before it decodes the tensor:
        INVALID_ARGUMENT when the version that would serve the request takes fewer
        elements for that input (Version.check_elements); NOT_FOUND / UNAVAILABLE as
        ``infer`` answers them.  ``infer`` checks again (the backstop)."""
        self._served(model).pick(model, version).check_elements(name, shape)

    def index(self, ready_only: bool) -> list[IndexEntry]:
        entries = scan(self.repository, self.builtins, self.pins)
        rows = []
        for name in sorted(set(entries) | set(self._slots)):
            rows.extend(index_rows(name, self._slots.get(name), entries.get(name)))
        return [row for row in rows if row.state == "READY"] if ready_only else rows

    def statistics(self, name: str, version: str) -> list[dict[str, Any]]:
        slots = ({n: self._slots[n] for n in sorted(self._slots)} if not name
                 else {name: self._slot(name)})
        entries = []
        for n, slot in slots.items():
            for found in versions_of(slot, n, version if name else ""):
                entry = found.statistics()
                entry["edge_agent"]["rebuild"] = self._rebuilds.view(n)
                entries.append(entry)
        return entries

    def set_levers(self, name: str, change: LeverChange) -> dict[str, Any]:
        """The QoS controller's levers on each serving version: ``{version: levers}``; a
        ``threads`` one starts a rebuild (rebuild.py, with the request's ``cpus``) and
        serves once it swapped, ``cpus`` alone moves the versions' threads at once."""
        with self._rebuilds.guarding(name, self._served(name), change, self._cpus):
            served = self._served(name)  # a rebuild may have swapped in before the guard
            set_all(list(served.versions.values()), change, self._sched)
            return {str(n): v.levers() for n, v in sorted(served.versions.items())}
