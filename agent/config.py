"""The agent's configuration (``/etc/edge-agent/agent.yaml``): defaults, validation, types.

Every key has a default, so no file (or an empty one) runs the built-in demo.  Unknown keys
and bad values are errors that name the file and the key path.  The file is read directly,
not through a ``Root``: it says where the root is.
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from agent.discovery.udev import WATCHED_SUBSYSTEMS
from agent.inference.demo_model import DEMO_MODEL_PATH
from agent.kernel.fsroot import Root
from agent.telemetry.groups import METRIC_GROUPS
from agent.tuning.profiles import SAFE_LOADER, ProfileStore, deep_merge
from agent.validation import (
    Check,
    SettingsError,
    choice,
    integer,
    missing_directory,
    number,
    optional,
    shown,
    text,
    validate,
)

DEFAULT_PATH = "/etc/edge-agent/agent.yaml"
# One MQTT topic level: no wildcards, separators or spaces.
TOPIC_LEVEL = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
COMMANDS = ("ping", "get-topology", "get-status", "apply-profile", "rollback-profile",
            "set-model", "set-telemetry", "rebirth", "restart-inference", "selftest")


class ConfigError(SettingsError):
    """A configuration that cannot be used: ``file: key.path: message``."""


def _topic_level(what: str) -> Check:
    return text(TOPIC_LEVEL, f"{what}: letters, digits, '.', '_' and '-' (at most 64), "
                "no MQTT wildcards or '/'")


def _listen(value: Any) -> str | None:
    """host:port for the Prometheus endpoint."""
    if isinstance(value, str):
        host, _, port = value.rpartition(":")
        if host and port.isdigit() and 0 < int(port) < 65536:
            return None
    return "host:port such as 127.0.0.1:9101"


def _string_list(value: Any) -> str | None:
    ok = isinstance(value, list) and all(isinstance(item, str) and item for item in value)
    return None if ok else "a list of strings"


def _metrics(value: Any) -> str | None:
    if value == "all" or (isinstance(value, list) and all(item in METRIC_GROUPS
                                                          for item in value)):
        return None
    unknown = [item for item in value if item not in METRIC_GROUPS] if isinstance(
        value, list) else []
    return f"all, or a list of {', '.join(METRIC_GROUPS)}" + (
        f" ({shown(unknown[0])} is not a metric group)" if unknown else "")


def _providers(value: Any) -> str | None:
    return None if value == "auto" or _string_list(value) is None else (
        "auto, or a list of ONNX Runtime providers in order such as [CUDAExecutionProvider, "
        "CPUExecutionProvider]")


def _dims(value: Any) -> str | None:
    ok = isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v > 0
        for k, v in value.items())
    return None if ok else "a mapping of dynamic dimension names to positive integers"


def _source(value: Any) -> str | None:
    ok = value == "synthetic" or (isinstance(value, str) and value.startswith("npy:"))
    return None if ok else "synthetic, or npy:<directory of .npy files>"


def _public_key(value: Any) -> str | None:
    from agent.control.envelope import load_public_key

    try:
        load_public_key(value)
    except (ValueError, TypeError):
        return "a base64 Ed25519 public key (edge-agent fleet keygen prints one)"
    return None


def _allow(value: Any) -> str | None:
    ok = isinstance(value, list) and all(item in COMMANDS for item in value)
    return None if ok else "a list of command names from " + ", ".join(COMMANDS)


PATH = text(what="a file path")
SCHEMA: dict[str, Any] = {
    "node_id": _topic_level("a node id"),
    "fleet": _topic_level("a fleet name"),
    "groups": ("list", _topic_level("a group name")),
    "state_dir": PATH,
    "root": PATH,
    "mqtt": {
        "host": text(what="a host name or address"),
        "port": integer(1, 65535),
        "protocol": choice("5", "3.1.1"),
        "tls": optional(lambda v: None if isinstance(v, dict) else  # keys: TLS_SCHEMA
                        "a mapping with keys ca, cert, key ({} for the system's CAs)"),
        "username": optional(text()),
        "password_file": optional(PATH),
        "keepalive_s": integer(5, 3600),
        "max_payload_kb": integer(1, 256 * 1024),
        "reconnect": {"min_s": number(0.05, 3600), "max_s": number(0.05, 86400)},
    },
    "telemetry": {
        "interval_s": number(0.05, 86400),
        "outbox": {"max_mb": number(0.01, 1_000_000), "max_age_h": number(0.001, 100_000)},
        "replay_per_s": number(1, 1_000_000),
        "metrics": _metrics,
    },
    "tuning": {"profile": optional(text(what="a profile name, or auto")),
               "apply": choice(True, False), "rollback_on_stop": choice(True, False)},
    "inference": {"enabled": choice(True, False), "model": PATH, "sha256": optional(
        text(re.compile(r"^[0-9a-f]{64}$"), "64 lower-case hex digits")),
        "providers": _providers, "source": _source, "dims": _dims,
        "rate_hz": optional(number(0.001, 1_000_000))},
    "control": {"enabled": choice(True, False),
                "trusted_keys": ("list", {"id": text(), "public_key": _public_key}),
                "allow": _allow,
                "max_payload_kb": integer(1, 1024),
                "max_skew_s": number(0, 3600),
                "model_dirs": ("list", PATH),
                "guard": {"window_s": number(0, 3600), "max_p99_ratio": number(1, 1000),
                          "max_error_rate": number(0, 1),
                          "max_temp_c": optional(number(0, 150)),
                          "canary_s": number(0, 3600)}},
    "prometheus": {"listen": optional(_listen)},
    "hotplug": {"enabled": choice("auto", True, False),
                "subsystems": ("list", text(re.compile(r"^[a-z0-9_-]{1,32}$"),
                                            "a kernel subsystem name such as usb"))},
    "home_assistant": {"enabled": choice(True, False),
                       "prefix": _topic_level("a discovery prefix")},
}
TLS_SCHEMA = {"ca": optional(PATH), "cert": optional(PATH), "key": optional(PATH)}


def defaults() -> dict[str, Any]:
    """The built-in configuration: the demo model, a broker on localhost, nothing applied."""
    return {
        "node_id": re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname())[:64] or "node",
        "fleet": "default",
        "groups": [],
        "state_dir": "/var/lib/edge-agent",
        "root": "/",
        "mqtt": {"host": "localhost", "port": 1883, "protocol": "5", "tls": None,
                 "username": None, "password_file": None, "keepalive_s": 30,
                 "max_payload_kb": 64, "reconnect": {"min_s": 0.5, "max_s": 30.0}},
        "telemetry": {"interval_s": 1.0, "outbox": {"max_mb": 64, "max_age_h": 168},
                      "replay_per_s": 200, "metrics": "all"},
        "tuning": {"profile": "auto", "apply": False, "rollback_on_stop": True},
        "inference": {"enabled": True, "model": str(DEMO_MODEL_PATH), "sha256": None,
                      "providers": "auto", "source": "synthetic", "dims": {}, "rate_hz": None},
        "control": {"enabled": True, "trusted_keys": [], "allow": list(COMMANDS),
                    "max_payload_kb": 16, "max_skew_s": 30, "model_dirs": [],
                    "guard": {"window_s": 10, "max_p99_ratio": 1.5, "max_error_rate": 0.003,
                              "max_temp_c": None, "canary_s": 5}},
        "prometheus": {"listen": None},
        "hotplug": {"enabled": "auto", "subsystems": list(WATCHED_SUBSYSTEMS)},
        "home_assistant": {"enabled": False, "prefix": "homeassistant"},
    }


@dataclass(frozen=True)
class TlsConfig:
    ca: str | None = None
    cert: str | None = None
    key: str | None = None


@dataclass(frozen=True)
class MqttConfig:
    host: str
    port: int
    protocol: str
    tls: TlsConfig | None
    username: str | None
    password_file: str | None
    keepalive_s: int
    max_payload_kb: int
    reconnect_min_s: float
    reconnect_max_s: float


@dataclass(frozen=True)
class TelemetryConfig:
    interval_s: float
    outbox_max_bytes: int
    outbox_max_age_s: float
    replay_per_s: float
    metrics: tuple[str, ...] | None  # None: every group


@dataclass(frozen=True)
class TuningConfig:
    profile: str | None
    apply: bool
    rollback_on_stop: bool


@dataclass(frozen=True)
class InferenceConfig:
    enabled: bool
    model: str
    sha256: str | None
    providers: tuple[str, ...] | None  # None: chosen from the hardware
    source: str
    dims: dict[str, int]
    rate_hz: float | None


@dataclass(frozen=True)
class HotplugConfig:
    enabled: bool  # "auto" resolved: on for the real root, off for a fixture tree
    subsystems: tuple[str, ...]


@dataclass(frozen=True)
class Config:
    node_id: str
    fleet: str
    groups: tuple[str, ...]
    state_dir: str
    root: str
    mqtt: MqttConfig
    telemetry: TelemetryConfig
    tuning: TuningConfig
    inference: InferenceConfig
    control: dict[str, Any]
    prometheus_listen: str | None
    home_assistant_enabled: bool
    home_assistant_prefix: str
    hotplug: HotplugConfig = HotplugConfig(False, ())
    source: str = "built-in defaults"  # the file it came from, for messages
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def topic_root(self) -> str:
        """``edge/v1/<fleet>/<node>`` (DESIGN.md "MQTT")."""
        from agent.control.protocol import node_root

        return node_root(self.fleet, self.node_id)


def _check_consistency(data: dict[str, Any], file: str) -> None:
    reconnect = data["mqtt"]["reconnect"]
    if reconnect["min_s"] > reconnect["max_s"]:
        raise ConfigError(file, "mqtt.reconnect.min_s",
                          f"{reconnect['min_s']} is above max_s {reconnect['max_s']}")
    tls = data["mqtt"]["tls"]
    if tls is not None:
        validate(tls, TLS_SCHEMA, "mqtt.tls", file, ConfigError)
        if bool(tls.get("cert")) != bool(tls.get("key")):
            raise ConfigError(file, "mqtt.tls", "cert and key go together (mTLS); give both "
                              "or neither")
    if data["mqtt"]["username"] is None and data["mqtt"]["password_file"]:
        raise ConfigError(file, "mqtt.password_file", "needs mqtt.username")


def _normalised(data: dict[str, Any]) -> dict[str, Any]:
    """What people write that YAML reads as another type: ``protocol: 5`` is an int (3.1.1
    can only be a string)."""
    mqtt = data.get("mqtt")
    if isinstance(mqtt, dict) and type(mqtt.get("protocol")) is int and mqtt["protocol"] == 5:
        return {**data, "mqtt": {**mqtt, "protocol": "5"}}
    return data


def from_dict(data: Any, file: str = "built-in defaults") -> Config:
    """Validate a parsed document, fill in the defaults and build the typed config."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(file, "", "the configuration is a YAML mapping of sections "
                          f"({', '.join(SCHEMA)})")
    data = _normalised(data)
    validate(data, SCHEMA, "", file, ConfigError)
    merged = deep_merge(defaults(), data)
    _check_consistency(merged, file)
    mqtt, telemetry, inference = merged["mqtt"], merged["telemetry"], merged["inference"]
    return Config(
        node_id=merged["node_id"], fleet=merged["fleet"], groups=tuple(merged["groups"]),
        state_dir=merged["state_dir"], root=merged["root"],
        mqtt=MqttConfig(
            host=mqtt["host"], port=mqtt["port"], protocol=mqtt["protocol"],
            tls=TlsConfig(**mqtt["tls"]) if mqtt["tls"] is not None else None,
            username=mqtt["username"], password_file=mqtt["password_file"],
            keepalive_s=mqtt["keepalive_s"], max_payload_kb=mqtt["max_payload_kb"],
            reconnect_min_s=float(mqtt["reconnect"]["min_s"]),
            reconnect_max_s=float(mqtt["reconnect"]["max_s"])),
        telemetry=TelemetryConfig(
            interval_s=float(telemetry["interval_s"]),
            outbox_max_bytes=int(telemetry["outbox"]["max_mb"] * 1024 * 1024),
            outbox_max_age_s=float(telemetry["outbox"]["max_age_h"]) * 3600,
            replay_per_s=float(telemetry["replay_per_s"]),
            metrics=None if telemetry["metrics"] == "all" else tuple(telemetry["metrics"])),
        tuning=TuningConfig(**merged["tuning"]),
        inference=InferenceConfig(
            enabled=inference["enabled"], model=inference["model"], sha256=inference["sha256"],
            providers=None if inference["providers"] == "auto" else tuple(
                inference["providers"]),
            source=inference["source"], dims=dict(inference["dims"]),
            rate_hz=inference["rate_hz"]),
        control=merged["control"],
        prometheus_listen=merged["prometheus"]["listen"],
        home_assistant_enabled=merged["home_assistant"]["enabled"],
        home_assistant_prefix=merged["home_assistant"]["prefix"],
        hotplug=HotplugConfig(
            enabled=(merged["root"] == "/" if merged["hotplug"]["enabled"] == "auto"
                     else merged["hotplug"]["enabled"]),
            subsystems=tuple(merged["hotplug"]["subsystems"])),
        source=file, raw=merged)


def check_root(config: Config) -> None:
    """For the commands that read the device through ``root``: it must be a directory."""
    problem = missing_directory(config.root)
    if problem is not None:
        raise ConfigError(config.source, "root", problem)


def profile_problem(config: Config) -> ConfigError | None:
    """``tuning.profile`` names a profile the store holds (builtin or site, through the
    config's root, which must exist); not fatal to ``run``, which starts degraded."""
    if config.tuning.profile is None:
        return None
    problem = ProfileStore(Root(config.root)).not_here(config.tuning.profile)
    return None if problem is None else ConfigError(config.source, "tuning.profile", problem)


def load_config(path: str | None = None) -> Config:
    """``path``, else ``/etc/edge-agent/agent.yaml`` when it exists, else the defaults."""
    if path is None:
        if not Path(DEFAULT_PATH).is_file():
            return from_dict({})
        path = DEFAULT_PATH
    try:
        document = Path(path).read_text()
    except OSError as error:
        raise ConfigError(path, "", f"cannot be read: {error.strerror or error}") from error
    try:
        data = yaml.load(document, Loader=SAFE_LOADER)
    except yaml.YAMLError as error:
        raise ConfigError(path, "", f"is not valid YAML: {error}") from error
    return from_dict(data, path)
