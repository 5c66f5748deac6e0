"""The data plane process: the registry behind its front ends, until SIGTERM.

One process, so that the profile's cgroup limits, RT priorities and CPU affinity apply to
inference alone and a crash or OOM kill takes nothing else with it.  HTTP (aiohttp) runs on
this process's event loop, gRPC on its own thread pool; both hand inference to threads the
profile schedules (``threads``), as the local socket does (``local_listener``, a thread a
session).  Once they listen, the bound addresses go to the ready file
(port 0 takes a free port: tests and ``selftest``), which is how the supervisor finds them;
the models load after that, in the background, and the server is ready once they did.  An
address the front ends cannot take is one line naming the key, on stderr and in the error
file beside the ready file (the supervisor's ``degraded`` reason), and exit status 2.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.inference.backends import Backend
from agent.inference.backends.onnx import OnnxBackend
from agent.inference.options import spinning_for
from agent.inference.session import Building, build_session
from agent.kernel.process import freeze_long_lived, keep_freed_buffers, release_freed_memory
from agent.serving.access import Access, is_loopback
from agent.serving.budget import MemoryBudget, default_limit_bytes
from agent.serving.connections import (
    START_ERROR_FILE,
    AcceptErrors,
    address_in_use,
    raise_descriptor_limit,
)
from agent.serving.instances import Board
from agent.serving.local_listener import LocalListener, LocalListenError, LocalSettings
from agent.serving.registry import ModelRegistry
from agent.serving.shm import bounded_regions
from agent.serving.threads import InferenceThreads, read_sched_file
from agent.serving.tls import grpc_credentials, server_tls

if TYPE_CHECKING:
    from agent.discovery.model import Topology
    from agent.inference.provider_options import RuntimeVersions
    from agent.serving.frigate_api import FrigateFrontEnd
    from agent.serving.frigate_protocol import FrigateSettings
    from agent.serving.http_listener import HttpListener
    from agent.serving.metrics import MetricsServer

logger = logging.getLogger(__name__)

# Freed buffers up to this size stay in the heap while requests come (a batch of 8 images is
# 4.8 MB) and go back to the kernel once no run has started for IDLE_TRIM_S.
KEPT_BUFFER_BYTES = 32 << 20  # glibc's largest mmap threshold on 64-bit
IDLE_TRIM_S = 1.0


@dataclass(frozen=True)
class ServerSettings:
    """Everything the data plane needs, resolved from the config by its caller."""

    http: str  # host:port
    grpc: str
    repository: Path
    builtins: Mapping[str, Path]  # served in place as version 1 (the demo, inference.model)
    pins: Mapping[str, str]  # a built-in's sha256 (inference.sha256)
    token_files: Sequence[Path]
    max_request_bytes: int
    providers: Sequence[str]
    threads: tuple[int, int]  # intra-op, inter-op of a session
    cache_dir: Path | None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    sched_file: Path | None = None  # the profile's scheduling; read again on SIGHUP
    ready_file: Path | None = None
    metrics: str | None = None  # host:port of the Prometheus endpoint
    shm_prefix: str = "edge-agent-"  # system shared memory: the names it may open
    # requests a front end holds at once: they wait on the models' queues, which bound and
    # order them, so this is well above what runs at once
    workers: int = 64
    probe_interval_s: float = 10.0
    # the board as discovered: instances on devices other than ``auto`` need it, and it
    # gives TensorRT/OpenVINO their options and caches (None: every instance on providers)
    topology: Topology | None = None
    versions: RuntimeVersions | None = None
    state_dir: Path | None = None  # engine caches live under it
    available: Sequence[str] = ()  # onnxruntime.get_available_providers()
    building: Building | None = None  # a TensorRT build's "still going" (seconds so far)
    max_inflight_bytes: int | None = None  # None: from the device's memory (budget.py)
    privileged_priority: int = 1  # this level and higher need the token; 0: none do
    # the HTTP front end's connections (http_listener): None takes a quarter of the
    # descriptor limit; a request's head must be whole, and an idle connection's next one
    # begin, within these
    http_max_connections: int | None = None
    http_header_timeout_s: float = 5.0
    http_idle_timeout_s: float = 5.0
    local: LocalSettings | None = None  # the local front end (serve.local); None: off
    # startup's heap out of the cyclic collector's reach once the models load (the serve
    # process's own; a plane embedded in another process leaves its collector alone)
    freeze_heap: bool = False
    frigate: FrigateSettings | None = None  # serve.frigate: Frigate's zmq detector (off)


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def session_factory(settings: ServerSettings,
                    pool: InferenceThreads) -> Callable[..., Backend]:
    """Instances built like every other of this node (providers, threads, cache); ORT's
    intra-op workers join the inference threads.  They spin between a run's ops, not after
    it, where the front ends and the clients on this device need the cores
    (bench/serve.py: a MobileNetV3 run was 0.3-1.9 ms slower without the spin); under a
    realtime policy they do not spin at all, which a SCHED_FIFO thread's spin would turn
    into starving everything below it on its CPU.  A later switch to a realtime policy
    keeps sessions built before it (their spin still ends with each run).  Activations come
    from the C allocator, not ORT's arena: with the data plane's allocator policy they are
    reused as fast (bench/serve.py saw no difference at batch 1 or 8), and an idle data
    plane gives a burst's batch-8 activations back where the arena would keep them.

    An instance's device picks its backend and providers (provider_options.plan_instance);
    an ``auto`` instance without a discovered topology runs on ``settings.providers``."""

    board = None if settings.topology is None else Board(
        settings.topology, settings.available, settings.versions, settings.state_dir,
        settings.providers)

    def factory(path: Path, *, sha256: str | None, providers: Sequence[str] | None,
                threads: int | None, device: str = "auto",
                precision: str = "fp32") -> Backend:
        chosen: list[Any] = list(providers or settings.providers)
        compiles = False
        if board is not None:
            plan = board.plan(path, sha256, providers, device, precision)
            if plan.backend == "rknn":
                return board.rknn(path, device, precision)
            # options only where there are any: a CPU session is built as it always was
            chosen = [(name, options) if options else name for name, options in plan.providers]
            compiles, precision = plan.compiles, plan.precision
        elif device != "auto":
            raise ValueError(f"device {device}: this server was started without the "
                             "board's topology, so only device auto is served")
        built = build_session(path, providers=chosen, intra_op=threads or settings.threads[0],
                              inter_op=settings.threads[1], cache_dir=settings.cache_dir,
                              expected_sha256=sha256, allow_spinning=spinning_for(pool.wanted),
                              stop_spinning_after_run=True, memory_arena=False,
                              building=settings.building if compiles else None)
        pool.adopt(built.worker_tids)
        return OnnxBackend(built, device, precision)

    return factory


def _device_check(settings: ServerSettings) -> Callable[[str], str | None] | None:
    """Instance devices are checked against the board discovery found, when it did."""
    topology = settings.topology
    if topology is None:
        return None
    from agent.inference.devices import device_problem

    return lambda device: device_problem(device, topology)


def write_ready(path: Path, addresses: Mapping[str, str]) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps({"pid": os.getpid(), **addresses}))
    partial.replace(path)


class ListenError(Exception):
    """A front end cannot listen where the config says: the message names the key."""


def _listen_error(key: str, address: str, error: OSError) -> ListenError:
    message = address_in_use(key, address, error)
    return ListenError(message or f"{key} {address}: cannot listen there: "
                       f"{error.strerror or error}")


def _bind_problem(key: str, address: str) -> ListenError | None:
    """Why a plain socket cannot bind ``address`` (None: it can).  gRPC is asked only
    after this: it logs its own multi-line error and says only that the bind failed."""
    host, port = split_address(address)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            return _listen_error(key, address, error)
    return None


class DataPlane:
    """The registry, the executors and both front ends of one ``serve`` process."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.threads = InferenceThreads(read_sched_file(settings.sched_file))
        self.registry = ModelRegistry(settings.repository, settings.builtins,
                                      session_factory(settings, self.threads),
                                      probe_interval_s=settings.probe_interval_s,
                                      pins=settings.pins,
                                      intra_op_threads=settings.threads[0],
                                      worker_start=self.threads.adopt_current,
                                      device_problem=_device_check(settings),
                                      privileged_priority=settings.privileged_priority,
                                      sched=self.threads)
        everything = not (is_loopback(split_address(settings.http)[0])
                          and is_loopback(split_address(settings.grpc)[0]))
        self.access = Access(list(settings.token_files), everything=everything)
        self.regions = bounded_regions(settings.shm_prefix, settings.max_request_bytes)
        self.budget = MemoryBudget(settings.max_inflight_bytes or default_limit_bytes(
            settings.topology.memory.total_bytes if settings.topology else None,
            settings.max_request_bytes))
        self.http_pool = ThreadPoolExecutor(settings.workers, "infer-http",
                                            initializer=self.threads.adopt_front)
        self.grpc_pool = ThreadPoolExecutor(settings.workers, "infer-grpc",
                                            initializer=self.threads.adopt_front)
        self.grpc_server: Any = None
        self.http: HttpListener | None = None
        self.metrics: MetricsServer | None = None
        self.local: LocalListener | None = None
        self.frigate: FrigateFrontEnd | None = None
        self.addresses: dict[str, str] = {}
        self.accept_errors = AcceptErrors()
        self._trimmer: asyncio.Task[None] | None = None
        self._freezer: asyncio.Task[None] | None = None

    def resched(self) -> None:
        """SIGHUP: the supervisor wrote a new profile's scheduling."""
        self.threads.switch(read_sched_file(self.settings.sched_file))

    async def start(self) -> None:
        """Listen, say so in the ready file, then load the models in the background
        (ListenError: an address the front ends cannot take)."""
        loop = asyncio.get_running_loop()
        self.accept_errors.install(loop)
        await self._listen()
        names = self.accept_errors.listeners  # as the failed accept's socket names itself
        assert self.http is not None  # listening
        names.update({f"{a[0]}:{a[1]}": "serve.http" for a in self.http.addresses})
        if self.metrics is not None:
            names.update(dict.fromkeys(self.metrics.sockets, "serve.metrics"))
        self._trimmer = loop.create_task(self._trim_when_idle())
        if self.settings.ready_file is not None:
            write_ready(self.settings.ready_file, self.addresses)
        others = "".join(f", {label} {self.addresses[key]}" for key, label in
                         (("metrics", "metrics"), ("local", "local"), ("frigate", "Frigate"))
                         if key in self.addresses)
        logger.info("listening (HTTP %s, gRPC %s%s); loading the models",
                    self.addresses["http"], self.addresses["grpc"], others)
        await loop.run_in_executor(None, self.registry.start_loading)
        if self.settings.freeze_heap:
            self._freezer = loop.create_task(self._freeze_when_loaded())

    async def _listen(self) -> None:
        from agent.serving.grpc_api import build_grpc_server
        from agent.serving.http_api import make_app
        from agent.serving.http_listener import ConnectionLimits, HttpListener

        settings = self.settings
        tls = ((settings.tls_cert, settings.tls_key, settings.tls_client_ca)
               if settings.tls_cert and settings.tls_key else None)
        self.grpc_server = build_grpc_server(
            self.registry, self.access, max_request_bytes=settings.max_request_bytes,
            executor=self.grpc_pool, regions=self.regions, budget=self.budget)
        host, port = split_address(settings.grpc)
        target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        problem = _bind_problem("serve.grpc", settings.grpc)
        if problem is not None:
            raise problem
        try:
            bound = (self.grpc_server.add_secure_port(target, grpc_credentials(*tls))
                     if tls else self.grpc_server.add_insecure_port(target))
        except RuntimeError:  # grpcio >= 1.60 raises where older ones returned 0
            bound = 0
        if not bound:
            raise ListenError(f"serve.grpc {settings.grpc}: cannot listen there")
        self.grpc_server.start()
        self.addresses["grpc"] = f"{host}:{bound}"
        limits = ConnectionLimits(settings.http_max_connections, settings.http_header_timeout_s,
                                  settings.http_idle_timeout_s)
        app = make_app(self.registry, self.access, max_request_bytes=settings.max_request_bytes,
                       executor=self.http_pool, regions=self.regions, budget=self.budget,
                       limits=limits)
        self.http = HttpListener(app, limits)
        host, port = split_address(settings.http)
        try:
            bound = await self.http.start(host, port, server_tls(*tls) if tls else None)
        except OSError as error:
            raise _listen_error("serve.http", settings.http, error) from None
        self.addresses["http"] = f"{host}:{bound}"  # port 0: the bound one
        if settings.metrics is not None:
            from agent.serving.metrics import MetricsServer

            self.metrics = MetricsServer(self.registry, self.accept_errors.totals, self.budget)
            try:
                await self.metrics.start(*split_address(settings.metrics))
            except OSError as error:
                raise _listen_error("serve.metrics", settings.metrics, error) from None
            self.addresses["metrics"] = self.metrics.address
        if settings.local is not None:
            self.local = LocalListener(settings.local, self.registry, self.access, self.budget,
                                       self.threads.adopt_front)
            try:
                self.local.start()
            except LocalListenError as error:
                self.local = None
                raise ListenError(str(error)) from None
            self.addresses["local"] = str(settings.local.socket)
        if settings.frigate is not None:
            self.addresses["frigate"] = self._start_frigate(settings.frigate)

    def _start_frigate(self, frigate: FrigateSettings) -> str:
        from agent.serving.frigate_api import BindError, FrigateFrontEnd  # zmq only for it

        self.frigate = FrigateFrontEnd(self.registry, frigate, self.settings.max_request_bytes,
                                       self.threads.adopt_front)
        try:
            return self.frigate.start()
        except BindError as error:
            raise ListenError(str(error)) from None

    async def _freeze_when_loaded(self) -> None:
        """Once the first load round is over, startup's objects are out of the cyclic
        collector's way (freeze_long_lived): its full collections then stop pausing
        every request for tens of milliseconds."""
        while not self.registry.wait_loaded(0):
            await asyncio.sleep(0.2)
        freeze_long_lived()

    async def _trim_when_idle(self) -> None:
        """Give a burst's freed buffers back once a whole IDLE_TRIM_S has passed without a
        run (see KEPT_BUFFER_BYTES): kept while they are reused, not once traffic stops."""
        seen = trimmed = self.registry.executions()
        while True:
            await asyncio.sleep(IDLE_TRIM_S)
            now = self.registry.executions()
            if now == seen and now != trimmed:
                release_freed_memory()
                trimmed = now
            seen = now

    async def stop(self) -> None:
        for task in (self._trimmer, self._freezer):
            if task is not None:
                task.cancel()
        if self.metrics is not None:
            await self.metrics.stop()
        if self.grpc_server is not None:
            self.grpc_server.stop(2.0).wait(3.0)
        if self.http is not None:
            await self.http.stop()
        if self.local is not None:
            self.local.stop()
        self.registry.stop()
        if self.frigate is not None:
            self.frigate.stop()
        self.regions.close()
        self.http_pool.shutdown(wait=False, cancel_futures=True)
        self.grpc_pool.shutdown(wait=False, cancel_futures=True)


async def _serve(plane: DataPlane, stopped: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for number in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(number, stopped.set)
    loop.add_signal_handler(signal.SIGHUP, plane.resched)
    plane.resched()  # a file written before the handler was there: the supervisor signals
    # only a server that is ready, so one written since the first read is not lost
    try:
        await plane.start()
        await stopped.wait()
    finally:
        await plane.stop()


def serve(settings: ServerSettings) -> int:
    """Run until SIGTERM or SIGINT; 0 on a clean stop, 2 when an address is taken."""
    raise_descriptor_limit()
    keep_freed_buffers(KEPT_BUFFER_BYTES)  # before the threads: their arenas take it too
    plane = DataPlane(settings)
    try:
        asyncio.run(_serve(plane, asyncio.Event()))
    except ListenError as error:
        print(f"edge-agent serve: {error}", file=sys.stderr)
        if settings.ready_file is not None:
            write_ready(settings.ready_file.with_name(START_ERROR_FILE), {"error": str(error)})
        return 2
    return 0
