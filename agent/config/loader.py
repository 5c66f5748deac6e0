"""Loading ``/etc/edge-agent/agent.yaml``: parse, check against the declared sections, merge
over the defaults, check that the values agree, build the typed config.

Unknown keys and bad values are errors that name the file and the key path.  The file is
read directly, not through a ``Root``: it says where the root is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from agent import yamlfile
from agent.config.declare import build, defaults, schema
from agent.config.nodeid import default_node_id
from agent.config.sections import Config, MqttConfig
from agent.kernel.fsroot import Root
from agent.tuning.profiles import ProfileStore, deep_merge
from agent.validation import SettingsError, missing_directory, validate

DEFAULT_PATH = "/etc/edge-agent/agent.yaml"
SCHEMA = schema(Config)
_ONE_BROKER = {key: defaults(MqttConfig)[key] for key in ("host", "port")}


class ConfigError(SettingsError):
    """A configuration that cannot be used: ``file: key.path: message``."""


def _check_consistency(data: dict[str, Any], file: str) -> None:
    mqtt = data["mqtt"]
    given = [f"mqtt.{key} {mqtt[key]!r}" for key in _ONE_BROKER if mqtt[key] != _ONE_BROKER[key]]
    if mqtt["brokers"] is not None and given:
        raise ConfigError(file, "mqtt.brokers", "give either mqtt.brokers or mqtt.host/"
                          f"mqtt.port, not both ({' and '.join(given)} given too)")
    reconnect = data["mqtt"]["reconnect"]
    if reconnect["min_s"] > reconnect["max_s"]:
        raise ConfigError(file, "mqtt.reconnect.min_s",
                          f"{reconnect['min_s']} is above max_s {reconnect['max_s']}")
    tls = data["mqtt"]["tls"]
    if tls is not None and bool(tls.get("cert")) != bool(tls.get("key")):
        raise ConfigError(file, "mqtt.tls", "cert and key go together (mTLS); give both "
                          "or neither")
    if data["mqtt"]["username"] is None and data["mqtt"]["password_file"]:
        raise ConfigError(file, "mqtt.password_file", "needs mqtt.username")
    _check_serve(data["serve"], file)


def _check_serve(serve: dict[str, Any], file: str) -> None:
    """The data plane runs as root: beyond loopback, every call needs TLS and the token."""
    from agent.serving.access import is_loopback

    tls = serve["tls"]
    if tls is not None and not (tls.get("cert") and tls.get("key")):
        raise ConfigError(file, "serve.tls", "needs both cert and key")
    inflight = serve["max_inflight_mb"]
    if inflight is not None and inflight < serve["max_request_mb"]:
        raise ConfigError(file, "serve.max_inflight_mb", f"{inflight} is below "
                          f"serve.max_request_mb {serve['max_request_mb']}: no request of the "
                          "largest allowed size could ever be admitted")
    for key in ("http", "grpc", "metrics"):
        if serve[key] is None:
            continue
        host = serve[key].rpartition(":")[0]
        if not is_loopback(host) and tls is None:
            raise ConfigError(file, f"serve.{key}", f"{serve[key]} is not a loopback "
                              "address: it needs serve.tls (cert, key), and every call then "
                              "needs the token of serve.token_file")


def _normalised(data: dict[str, Any]) -> dict[str, Any]:
    """What people write that YAML reads as another type: ``protocol: 5`` is an int (3.1.1
    can only be a string)."""
    mqtt = data.get("mqtt")
    if isinstance(mqtt, dict) and type(mqtt.get("protocol")) is int and mqtt["protocol"] == 5:
        return {**data, "mqtt": {**mqtt, "protocol": "5"}}
    return data


def _resolved(merged: dict[str, Any]) -> dict[str, Any]:
    """The values that depend on another key: ``hotplug.enabled: auto`` is on for the real
    root, off for a fixture tree; a ``node_id`` the file does not set comes from the machine
    id below the root.  ``raw`` keeps them unresolved (no ``node_id``), so a config built
    again from it with another root resolves them anew."""
    resolved = dict(merged)
    if merged["node_id"] is None:
        resolved["node_id"] = default_node_id(merged["root"])
    hotplug = merged["hotplug"]
    if hotplug["enabled"] == "auto":
        resolved["hotplug"] = {**hotplug, "enabled": merged["root"] == "/"}
    return resolved


def from_dict(data: Any, file: str = "built-in defaults") -> Config:
    """Validate a parsed document, fill in the defaults and build the typed config."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(file, "", "the configuration is a YAML mapping of sections "
                          f"({', '.join(SCHEMA)})")
    data = _normalised(data)
    validate(data, SCHEMA, "", file, ConfigError)
    merged = deep_merge(defaults(Config), data)
    _check_consistency(merged, file)
    raw = {key: value for key, value in merged.items() if value is not None or key != "node_id"}
    return build(Config, _resolved(merged), "", file, ConfigError, source=file, raw=raw)


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
        document = yamlfile.decode(Path(path).read_bytes())
    except OSError as error:
        raise ConfigError(path, "", f"cannot be read: {error.strerror or error}") from error
    except yamlfile.NotUtf8Error as error:
        raise ConfigError(path, "", str(error)) from None
    try:
        data = yamlfile.load(document)
    except yamlfile.DuplicateKeyError as error:
        raise ConfigError(path, error.path, error.message) from None
    except yaml.YAMLError as error:
        raise ConfigError(path, "", f"is not valid YAML: {error}") from error
    return from_dict(data, path)
