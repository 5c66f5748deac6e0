"""``edge-agent run``'s composition root: builds the agent's parts and wires them together.

It only wires.  Parts are built in data-flow order (discover, plan and apply the configured
profile, launch the supervised data plane, then the link, the controller, the exporter and
the sampler, and only then wait for the data plane's first ready, so that a node building
TensorRT engines for minutes is on the broker meanwhile, ``degraded`` with the data plane
starting) and each consumer gets the narrow collaborators it needs; every running part is a
``parts.Part``, started in that order and stopped in reverse, and rolls tuning back on the
way out if the config says so.  A part that fails for a reason an operator can fix (a
missing model, a profile the hardware refuses) leaves the agent running and reachable in
state ``degraded`` (``health``); only an unusable state directory stops it.  What it
announces and writes is built in ``reports``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Any

from agent import protocol
from agent.config import Config
from agent.control.controller import Controller, Identity
from agent.control.envelope import TrustedKeys
from agent.control.store import CommandStore
from agent.discovery import discover
from agent.discovery.model import Topology
from agent.inference.demo_model import DEMO_MODEL_PATH
from agent.kernel.fsroot import Root
from agent.link.homeassistant import discovery_messages
from agent.link.mqtt import MqttLink
from agent.link.settings import LinkSettings, incoming_bound
from agent.service import health, reports
from agent.service.builds import Builder, core_builder
from agent.service.collaborators import Collaborators
from agent.service.commands import ServiceCommands
from agent.service.hotplug import Hotplug
from agent.service.inference import Inference
from agent.service.memory_events import MemoryEventsWatch
from agent.service.parts import Ending, Part, Wrapped
from agent.service.qos import QosLoop
from agent.service.qos_device import DeviceReader, ProfileLadder
from agent.service.qos_inputs import Objectives
from agent.service.selftest import Subject, run_checks
from agent.service.systemd import Notifier
from agent.service.tuning import Tuning
from agent.telemetry.collectors import build_collectors
from agent.telemetry.outbox import Outbox, OutboxBusy
from agent.telemetry.records import Sequence, encode, stamp
from agent.telemetry.sampler import FunctionCollector, Sampler
from agent.tuning.placement import Placement, detect

logger = logging.getLogger(__name__)

VERIFY_INTERVAL_S = 60.0
# What hot-plug can change; the rest of a topology (temperatures, frequencies) always moves.
DEVICE_KEYS = ("cpu", "gpus", "npus", "block", "pci", "udev")
MODEL_LOAD_ALLOWANCE_S = 300  # EXTEND_TIMEOUT_USEC while a (large) model loads


class ServiceError(RuntimeError):
    """The agent cannot run at all (e.g. no usable state directory)."""


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
    def __init__(self, config: Config, state_dir: str | None = None,
                 notifier: Notifier | None = None, builder: Builder | None = None,
                 retain: bool = True) -> None:
        """``retain=False``: a probe beside the real node (selftest), which must leave no
        retained state, birth or Last Will on the broker."""
        self.config = config
        self.retain = retain
        self.builder = builder or core_builder  # build-model's build (tests give their own)
        self.notifier = notifier or Notifier(enabled=False)
        self.state_dir = _state_dir(state_dir or config.state_dir)
        self.root = Root(config.root)
        self.started = time.monotonic()
        self.topology: Topology | None = None
        self.tuning: Tuning | None = None
        self.inference: Inference | None = None
        self.outbox: Outbox | None = None
        self.link: MqttLink | None = None
        self.sampler: Sampler | None = None
        self.controller: Controller | None = None
        self.hotplug: Hotplug | None = None
        self.placement: Placement | None = None  # where the data plane's cgroup is
        self.memory_watch: MemoryEventsWatch | None = None
        self.qos: QosLoop | None = None  # qos.mode advise or control
        self.parts: list[Part] = []  # in start order
        self.late: list[Part] = []  # of those, the ones stopped after all the others
        self.liveness = health.Liveness(lambda: self.link)
        self.link_restarts = health.LinkRestarts()
        self._link_deaths = 0  # deaths of the link thread seen by tick()
        self._health: tuple[str, str | None] = ("online", None)  # what the state says
        self.final_status: dict[str, Any] | None = None  # written by stop()

    # -- start ------------------------------------------------------------------------------

    def _start(self, part: Part, late: bool = False) -> None:
        """``late``: stopped after every other part, and in the order they started: tuning
        (started first) outlives inference and rolls back, then the link flushes what every
        part said on the way out, the rollback's event too, and says ``stopped``."""
        self.parts.append(part)  # first: stop() stops a part whose start failed half-way
        if late:
            self.late.append(part)
        part.start()

    def start(self) -> None:
        config = self.config
        try:
            self.outbox = Outbox(self.state_dir / "outbox.sqlite",
                                 config.telemetry.outbox_max_bytes,
                                 config.telemetry.outbox_max_age_s)
        except OutboxBusy as error:
            raise ServiceError(str(error)) from None
        self.sequence = Sequence(self.outbox.bump("session"))
        if config.hotplug.enabled:  # before discovery: a device added meanwhile is not missed
            self.hotplug = Hotplug(config.hotplug.subsystems)
            self._start(self.hotplug)
        self.topology = discover(self.root)
        self.placement = detect(self.root, self.topology)
        self.tuning = Tuning(self.root, self.topology, self.state_dir, config.tuning.profile,
                             config.tuning.apply, self.event, self.placement)
        self._start(self.tuning, late=True)
        self.inference = Inference(config, self.topology, self.state_dir,
                                   self.tuning.inference_sched(), self.event, self.placement)
        self.tuning.on_sched = self.inference.resched  # switch, rollback, rollback_on_stop
        self.memory_watch = MemoryEventsWatch(self.placement, self.event)
        self.notifier.notify(STATUS="starting the data plane",
                             EXTEND_TIMEOUT_USEC=MODEL_LOAD_ALLOWANCE_S * 1_000_000)
        inference = self.inference  # waited for last: the node is on the broker meanwhile
        self._start(Wrapped(inference.launch, inference.stop, inference.problems))
        if config.qos.mode != "off" and inference.enabled:
            self.qos = QosLoop(
                config.qos, inference.supervisor, Objectives(inference.repository),
                self.event, ladder=ProfileLadder(self.tuning), device=DeviceReader(self.tuning))
            self._start(self.qos)
        self.sampler = Sampler(self._collectors(), self.outbox, self.sequence,
                               protocol.topic(self.config.topic_root, protocol.TELEMETRY),
                               self.config.telemetry.interval_s,
                               self.config.mqtt.max_payload_kb * 1024,
                               self.config.telemetry.metrics)
        self.controller = self._controller(self.tuning, self.inference, self.sampler)
        link = self.link = self._link(self.outbox, self.controller)
        self._announce_health()  # before it connects: its first state says the data plane starts
        self._start(Wrapped(link.start, lambda ending: link.stop(flush_s=ending.flush_s),
                            self._link_problems), late=True)
        if self.controller is not None:
            self._start(Wrapped(self.controller.start, self._stop_controller))
        if config.prometheus_listen:  # before the first sample: a scrape never finds no port
            from agent.telemetry.prometheus import PrometheusExporter

            exporter = PrometheusExporter(config.prometheus_listen, lambda: self.last)
            self._start(Wrapped(exporter.start, lambda ending: exporter.stop()))
        sampler = self.sampler
        self._start(Wrapped(sampler.start, lambda ending: sampler.stop()))
        inference.wait_ready()
        if link.status.connects:  # the birth went out before the data plane served
            link.rebirth()
        self._announce_health()

    def _announce_health(self) -> None:
        """The retained state follows the problems: ``degraded`` with them, else ``online``
        (a data plane that restarts, a link death within its window, a failing outbox)."""
        problems = self.problems()
        wanted = ("degraded", "; ".join(problems)) if problems else ("online", None)
        if wanted != self._health and self.link is not None:
            self._health = wanted
            self.link.set_health(*wanted)

    def _link(self, outbox: Outbox, controller: Controller | None) -> MqttLink:
        m = self.config.mqtt
        tls = m.tls
        settings = LinkSettings(
            client_id=self.config.node_id, topic_root=self.config.topic_root, host=m.host,
            port=m.port, brokers=m.brokers or (), protocol=m.protocol, tls=tls is not None,
            tls_ca=tls.ca if tls else None, tls_cert=tls.cert if tls else None,
            tls_key=tls.key if tls else None, username=m.username,
            password_file=m.password_file, keepalive_s=m.keepalive_s,
            max_payload_bytes=m.max_payload_kb * 1024,
            max_incoming_bytes=incoming_bound(self.config.control.max_payload_kb),
            reconnect_min_s=m.reconnect_min_s, reconnect_max_s=m.reconnect_max_s,
            replay_per_s=self.config.telemetry.replay_per_s, retain=self.retain)
        return MqttLink(settings, outbox, self.sequence, self.announcements,
                        on_message=controller.on_message if controller else None,
                        subscriptions=controller.subscriptions() if controller else (),
                        event=self.event)

    def _controller(self, tuning: Tuning, inference: Inference,
                    sampler: Sampler) -> Controller | None:
        """Fleet control, when enabled and at least one key can sign commands."""
        control = self.config.control
        if not control.enabled:
            return None
        if not control.trusted_keys:
            logger.warning("control: no trusted_keys in the config: fleet commands are off")
            return None
        config = self.config
        commands = ServiceCommands(Collaborators(
            tuning=tuning, inference=inference, sampler=sampler, link=self._running_link,
            topology=self._topology, status=self.status,
            selftest=lambda: run_checks(self.subject()),
            guard_defaults=dataclasses.asdict(control.guard),
            # models load only from these (and the bundled demo): a command cannot make the
            # agent parse an arbitrary file
            model_dirs=[Path(d) for d in control.model_dirs] + [
                Path(config.state_dir) / "models", DEMO_MODEL_PATH.parent,
                Path(config.inference.model).parent],
            state_dir=self.state_dir, builder=self.builder,
            rknn_python=self.config.model_build.rknn_python))
        return Controller(
            Identity(self.config.fleet, self.config.node_id, self.config.groups),
            TrustedKeys.from_config(control.trusted_keys), set(control.allow),
            CommandStore(self.state_dir / "commands.sqlite"), commands.handlers(),
            self.reply, converge=commands.converge, refused=commands.refused_desired,
            max_payload_bytes=control.max_payload_kb * 1024,
            max_skew_s=control.max_skew_s, desired_max_ttl_s=control.desired_max_ttl_s,
            accept_unbound=control.accept_unbound_envelopes)

    def _stop_controller(self, ending: Ending) -> None:
        assert self.controller is not None
        self.controller.stop()
        self.controller.store.close()

    def _running_link(self) -> MqttLink:
        assert self.link is not None  # commands run once the controller started, after it
        return self.link

    def _topology(self) -> Topology:
        assert self.topology is not None
        return self.topology

    def reply(self, topic: str, body: dict[str, Any], response_topic: str | None,
              correlation: bytes | None, droppable: bool = False) -> None:
        """A command reply; a result above the payload limit goes in numbered chunks.
        ``droppable``: a reply to junk, which the link may drop when too many wait."""
        if self.link is None:
            return
        for part in protocol.chunked(body, self.config.mqtt.max_payload_kb * 1024):
            self.link.publish_reply(topic, part, response_topic, correlation,
                                    droppable=droppable)

    def _collectors(self) -> list[Any]:
        assert self.outbox is not None and self.topology is not None
        assert self.tuning is not None and self.inference is not None
        plane = self.placement.limits_dir if self.placement is not None else None
        return [*build_collectors(self.root, self.topology, data_plane_cgroup=plane),
                FunctionCollector("inference", self.inference.metrics),
                FunctionCollector("tuning", self.tuning.metrics),
                FunctionCollector("outbox", self.outbox.stats),
                FunctionCollector("link", lambda: self.link and self.link.status.metrics()),
                # the controller comes after the sampler (its commands act on it)
                FunctionCollector("control", lambda: self.controller.metrics()
                                  if self.controller is not None else None),
                FunctionCollector("qos", lambda: self.qos.metrics() if self.qos else None)]

    # -- what the link announces, events -------------------------------------------------------

    def problems(self) -> list[str]:
        return health.degraded(self.parts, self.outbox.last_error if self.outbox else None)

    def warnings(self) -> list[str]:
        return [*health.warnings(self.inference.unused if self.inference is not None else []),
                *(self.qos.warnings() if self.qos is not None else []),
                *([self.config.node_id_warning] if self.config.node_id_warning else [])]

    def subject(self) -> Subject:
        """This agent as the selftest checks see it."""
        return Subject(self.topology, self.inference, self.config.inference.enabled,
                       self.tuning, self.link.status if self.link is not None else None)

    def announcements(self, session: int) -> list[tuple[str, bytes]]:
        """Retained messages published on every connect: birth, and Home Assistant's."""
        assert self.topology is not None and self.tuning is not None
        assert self.inference is not None
        birth = reports.birth(self.config, self.topology, self.tuning, self.inference, session,
                              self.link.status.broker if self.link is not None else None)
        messages = [(protocol.topic(self.config.topic_root, protocol.BIRTH), encode(birth))]
        if self.config.home_assistant_enabled:
            messages += discovery_messages(self.config, self.topology)
        return messages

    def event(self, kind: str, **fields: Any) -> None:
        """Events go through the outbox like telemetry: an OOM or a rollback is not lost."""
        logger.info("event %s %s", kind, fields)
        if self.outbox is None:
            return
        payload = encode(stamp("event/1", session=self.sequence.session, type=kind, **fields))
        self.outbox.put(protocol.topic(self.config.topic_root, protocol.EVENT), payload)

    # -- while running ------------------------------------------------------------------------

    @property
    def last(self) -> dict[str, Any] | None:
        return self.sampler.last if self.sampler is not None else None

    def status(self, stopped: bool = False) -> dict[str, Any]:
        assert self.outbox is not None and self.link is not None
        jobs = self.controller.long_jobs.running() if self.controller is not None else {}
        return reports.status(self.config.node_id, self.started, self.link.status.to_dict(),
                              self.outbox.stats(), self.problems(), self.warnings(),
                              self.last, stopped=stopped, jobs=jobs)

    def tick(self) -> dict[str, Any]:
        """Once a second from the main thread: periodic verify, the status file; returns the
        status it wrote."""
        self._supervise_link()
        self._announce_health()
        if self.memory_watch is not None:
            self.memory_watch.check()
        if self.inference is not None and self.tuning is not None:
            # the same as on_sched sends; a no-op unless a change was missed
            self.inference.resched(self.tuning.inference_sched())
        if self.tuning is not None and self.tuning.applied and (
                self.tuning.verified_at is None
                or time.time() - self.tuning.verified_at >= VERIFY_INTERVAL_S):
            self.tuning.verify()
        if self.hotplug is not None:
            burst = self.hotplug.take()
            if burst is not None:
                self.rediscover(*burst)
        status = self.status()
        reports.write_status(self.state_dir, status)
        return status

    def _link_problems(self) -> list[str]:
        if self.link is None:
            return []
        recent = self.link_restarts.problem()
        return [*self.link.problems(), *([recent] if recent else [])]

    def _supervise_link(self) -> None:
        """A link thread that died (a bug: no message can end it) is started again, as
        often as ``LinkRestarts`` allows, with a ``link_restarted`` event; the retained
        state says ``degraded`` until the death is out of its window (``_announce_health``)."""
        link = self.link
        if link is None:
            return
        deaths = link.status.faults.get("thread_died", 0)
        if deaths > self._link_deaths:
            self._link_deaths = deaths
            self.link_restarts.died(link.died or "unknown")
        if link.status.state == "dead" and not link.alive and self.link_restarts.allowed() \
                and link.restart():
            logger.warning("mqtt: the link thread died (%s); started again", link.died)
            self.event("link_restarted", error=link.died, restarts=link.status.restarts)

    def rediscover(self, devices: list[dict[str, Any]], more: int = 0) -> None:
        """Devices came or went: discover again, sample and announce the new topology, and
        plan the active profile against it (applied again only if ``tuning.apply``)."""
        assert self.topology is not None and self.tuning is not None
        before = self.topology.to_dict()
        try:
            self.topology = discover(self.root)
        except Exception as error:  # the main loop must go on; the next burst tries again
            logger.exception("hot-plug: rediscovery failed")
            self.event("hotplug", devices=devices, more=more, error=str(error))
            return
        after = self.topology.to_dict()
        self.tuning.retarget(self.topology)
        if self.sampler is not None:
            self.sampler.set_collectors(self._collectors())
        self.event("hotplug", devices=devices, more=more,
                   changed=[key for key in DEVICE_KEYS if before.get(key) != after.get(key)],
                   plan={"profile": self.tuning.profile, "changes": self.tuning.changes,
                         "applied": self.tuning.applied, "error": self.tuning.error})
        if self.link is not None:
            self.link.rebirth()

    # -- stop -------------------------------------------------------------------------------

    def stop(self, flush_s: float = 5.0, rollback: bool | None = None) -> None:
        """What produces first, in reverse start order (sampling, commands, inference, the
        hot-plug watch), then tuning rolls back (when ``rollback`` says; None: as
        ``tuning.rollback_on_stop`` says), then the link flushes for up to ``flush_s`` (the
        rollback's event with the rest) and says ``stopped``; the outbox closes last."""
        ending = Ending(flush_s, self.config.tuning.rollback_on_stop if rollback is None
                        else rollback)
        early = [part for part in self.parts if part not in self.late]
        for part in [*reversed(early), *self.late]:
            part.stop(ending)
        self.parts, self.late = [], []
        if self.outbox is not None and self.link is not None:
            self.outbox.close()  # its last round first: the deletes of the last acks count
            self.final_status = self.status(stopped=True)
            reports.write_status(self.state_dir, self.final_status)
