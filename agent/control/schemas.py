"""JSON Schemas of every command's ``args`` (and of desired state), compiled once.

ARGS is the registry of commands: the names the config's ``control.allow`` accepts (all of
them by default), and the handlers a service offers, are its keys.

Nothing a command receives is used before it passed its schema: unknown keys are refused,
strings are bounded and patterned, numbers ranged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from agent.telemetry.groups import METRIC_GROUPS

NAME = {"type": "string", "pattern": "^[a-z0-9][a-z0-9_-]{0,63}$"}
PATH = {"type": "string", "minLength": 1, "maxLength": 4096, "pattern": "^[^\\x00]+$"}
SHA256 = {"type": "string", "pattern": "^[0-9a-f]{64}$"}
NO_ARGS: dict[str, Any] = {"type": "object", "additionalProperties": False}

PROFILE_GUARD = {
    "type": "object", "additionalProperties": False,
    "properties": {"window_s": {"type": "number", "minimum": 0, "maximum": 3600},
                   "max_p99_ratio": {"type": "number", "minimum": 1},
                   "max_error_rate": {"type": "number", "minimum": 0, "maximum": 1},
                   "max_temp_c": {"type": "number", "minimum": 0, "maximum": 150}}}
MODEL_GUARD = {
    "type": "object", "additionalProperties": False,
    "properties": {"canary_s": {"type": "number", "minimum": 0, "maximum": 3600},
                   "max_p99_ratio": {"type": "number", "minimum": 1},
                   "max_error_rate": {"type": "number", "minimum": 0, "maximum": 1},
                   "max_p99_ms": {"type": "number", "exclusiveMinimum": 0}}}

ARGS: dict[str, dict[str, Any]] = {
    "ping": NO_ARGS,
    "get-topology": NO_ARGS,
    "get-status": NO_ARGS,
    "apply-profile": {"type": "object", "additionalProperties": False, "required": ["profile"],
                      "properties": {"profile": NAME, "force": {"type": "boolean"},
                                     "guard": PROFILE_GUARD}},
    "rollback-profile": NO_ARGS,
    "set-model": {"type": "object", "additionalProperties": False, "required": ["model"],
                  "properties": {"model": PATH, "sha256": SHA256, "guard": MODEL_GUARD}},
    "set-telemetry": {
        "type": "object", "additionalProperties": False, "minProperties": 1,
        "properties": {"interval_s": {"type": "number", "minimum": 0.05, "maximum": 86400},
                       "metrics": {"oneOf": [{"const": "all"}, {
                           "type": "array", "maxItems": 64, "uniqueItems": True,
                           "items": {"enum": list(METRIC_GROUPS)}}]}}},
    "rebirth": NO_ARGS,
    "restart-inference": NO_ARGS,
    "selftest": NO_ARGS,
}
COMMANDS = tuple(ARGS)
DESIRED = {"type": "object", "additionalProperties": False, "minProperties": 1,
           "properties": {"profile": {"oneOf": [NAME, {"type": "null"}]},
                          "model": PATH, "sha256": SHA256}}

ENVELOPE = {
    "type": "object", "additionalProperties": False,
    "required": ["id", "command", "issued_at", "expires_at", "target", "args", "sig"],
    "properties": {"id": {"type": "string", "minLength": 1, "maxLength": 128},
                   "command": {"type": "string", "maxLength": 64},
                   "issued_at": {"type": "integer"}, "expires_at": {"type": "integer"},
                   "target": {"type": "string", "maxLength": 200},
                   "args": {"type": "object"}, "sig": {"type": "string", "maxLength": 200},
                   "key_id": {"type": "string", "maxLength": 64}}}

Validator = Callable[[Any], Any]
_compiled: dict[str, Validator] = {}


def validator(name: str) -> Validator:
    """The compiled validator of a command's args (``desired``, ``envelope`` included).
    fastjsonschema loads here: the config reads COMMANDS without it."""
    import fastjsonschema

    if name not in _compiled:
        schema = {"desired": DESIRED, "envelope": ENVELOPE}.get(name) or ARGS[name]
        _compiled[name] = fastjsonschema.compile(schema)
    return _compiled[name]


def check(name: str, value: Any) -> str | None:
    """None when ``value`` fits schema ``name``, else what is wrong."""
    import fastjsonschema

    try:
        validator(name)(value)
    except fastjsonschema.JsonSchemaException as error:
        return str(error)
    return None
