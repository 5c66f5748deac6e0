"""Every section of ``agent.yaml``, declared once: each field is a key, with its rule and its
default as the file spells it (``agent.config.declare`` derives the schema, the defaults and
the typed object).  Values computed from keys are properties; ``hotplug.enabled: auto`` is
resolved by the loader, which knows the root.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agent.config.checks import (
    PATH,
    command_names,
    dim_sizes,
    ed25519_key,
    frigate_endpoint,
    frigate_model_type,
    host_port,
    input_source,
    listen_address,
    metric_groups,
    onnx_providers,
    topic_level,
)
from agent.config.declare import entries, section, setting
from agent.control.schemas import COMMANDS
from agent.discovery.udev import HOTPLUG_SUBSYSTEMS
from agent.inference.demo_model import DEMO_MODEL_PATH
from agent.link.brokers import address, members_problem
from agent.serving.repository import MODEL_NAME
from agent.validation import choice, integer, number, optional, text

BOOL = choice(True, False)


def _every_unless(word: str) -> Callable[[Any], tuple[str, ...] | None]:
    """``word`` (all, auto) is None, "not narrowed"; a list is a tuple."""
    def convert(value: Any) -> tuple[str, ...] | None:
        return None if value == word else tuple(value)
    return convert


@dataclass(frozen=True)
class TlsConfig:
    ca: str | None = setting(optional(PATH), None)
    cert: str | None = setting(optional(PATH), None)  # with key: mTLS
    key: str | None = setting(optional(PATH), None)


@dataclass(frozen=True)
class ReconnectConfig:
    min_s: float = setting(number(0.05, 3600), 0.5)
    max_s: float = setting(number(0.05, 86400), 30.0)


@dataclass(frozen=True)
class MqttConfig:
    host: str = setting(text(what="a host name or address"), "localhost")
    port: int = setting(integer(1, 65535), 1883)
    protocol: str = setting(choice("5", "3.1.1"), "5")
    # ["host:port", ...]: the members of a broker cluster to fail over between (not with a
    # host or port of its own); tls, username and password_file apply to each
    brokers: tuple[str, ...] | None = setting(optional(members_problem), None)
    tls: TlsConfig | None = section(TlsConfig, nullable="{} for the system's CAs")
    username: str | None = setting(optional(text()), None)
    password_file: str | None = setting(optional(PATH), None)
    keepalive_s: int = setting(integer(5, 3600), 30)
    max_payload_kb: int = setting(integer(1, 256 * 1024), 64)
    reconnect: ReconnectConfig = section(ReconnectConfig)
    # auto: `run` starts a Mosquitto of its own for the run when host is loopback, nothing
    # listens and no init system will start one (agent.service.local_broker); false: never
    local_broker: str | bool = setting(choice("auto", False), "auto")

    @property
    def members(self) -> tuple[str, ...]:
        """The brokers the node may use: ``brokers``, else ``host:port``."""
        return self.brokers or (address(self.host, self.port),)

    @property
    def reconnect_min_s(self) -> float:
        return float(self.reconnect.min_s)

    @property
    def reconnect_max_s(self) -> float:
        return float(self.reconnect.max_s)


@dataclass(frozen=True)
class OutboxConfig:
    max_mb: float = setting(number(0.01, 1_000_000), 64)
    max_age_h: float = setting(number(0.001, 100_000), 168)


@dataclass(frozen=True)
class TelemetryConfig:
    interval_s: float = setting(number(0.05, 86400), 1.0, convert=float)
    outbox: OutboxConfig = section(OutboxConfig)
    replay_per_s: float = setting(number(1, 1_000_000), 200, convert=float)
    metrics: tuple[str, ...] | None = setting(  # None: every group
        metric_groups, "all", convert=_every_unless("all"))

    @property
    def outbox_max_bytes(self) -> int:
        return int(self.outbox.max_mb * 1024 * 1024)

    @property
    def outbox_max_age_s(self) -> float:
        return float(self.outbox.max_age_h) * 3600


@dataclass(frozen=True)
class TuningConfig:
    profile: str | None = setting(optional(text(what="a profile name, or auto")), "auto")
    apply: bool = setting(BOOL, False)
    rollback_on_stop: bool = setting(BOOL, True)


@dataclass(frozen=True)
class InferenceConfig:
    enabled: bool = setting(BOOL, True)
    model: str = setting(PATH, str(DEMO_MODEL_PATH))
    sha256: str | None = setting(optional(
        text(re.compile(r"^[0-9a-f]{64}$"), "64 lower-case hex digits")), None)
    providers: tuple[str, ...] | None = setting(  # None: chosen from the hardware
        onnx_providers, "auto", convert=_every_unless("auto"))
    # none: serve and wait; synthetic / npy:DIR drive a load test through the server
    source: str = setting(input_source, "none")
    dims: dict[str, int] = setting(dim_sizes, {}, convert=dict)
    rate_hz: float | None = setting(optional(number(0.001, 1_000_000)), None)


@dataclass(frozen=True)
class ServeTlsConfig:
    cert: str | None = setting(optional(PATH), None)
    key: str | None = setting(optional(PATH), None)
    client_ca: str | None = setting(optional(PATH), None)  # clients must show a cert it signed


@dataclass(frozen=True)
class ServeLocalConfig:
    """The local front end (agent.serving.local_listener): a Unix socket whose sessions pass
    tensors in shared memory."""

    # None: /run/edge-agent/infer.sock as root, else $XDG_RUNTIME_DIR/edge-agent/infer.sock
    socket: str | None = setting(optional(PATH), None)
    group: str = setting(text(re.compile(r"^[a-z_][a-z0-9_-]{0,31}\$?$"), "a group name"),
                         "edge-agent")  # may connect, besides root
    max_sessions: int = setting(integer(1, 4096), 64)
    max_region_mb: float = setting(number(1, 1 << 20), 256)  # one session's shared region


@dataclass(frozen=True)
class FrigateConfig:
    """Frigate's ``zmq`` detector answered by one model (agent.serving.frigate_api)."""

    endpoint: str = setting(frigate_endpoint, "ipc:///tmp/cache/zmq_detector")
    model: str = setting(text(re.compile(rf"^{MODEL_NAME.pattern}$"),
                              "a model name of the repository (letters, digits, ._-)"))
    # Frigate's names (its header's); yolo-generic, DESIGN's spelling, is yologeneric.
    # null: the type each request's header names
    model_type: str | None = setting(frigate_model_type, None)
    # a float model's pixel scale when Frigate sends uint8 (Frigate's names): 0..1 or 0..255
    input_dtype: str = setting(choice("float", "float_denorm"), "float")
    # Frigate's detector request_timeout_ms: every request is answered within 3/4 of it
    request_timeout_ms: int = setting(integer(10, 60_000), 200)


@dataclass(frozen=True)
class ServeConfig:
    """The data plane (``edge-agent serve``): where it listens and what it serves."""

    http: str = setting(listen_address, "127.0.0.1:8000")
    grpc: str = setting(listen_address, "127.0.0.1:8001")
    metrics: str | None = setting(optional(listen_address), "127.0.0.1:8002")  # Prometheus
    repository: str | None = setting(optional(PATH), None)  # None: <state_dir>/repository
    tls: ServeTlsConfig | None = section(ServeTlsConfig, nullable="cert and key")
    token_file: str = setting(PATH, "/etc/edge-agent/serve-token")
    max_request_mb: float = setting(number(0.001, 4096), 64)
    # every request's bytes in flight at once (bodies, decoded tensors, queued inputs,
    # outputs being sent); None: from the device's memory (agent.serving.budget)
    max_inflight_mb: float | None = setting(optional(number(1, 1 << 20)), None)
    # a request's ``priority`` at this level or higher (1 is the highest) needs the bearer
    # token, so that any local process cannot jump the queue; 0: every level is open
    privileged_priority: int = setting(integer(0, 1000), 1)
    # the HTTP front end's open connections (agent.serving.http_listener; None: a quarter of
    # the descriptor limit), and the seconds a request's head may take to arrive and a
    # kept-alive connection may wait for its next request
    http_max_connections: int | None = setting(optional(integer(1, 1 << 20)), None)
    http_header_timeout_s: float = setting(number(0.1, 3600), 5.0)
    http_idle_timeout_s: float = setting(number(0.1, 3600), 5.0)
    # system shared memory: only objects whose name starts with it may be registered
    shm_prefix: str = setting(text(re.compile(r"^[A-Za-z0-9_.-]{1,64}$"),
                                   "a name prefix such as edge-agent- (letters, digits, "
                                   "'.', '_', '-')"), "edge-agent-")
    local: ServeLocalConfig | None = section(ServeLocalConfig, switchable=True)  # false: off
    frigate: FrigateConfig | None = section(FrigateConfig, nullable="model is required")

    @property
    def max_request_bytes(self) -> int:
        return int(self.max_request_mb * 1024 * 1024)

    @property
    def max_inflight_bytes(self) -> int | None:
        return None if self.max_inflight_mb is None else int(self.max_inflight_mb * 1024 * 1024)


@dataclass(frozen=True)
class TrustedKey:
    """An operator key whose signed commands this node runs (``fleet keygen`` prints one)."""

    id: str = setting(text())
    public_key: str = setting(ed25519_key)


@dataclass(frozen=True)
class GuardConfig:
    """The health window of guarded changes, unless a command brings its own thresholds."""

    window_s: float = setting(number(0, 3600), 10)
    max_p99_ratio: float = setting(number(1, 1000), 1.5)
    max_error_rate: float = setting(number(0, 1), 0.003)
    max_temp_c: float | None = setting(optional(number(0, 150)), None)
    canary_s: float = setting(number(0, 3600), 5)


@dataclass(frozen=True)
class ControlConfig:
    enabled: bool = setting(BOOL, True)
    trusted_keys: tuple[TrustedKey, ...] = entries(TrustedKey)
    allow: tuple[str, ...] = setting(command_names, list(COMMANDS))
    max_payload_kb: int = setting(integer(1, 1024), 16)
    max_skew_s: float = setting(number(0, 3600), 30)
    # Desired state waits for nodes that are offline for long: its own maximum lifetime.
    desired_max_ttl_s: float = setting(number(1, 10 * 365 * 86400), 365 * 86400, convert=float)
    # Envelopes that name no fleet (signed before fleets were): for a migration window only.
    accept_unbound_envelopes: bool = setting(BOOL, False)
    model_dirs: tuple[str, ...] = setting(("list", PATH), [])
    guard: GuardConfig = section(GuardConfig)


@dataclass(frozen=True)
class PrometheusConfig:
    listen: str | None = setting(optional(host_port), None)


@dataclass(frozen=True)
class HotplugConfig:
    enabled: bool = setting(choice("auto", True, False), "auto")  # auto: the loader decides
    subsystems: tuple[str, ...] = setting(("list", text(
        re.compile(r"^[a-z0-9_-]{1,32}$"), "a kernel subsystem name such as usb")),
        list(HOTPLUG_SUBSYSTEMS))


@dataclass(frozen=True)
class HomeAssistantConfig:
    enabled: bool = setting(BOOL, False)
    prefix: str = setting(topic_level("a discovery prefix"), "homeassistant")


@dataclass(frozen=True)
class ModelBuildConfig:
    """``model build``: the isolated rknn-toolkit2 converter's interpreter (None: the
    EDGE_AGENT_RKNN_PYTHON variable, else the venv scripts/setup_rknn_converter.sh makes)."""

    rknn_python: str | None = setting(optional(PATH), None)


def _qos_mode(value: Any) -> str | None:
    """off, advise or control; a bare ``off`` is YAML 1.1's false, and means off too."""
    if value is False:
        return None
    return choice("off", "advise", "control")(value)


@dataclass(frozen=True)
class QosConfig:
    """The QoS controller while serving: ``off``; ``advise`` reports the lever moves it would
    make (``qos_action`` events) without making them; ``control`` makes them.  Each model's
    objective is its config.yaml ``qos``."""

    mode: str = setting(_qos_mode, "off", convert=lambda v: "off" if v is False else v)
    window_s: float = setting(number(0.1, 3600), 1.0, convert=float)


@dataclass(frozen=True)
class Config:
    """The whole file; no file (or an empty one) is the built-in demo."""

    # None: the loader derives it from the hostname and the machine id below root (nodeid.py)
    node_id: str = setting(topic_level("a node id"), None)
    fleet: str = setting(topic_level("a fleet name"), "default")
    groups: tuple[str, ...] = setting(("list", topic_level("a group name")), [])
    state_dir: str = setting(PATH, "/var/lib/edge-agent")
    root: str = setting(PATH, "/")
    mqtt: MqttConfig = section(MqttConfig)
    telemetry: TelemetryConfig = section(TelemetryConfig)
    tuning: TuningConfig = section(TuningConfig)
    inference: InferenceConfig = section(InferenceConfig)
    serve: ServeConfig = section(ServeConfig)
    control: ControlConfig = section(ControlConfig)
    prometheus: PrometheusConfig = section(PrometheusConfig)
    hotplug: HotplugConfig = section(HotplugConfig)
    home_assistant: HomeAssistantConfig = section(HomeAssistantConfig)
    model_build: ModelBuildConfig = section(ModelBuildConfig)
    qos: QosConfig = section(QosConfig)
    source: str = "built-in defaults"  # the file it came from, for messages
    # The merged document as the file spells it: overrides are merged into it and built again.
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def topic_root(self) -> str:
        """The topic root ``edge/v1/<fleet>/<node>``; every topic of this node lives under it."""
        from agent.protocol import node_root

        return node_root(self.fleet, self.node_id)

    @property
    def node_id_warning(self) -> str | None:
        """Why this node's id may be another device's too: the file sets none and the
        machine id is not usable (agent.config.nodeid); else None."""
        from agent.config.nodeid import default_id_warning

        return None if self.raw.get("node_id") is not None else default_id_warning(self.root)

    @property
    def repository(self) -> str:
        """The model repository: ``serve.repository``, else ``<state_dir>/repository``."""
        return self.serve.repository or f"{self.state_dir}/repository"

    @property
    def prometheus_listen(self) -> str | None:
        return self.prometheus.listen

    @property
    def home_assistant_enabled(self) -> bool:
        return self.home_assistant.enabled

    @property
    def home_assistant_prefix(self) -> str:
        return self.home_assistant.prefix
