"""``edge-agent run``: wires discovery, tuning, inference, telemetry and the MQTT link.

Start order follows the data flow: discover, plan (and apply if the config says so), load the
model and start the loop, then open the outbox, the sampler and the link.  A part that fails
for a reason an operator can fix (a missing model, a profile the hardware refuses) leaves the
agent running and reachable in state ``degraded``; only an unusable state directory stops it.
Stopping runs the same order backwards, and rolls tuning back if the config says so.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent import __version__
from agent.config import Config
from agent.discovery import discover
from agent.discovery.model import Topology
from agent.fsroot import Root
from agent.link.homeassistant import discovery_messages
from agent.link.mqtt import LinkSettings, MqttLink
from agent.telemetry.collectors import build_collectors
from agent.telemetry.outbox import Outbox, OutboxBusy
from agent.telemetry.records import Sequence, encode, stamp
from agent.telemetry.sampler import FunctionCollector, Sampler
from agent.tuning.engine import Engine, TuningError
from agent.tuning.errors import ProfileError
from agent.tuning.journal import Journal
from agent.tuning.profiles import ProfileStore
from agent.tuning.rt import ThreadSched
from agent.tuning.thp_dynamic import ThpDynamicController

logger = logging.getLogger(__name__)

VERIFY_INTERVAL_S = 60.0


class ServiceError(RuntimeError):
    """The agent cannot run at all (e.g. no usable state directory)."""


class Tuning:
    """The configured profile: planned always, applied and verified when the config says."""

    def __init__(self, root: Root, topology: Topology, state_dir: Path, profile: str | None,
                 apply: bool, on_event: Callable[..., None]) -> None:
        self.engine = Engine(root, topology, Journal(state_dir), ProfileStore(root))
        self.requested, self.apply_wanted, self.on_event = profile, apply, on_event
        self.profile: str | None = None
        self.applied = False
        self.error: str | None = None
        self.runtime: dict[str, Any] = {}
        self.changes = 0
        self.drift: int | None = None
        self.verified_at: float | None = None
        self._thp: ThpDynamicController | None = None
        self._thp_stop = threading.Event()

    def start(self) -> None:
        if self.requested is None:
            return
        try:
            plan = self.engine.plan(self.requested)
            self.profile, self.changes, self.runtime = plan.profile, len(plan.changes), \
                plan.runtime
            if self.apply_wanted:
                self.engine.apply(self.requested)
                self.applied = True
                self.on_event("tuning_applied", profile=plan.profile, changes=len(plan.changes))
                self.verify()
                self._start_thp_controller()
        except (ProfileError, TuningError, OSError) as error:
            self.error = str(error)
            logger.error("tuning: %s", error)

    def _start_thp_controller(self) -> None:
        settings = self.runtime.get("thp_dynamic")
        if not settings:
            return
        self._thp = ThpDynamicController(
            self.engine.root, self.engine.journal, settings,
            lambda event: self.on_event(event.pop("type"), **event))
        threading.Thread(target=self._thp.run, args=(self._thp_stop,), name="thp-dynamic",
                         daemon=True).start()

    def inference_sched(self) -> ThreadSched | None:
        """The profile's scheduling for the inference thread, once it is applied."""
        wanted = self.runtime.get("inference") if self.applied else None
        if not wanted or "cpus" not in wanted:
            return None
        return ThreadSched(policy=wanted.get("policy", "other"),
                           priority=int(wanted.get("priority", 0)), cpus=list(wanted["cpus"]))

    def verify(self) -> None:
        if self.applied:
            self.drift = len(self.engine.verify())
            self.verified_at = time.time()

    def stop(self, rollback: bool) -> None:
        """The THP controller shares the journal: it stops before a rollback reads it."""
        self._thp_stop.set()
        if self.applied and rollback:
            try:
                profile, _notes = self.engine.rollback()
                self.on_event("tuning_rolled_back", profile=profile)
            except (TuningError, OSError) as error:
                logger.error("tuning: rollback failed: %s", error)

    def metrics(self) -> dict[str, Any]:
        return {"profile": self.profile, "applied": self.applied, "planned_changes":
                self.changes, "drift": self.drift, "last_verify_ms": None if
                self.verified_at is None else int(self.verified_at * 1000),
                "error": self.error}


class Inference:
    """The configured model in the inference loop; absent (and reported) when it fails."""

    def __init__(self, config: Config, topology: Topology, state_dir: Path,
                 sched: ThreadSched | None, on_event: Callable[..., None]) -> None:
        self.config, self.topology, self.state_dir = config.inference, topology, state_dir
        self.sched, self.on_event = sched, on_event
        self.loop: Any = None  # InferenceLoop once started
        self.error: str | None = None
        self.providers: list[str] = []

    def start(self) -> None:
        if not self.config.enabled:
            return
        import onnxruntime as ort

        from agent.inference.io import NpyDirectorySource, SourceError, SyntheticSource
        from agent.inference.loader import ModelLoader, model_cache_dir
        from agent.inference.loop import InferenceLoop
        from agent.inference.session import SessionError, choose_providers, thread_plan

        ort.set_default_logger_severity(3)
        try:
            providers = choose_providers(ort.get_available_providers(), self.topology,
                                         self.config.providers)
            loader = ModelLoader(providers, thread_plan(
                self.topology, self.sched.cpus if self.sched else None),
                model_cache_dir(str(self.state_dir)))
            model, built = loader.load(self.config.model, self.config.sha256)
            inputs = built.session.get_inputs()
            source: Any = (SyntheticSource(inputs, self.config.dims)
                           if self.config.source == "synthetic" else
                           NpyDirectorySource(self.config.source.removeprefix("npy:"),
                                              inputs[0].name))
        except (SessionError, SourceError, OSError, ValueError) as error:
            self.error = f"inference.model {self.config.model}: {error}"
            logger.error("%s", self.error)
            return
        self.providers = built.providers
        self.loop = InferenceLoop(model, source, rate_hz=self.config.rate_hz,
                                  thread_sched=self.sched,
                                  on_event=lambda e: self.on_event(e.pop("type"), **e))
        self.loop.start()

    def metrics(self) -> dict[str, Any] | None:
        if self.loop is None:
            return None if self.error is None else {"error": self.error}
        model = self.loop.active
        return {"model": model.name, "providers": self.providers,
                "stuck": model.stats.stuck(time.perf_counter_ns()), **model.stats.snapshot()}

    def stop(self) -> None:
        if self.loop is not None:
            self.loop.stop()


def _state_dir(path: str) -> Path:
    directory = Path(path)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ServiceError(f"state_dir {path}: {error.strerror or error}") from error
    if not os.access(directory, os.W_OK):
        raise ServiceError(f"state_dir {path}: not writable by this user")
    return directory


class Service:
    def __init__(self, config: Config, state_dir: str | None = None) -> None:
        self.config = config
        self.state_dir = _state_dir(state_dir or config.state_dir)
        self.root = Root(config.root)
        self.started = time.monotonic()
        self.topology: Topology | None = None
        self.tuning: Tuning | None = None
        self.inference: Inference | None = None
        self.outbox: Outbox | None = None
        self.link: MqttLink | None = None
        self.sampler: Sampler | None = None
        self.exporter: Any = None  # PrometheusExporter when configured
        self.final_status: dict[str, Any] | None = None  # written by stop()

    # -- start ------------------------------------------------------------------------------

    def start(self) -> None:
        config = self.config
        try:
            self.outbox = Outbox(self.state_dir / "outbox.sqlite",
                                 config.telemetry.outbox_max_bytes,
                                 config.telemetry.outbox_max_age_s)
        except OutboxBusy as error:
            raise ServiceError(str(error)) from None
        self.sequence = Sequence(self.outbox.bump("session"))
        self.topology = discover(self.root)
        self.tuning = Tuning(self.root, self.topology, self.state_dir, config.tuning.profile,
                             config.tuning.apply, self.event)
        self.tuning.start()
        self.inference = Inference(config, self.topology, self.state_dir,
                                   self.tuning.inference_sched(), self.event)
        self.inference.start()
        self._start_link()
        self._start_sampler()
        if config.prometheus_listen:
            from agent.telemetry.prometheus import PrometheusExporter

            self.exporter = PrometheusExporter(config.prometheus_listen, lambda: self.last)
            self.exporter.start()
        problems = self.problems()
        if problems:
            self.link_health("degraded", "; ".join(problems))

    def _start_link(self) -> None:
        assert self.outbox is not None
        m = self.config.mqtt
        tls = m.tls
        settings = LinkSettings(
            client_id=self.config.node_id, topic_root=self.config.topic_root, host=m.host,
            port=m.port, protocol=m.protocol, tls=tls is not None,
            tls_ca=tls.ca if tls else None, tls_cert=tls.cert if tls else None,
            tls_key=tls.key if tls else None, username=m.username,
            password_file=m.password_file, keepalive_s=m.keepalive_s,
            max_payload_bytes=m.max_payload_kb * 1024, reconnect_min_s=m.reconnect_min_s,
            reconnect_max_s=m.reconnect_max_s, replay_per_s=self.config.telemetry.replay_per_s)
        self.link = MqttLink(settings, self.outbox, self.sequence, self.announcements)
        self.link.start()

    def _start_sampler(self) -> None:
        assert self.outbox is not None and self.topology is not None
        assert self.link is not None and self.tuning is not None
        assert self.inference is not None
        collectors: list[Any] = build_collectors(self.root, self.topology)
        collectors += [FunctionCollector("inference", self.inference.metrics),
                       FunctionCollector("tuning", self.tuning.metrics),
                       FunctionCollector("outbox", self.outbox.stats)]
        self.sampler = Sampler(collectors, self.outbox, self.sequence,
                               f"{self.config.topic_root}/telemetry",
                               self.config.telemetry.interval_s,
                               self.config.mqtt.max_payload_kb * 1024,
                               self.config.telemetry.metrics, on_record=self.link.wake)
        self.sampler.start()

    # -- what the link announces, events -------------------------------------------------------

    def problems(self) -> list[str]:
        found = []
        if self.tuning is not None and self.tuning.error:
            found.append(f"tuning: {self.tuning.error}")
        if self.inference is not None and self.inference.error:
            found.append(self.inference.error)
        return found

    def link_health(self, state: str, reason: str | None) -> None:
        if self.link is not None:
            self.link.set_health(state, reason)

    def birth(self, session: int) -> dict[str, Any]:
        import platform

        assert self.topology is not None and self.tuning is not None
        assert self.inference is not None
        board = self.topology.board
        loop = self.inference.loop
        return stamp(
            "birth/1", session=session, node_id=self.config.node_id, fleet=self.config.fleet,
            groups=list(self.config.groups),
            versions={"agent": __version__, "python": platform.python_version(),
                      **_library_versions()},
            board={"family": board.family, "model": board.model, "soc": board.soc},
            profile={"name": self.tuning.profile, "applied": self.tuning.applied},
            model=None if loop is None else {"name": loop.active.name,
                                             "path": self.config.inference.model,
                                             "providers": self.inference.providers},
            capabilities={"gpus": [g.name for g in self.topology.gpus],
                          "npus": [n.name for n in self.topology.npus],
                          "preempt_rt": self.topology.kernel.preempt_rt,
                          "cgroup_v2": self.topology.kernel.cgroup_v2},
            commands=list(self.config.control["allow"]) if self.config.control["enabled"]
            else [],
            telemetry={"interval_s": self.config.telemetry.interval_s,
                       "metrics": "all" if self.config.telemetry.metrics is None
                       else list(self.config.telemetry.metrics)})

    def announcements(self, session: int) -> list[tuple[str, bytes]]:
        """Retained messages published on every connect: birth, and Home Assistant's."""
        messages = [(f"{self.config.topic_root}/birth", encode(self.birth(session)))]
        if self.config.home_assistant_enabled and self.topology is not None:
            messages += discovery_messages(self.config, self.topology)
        return messages

    def event(self, kind: str, **fields: Any) -> None:
        """Events go through the outbox like telemetry: an OOM or a rollback is not lost."""
        logger.info("event %s %s", kind, fields)
        if self.outbox is None:
            return
        payload = encode(stamp("event/1", session=self.sequence.session, type=kind, **fields))
        self.outbox.put(f"{self.config.topic_root}/event", payload)
        if self.link is not None:
            self.link.wake()

    # -- while running ------------------------------------------------------------------------

    @property
    def last(self) -> dict[str, Any] | None:
        return self.sampler.last if self.sampler is not None else None

    def status(self, stopped: bool = False) -> dict[str, Any]:
        """What ``edge-agent status`` reads back from ``status.json``."""
        assert self.outbox is not None and self.link is not None
        return {"schema": "status/1", "pid": os.getpid(), "stopped": stopped,
                "updated_ms": int(time.time() * 1000),
                "node_id": self.config.node_id, "uptime_s": round(time.monotonic()
                                                                  - self.started, 1),
                "link": self.link.status.to_dict(), "outbox": self.outbox.stats(),
                "problems": self.problems(), "last_sample": self.last}

    def tick(self) -> None:
        """Once a second from the main thread: status file, periodic verify."""
        if self.tuning is not None and self.tuning.applied and (
                self.tuning.verified_at is None
                or time.time() - self.tuning.verified_at >= VERIFY_INTERVAL_S):
            self.tuning.verify()
        write_status(self.state_dir, self.status())

    # -- stop -------------------------------------------------------------------------------

    def stop(self, flush_s: float = 5.0) -> None:
        """Inference and sampling first, then flush and say ``stopped``, then roll back."""
        if self.inference is not None:
            self.inference.stop()
        if self.sampler is not None:
            self.sampler.stop()
        if self.exporter is not None:
            self.exporter.stop()
        if self.link is not None:
            self.link.stop(flush_s=flush_s)
        if self.tuning is not None:
            self.tuning.stop(self.config.tuning.rollback_on_stop)
        if self.outbox is not None and self.link is not None:
            self.final_status = self.status(stopped=True)
            write_status(self.state_dir, self.final_status)
            self.outbox.close()


def _library_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("onnxruntime", "paho-mqtt"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            continue
    return found


def write_status(state_dir: Path, status: dict[str, Any]) -> None:
    """Atomically, so ``edge-agent status`` never reads half a file."""
    target = state_dir / "status.json"
    temporary = target.with_suffix(".tmp")
    temporary.write_bytes(encode(status))
    os.replace(temporary, target)
