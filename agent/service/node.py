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
import time
from pathlib import Path
from typing import Any

from agent import __version__
from agent.config import Config
from agent.control.controller import Controller, Identity
from agent.control.envelope import TrustedKeys
from agent.control.store import CommandStore
from agent.discovery import discover
from agent.discovery.model import Topology
from agent.kernel.fsroot import Root
from agent.link.homeassistant import discovery_messages
from agent.link.mqtt import LinkSettings, MqttLink
from agent.service.commands import ServiceCommands
from agent.service.hotplug import Hotplug
from agent.service.inference import Inference
from agent.service.systemd import Notifier
from agent.service.tuning import Tuning
from agent.telemetry.collectors import build_collectors
from agent.telemetry.outbox import Outbox, OutboxBusy
from agent.telemetry.records import Sequence, encode, stamp
from agent.telemetry.sampler import FunctionCollector, Sampler

logger = logging.getLogger(__name__)

VERIFY_INTERVAL_S = 60.0
# What hot-plug can change; the rest of a topology (temperatures, frequencies) always moves.
DEVICE_KEYS = ("gpus", "npus", "block", "pci", "udev")


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


MODEL_LOAD_ALLOWANCE_S = 300  # EXTEND_TIMEOUT_USEC while a (large) model loads
LINK_STALL_S = 10.0
INFERENCE_STALL_S = 10.0


class Service:
    def __init__(self, config: Config, state_dir: str | None = None,
                 notifier: Notifier | None = None) -> None:
        self.config = config
        self.notifier = notifier or Notifier(enabled=False)
        self._progress = (0, time.monotonic())  # inference completions, when they last rose
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
        self.controller: Controller | None = None
        self.hotplug: Hotplug | None = None
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
        if config.hotplug.enabled:  # before discovery: a device added meanwhile is not missed
            self.hotplug = Hotplug(config.hotplug.subsystems)
            self.hotplug.start()
        self.topology = discover(self.root)
        self.tuning = Tuning(self.root, self.topology, self.state_dir, config.tuning.profile,
                             config.tuning.apply, self.event)
        self.tuning.start()
        self.inference = Inference(config, self.topology, self.state_dir,
                                   self.tuning.inference_sched(), self.event)
        self.notifier.notify(STATUS=f"loading {config.inference.model}",
                             EXTEND_TIMEOUT_USEC=MODEL_LOAD_ALLOWANCE_S * 1_000_000)
        self.inference.start()
        self.controller = self._controller()
        self._start_link()
        if self.controller is not None:
            self.controller.start()
        if config.prometheus_listen:  # before the first sample: a scrape never finds no port
            from agent.telemetry.prometheus import PrometheusExporter

            self.exporter = PrometheusExporter(config.prometheus_listen, lambda: self.last)
            self.exporter.start()
        self._start_sampler()
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
        controller = self.controller
        self.link = MqttLink(settings, self.outbox, self.sequence, self.announcements,
                             on_message=controller.on_message if controller else None,
                             subscriptions=controller.subscriptions() if controller else ())
        self.link.start()

    def _controller(self) -> Controller | None:
        """Fleet control, when enabled and at least one key can sign commands."""
        control = self.config.control
        if not control.enabled:
            return None
        if not control.trusted_keys:
            logger.warning("control: no trusted_keys in the config: fleet commands are off")
            return None
        commands = ServiceCommands(self)
        return Controller(
            Identity(self.config.fleet, self.config.node_id, self.config.groups),
            TrustedKeys.from_config(control.trusted_keys), set(control.allow),
            CommandStore(self.state_dir / "commands.sqlite"), commands.handlers(),
            self.reply, converge=commands.converge,
            max_payload_bytes=control.max_payload_kb * 1024,
            max_skew_s=control.max_skew_s)

    def reply(self, topic: str, body: dict[str, Any], response_topic: str | None,
              correlation: bytes | None) -> None:
        """A command reply; a result above the payload limit goes in numbered chunks."""
        if self.link is None:
            return
        limit = self.config.mqtt.max_payload_kb * 1024
        if len(encode(body)) <= limit or "result" not in body:
            self.link.publish_reply(topic, body, response_topic, correlation)
            return
        text = encode(body["result"]).decode()
        size = max(1024, limit - 2048)  # room for the envelope of each chunk
        parts = [text[i:i + size] for i in range(0, len(text), size)]
        head = {k: v for k, v in body.items() if k != "result"}
        for index, part in enumerate(parts):
            self.link.publish_reply(topic, {**head, "chunk": {"index": index,
                                                               "count": len(parts),
                                                               "data": part}},
                                    response_topic, correlation)

    def _start_sampler(self) -> None:
        assert self.outbox is not None and self.topology is not None
        assert self.link is not None and self.tuning is not None
        assert self.inference is not None
        self.sampler = Sampler(self._collectors(), self.outbox, self.sequence,
                               f"{self.config.topic_root}/telemetry",
                               self.config.telemetry.interval_s,
                               self.config.mqtt.max_payload_kb * 1024,
                               self.config.telemetry.metrics)
        self.sampler.start()

    def _collectors(self) -> list[Any]:
        assert self.outbox is not None and self.topology is not None
        assert self.tuning is not None and self.inference is not None
        return [*build_collectors(self.root, self.topology),
                FunctionCollector("inference", self.inference.metrics),
                FunctionCollector("tuning", self.tuning.metrics),
                FunctionCollector("outbox", self.outbox.stats)]

    # -- what the link announces, events -------------------------------------------------------

    def problems(self) -> list[str]:
        found = []
        if self.tuning is not None and self.tuning.error:
            found.append(f"tuning: {self.tuning.error}")
        if self.inference is not None and self.inference.error:
            found.append(self.inference.error)
        if self.outbox is not None and self.outbox.last_error:
            found.append(f"outbox: {self.outbox.last_error}")  # records wait in memory
        return found

    def warnings(self) -> list[str]:
        """What works but not as well as this board could: an accelerator left unused."""
        unused = self.inference.unused if self.inference is not None else []
        return [f"{accelerator.device} is not used: {accelerator.reason}"
                for accelerator in unused]

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
                          "cgroup_v2": self.topology.kernel.cgroup_v2,
                          "unused_accelerators": [accelerator.to_dict() for accelerator
                                                  in self.inference.unused]},
            commands=list(self.config.control.allow) if self.config.control.enabled
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

    # -- while running ------------------------------------------------------------------------

    @property
    def last(self) -> dict[str, Any] | None:
        return self.sampler.last if self.sampler is not None else None

    def health_problem(self) -> str | None:
        """Why the agent must not tell systemd it is alive, or None (see systemd.Watchdog)."""
        now = time.monotonic()
        loop = self.inference.loop if self.inference is not None else None
        if loop is not None:
            if not loop.alive:
                return "the inference loop has ended"
            if loop.active.stats.stuck(time.perf_counter_ns()):
                return f"an inference call on {loop.active.name} is stuck"
            completions, since = self._progress
            if loop.completions != completions:
                self._progress = (loop.completions, now)
            elif now - since > max(INFERENCE_STALL_S, 5 * loop.period_ns / 1e9):
                return f"no inference call completed for {now - since:.0f} s"
        if self.link is not None:
            if not self.link.alive:
                return "the MQTT link has ended"
            quiet = now - self.link.status.heartbeat
            if quiet > LINK_STALL_S:
                return f"the MQTT link made no progress for {quiet:.0f} s"
        return None

    def status(self, stopped: bool = False) -> dict[str, Any]:
        """What ``edge-agent status`` reads back from ``status.json``."""
        assert self.outbox is not None and self.link is not None
        return {"schema": "status/1", "pid": os.getpid(), "stopped": stopped,
                "updated_ms": int(time.time() * 1000),
                "node_id": self.config.node_id, "uptime_s": round(time.monotonic()
                                                                  - self.started, 1),
                "link": self.link.status.to_dict(), "outbox": self.outbox.stats(),
                "problems": self.problems(), "warnings": self.warnings(),
                "last_sample": self.last}

    def tick(self) -> dict[str, Any]:
        """Once a second from the main thread: periodic verify, the status file; returns the
        status it wrote."""
        if self.tuning is not None and self.tuning.applied and (
                self.tuning.verified_at is None
                or time.time() - self.tuning.verified_at >= VERIFY_INTERVAL_S):
            self.tuning.verify()
        if self.hotplug is not None:
            burst = self.hotplug.take()
            if burst is not None:
                self.rediscover(*burst)
        status = self.status()
        write_status(self.state_dir, status)
        return status

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
        """Inference and sampling first, then flush and say ``stopped``, then roll back
        (``rollback`` None: as ``tuning.rollback_on_stop`` says)."""
        if self.hotplug is not None:
            self.hotplug.stop()
        if self.controller is not None:
            self.controller.stop()
            self.controller.store.close()
        if self.inference is not None:
            self.inference.stop()
        if self.sampler is not None:
            self.sampler.stop()
        if self.exporter is not None:
            self.exporter.stop()
        if self.link is not None:
            self.link.stop(flush_s=flush_s)
        if self.tuning is not None:
            self.tuning.stop(self.config.tuning.rollback_on_stop if rollback is None
                             else rollback)
        if self.outbox is not None and self.link is not None:
            self.outbox.close()  # its last round first: the deletes of the last acks count
            self.final_status = self.status(stopped=True)
            write_status(self.state_dir, self.final_status)


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
