"""The checks of the agent's config values that ``agent.validation`` does not offer.

Each returns None when the value is fine, else what is allowed, worded for the person who
edits the file.
"""

from __future__ import annotations

import re
from typing import Any

from agent.control.schemas import COMMANDS
from agent.serving.frigate_types import ALIASES, SERVED, UNSERVED
from agent.telemetry.groups import METRIC_GROUPS
from agent.validation import Check, shown, text

# One MQTT topic level: no wildcards, separators or spaces.
TOPIC_LEVEL = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
PATH = text(what="a file path")


def topic_level(what: str) -> Check:
    return text(TOPIC_LEVEL, f"{what}: letters, digits, '.', '_' and '-' (at most 64), "
                "no MQTT wildcards or '/'")


def host_port(value: Any) -> str | None:
    """host:port for the Prometheus endpoint."""
    if isinstance(value, str):
        host, _, port = value.rpartition(":")
        if host and port.isdigit() and 0 < int(port) < 65536:
            return None
    return "host:port such as 127.0.0.1:9101"


def listen_address(value: Any) -> str | None:
    """host:port to listen on; port 0 takes a free one (tests, selftest)."""
    if isinstance(value, str):
        host, _, port = value.rpartition(":")
        if host and port.isdigit() and 0 <= int(port) < 65536:
            return None
    return "host:port such as 127.0.0.1:8000 (port 0: any free port)"


def frigate_endpoint(value: Any) -> str | None:
    """Where Frigate's zmq detector connects: an ipc:// socket path (a Unix socket's path
    has at most 107 bytes), or tcp:// on loopback only, as its protocol has no
    authentication."""
    if isinstance(value, str) and value.startswith("ipc:///"):
        if len(value.removeprefix("ipc://").encode()) <= 107:
            return None
    elif isinstance(value, str) and value.startswith("tcp://"):
        host, _, port = value.removeprefix("tcp://").rpartition(":")
        if host.strip("[]") in ("127.0.0.1", "::1", "localhost") and port.isdigit() and \
                int(port) < 65536:
            return None
    return ("ipc:///ABSOLUTE/PATH (at most 107 bytes), or tcp://127.0.0.1:PORT (Frigate's "
            "zmq protocol has no authentication: loopback only)")


def frigate_model_type(value: Any) -> str | None:
    """Frigate's model type names this server post-processes (frigate_types.SERVED)."""
    if value is None or value in SERVED or value in ALIASES:
        return None
    served = ", ".join([*SERVED, *ALIASES])
    if value in UNSERVED:
        return f"one of {served} or null ({value} is not post-processed here)"
    return f"one of {served}, or null for the type each request's header names"


def _string_list(value: Any) -> str | None:
    ok = isinstance(value, list) and all(isinstance(item, str) and item for item in value)
    return None if ok else "a list of strings"


def metric_groups(value: Any) -> str | None:
    if value == "all" or (isinstance(value, list) and all(item in METRIC_GROUPS
                                                          for item in value)):
        return None
    unknown = [item for item in value if item not in METRIC_GROUPS] if isinstance(
        value, list) else []
    return f"all, or a list of {', '.join(METRIC_GROUPS)}" + (
        f" ({shown(unknown[0])} is not a metric group)" if unknown else "")


def onnx_providers(value: Any) -> str | None:
    return None if value == "auto" or _string_list(value) is None else (
        "auto, or a list of ONNX Runtime providers in order such as [CUDAExecutionProvider, "
        "CPUExecutionProvider]")


def dim_sizes(value: Any) -> str | None:
    ok = isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v > 0
        for k, v in value.items())
    return None if ok else "a mapping of dynamic dimension names to positive integers"


def input_source(value: Any) -> str | None:
    ok = value in ("none", "synthetic") or (isinstance(value, str)
                                            and value.startswith("npy:"))
    return None if ok else "none, synthetic, or npy:<directory of .npy files>"


def ed25519_key(value: Any) -> str | None:
    """Lazy: loading a config with no trusted keys does not load the cryptography."""
    from agent.control.envelope import load_public_key

    try:
        load_public_key(value)
    except (ValueError, TypeError):
        return "a base64 Ed25519 public key (edge-agent fleet keygen prints one)"
    return None


def command_names(value: Any) -> str | None:
    ok = isinstance(value, list) and all(item in COMMANDS for item in value)
    return None if ok else "a list of command names from " + ", ".join(COMMANDS)

