"""JSON Schemas of every command's ``args`` (and of desired state), compiled once.

ARGS is the registry of commands: the names the config's ``control.allow`` accepts (all of
them by default), and the handlers a service offers, are its keys.

Nothing a command receives is used before it passed its schema: unknown keys are refused,
strings are bounded and patterned, numbers ranged and finite, and an ``integer`` is a JSON
integer (fastjsonschema takes 1e300 and 2.0 for one; ``check`` does not).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from agent.control.expected import refusal
from agent.telemetry.groups import METRIC_GROUPS

NAME = {"type": "string", "pattern": "^[a-z0-9][a-z0-9_-]{0,63}$"}
PATH = {"type": "string", "minLength": 1, "maxLength": 4096, "pattern": "^[^\\x00]+$"}
SHA256 = {"type": "string", "pattern": "^[0-9a-f]{64}$"}
NO_ARGS: dict[str, Any] = {"type": "object", "additionalProperties": False}
MODEL_NAME = {"type": "string", "pattern": "^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,63}$"}
# What agent.modelbuild builds for (its request's TARGETS and rknn:<platform>): the control
# layer sits below it, so the names are repeated here; the build checks them again.
BUILD_TARGETS = ["cpu", "tensorrt", "openvino", "rknn:rk3588", "rknn:rk3576", "rknn:rk3566"]
BUILD_PRECISIONS = ["int8", "fp16"]
RATIO = {"type": "number", "minimum": 0, "maximum": 1}
# A model's qos: as agent.serving.settings checks it in a config.yaml (QOS_CLASSES,
# QOS_P99_MS, QOS_MIN_RPS; repeated here, below that layer; a test holds them equal), or
# null: the model has no objective.  One schema, not a oneOf: a refusal names the key.
QOS_OR_NONE = {"type": ["object", "null"], "additionalProperties": False, "required": ["class"],
               "properties": {
                   "class": {"enum": ["latency_critical", "throughput", "best_effort"]},
                   "p99_ms": {"type": "number", "minimum": 0.01, "maximum": 3_600_000},
                   "min_rps": {"type": "number", "minimum": 0.001, "maximum": 1_000_000}}}
MAX_DESIRED_MODELS = 64
PIXEL_TRIPLE = {"type": "array", "minItems": 3, "maxItems": 3,
                "items": {"type": "number", "minimum": -255, "maximum": 255}}

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
                  "properties": {"model": PATH, "sha256": SHA256, "guard": MODEL_GUARD,
                                 "name": MODEL_NAME}},
    "build-model": {
        "type": "object", "additionalProperties": False, "required": ["source"],
        "properties": {
            "source": PATH, "name": MODEL_NAME, "target": {"enum": BUILD_TARGETS},
            "precision": {"enum": BUILD_PRECISIONS}, "calibration": PATH,
            "gate": {"type": "object", "additionalProperties": False,
                     "properties": {"top1": RATIO, "cosine": RATIO,
                                    "speed": {"type": "number", "minimum": 0, "maximum": 100}}},
            "preprocess": {"type": "object", "additionalProperties": False,
                           "properties": {"mean": PIXEL_TRIPLE,
                                          "std": {**PIXEL_TRIPLE, "items": {
                                              "type": "number", "minimum": 1e-6,
                                              "maximum": 255}},
                                          "order": {"enum": ["rgb", "bgr"]}}},
            "guard": MODEL_GUARD}},
    "set-qos": {"type": "object", "additionalProperties": False, "required": ["model", "qos"],
                "properties": {"model": MODEL_NAME, "qos": QOS_OR_NONE}},
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
                          "model": PATH, "sha256": SHA256,
                          # per model: what set-qos sets, converged the same way
                          "models": {"type": "object", "maxProperties": MAX_DESIRED_MODELS,
                                     "propertyNames": MODEL_NAME,
                                     "additionalProperties": {
                                         "type": "object", "additionalProperties": False,
                                         "minProperties": 1,
                                         "properties": {"qos": QOS_OR_NONE}}}}}

MILLISECONDS = {"type": "integer", "minimum": 0, "maximum": 2 ** 53 - 1}  # exact in any JSON
ENVELOPE = {
    "type": "object", "additionalProperties": False,
    "required": ["id", "command", "issued_at", "expires_at", "target", "args", "sig"],
    "properties": {"id": {"type": "string", "minLength": 1, "maxLength": 128},
                   "fleet": {"type": "string", "maxLength": 64},
                   "command": {"type": "string", "maxLength": 64},
                   "issued_at": MILLISECONDS, "expires_at": MILLISECONDS,
                   "target": {"type": "string", "maxLength": 200},
                   "args": {"type": "object"}, "sig": {"type": "string", "maxLength": 200},
                   "key_id": {"type": "string", "maxLength": 64}}}
# Desired state: an envelope whose command is "desired"; ``clear: true`` (args {}) removes it.
DESIRED_ENVELOPE = {**ENVELOPE, "properties": {**ENVELOPE["properties"],  # type: ignore[dict-item]
                                               "clear": {"const": True}}}
SCHEMAS: dict[str, dict[str, Any]] = {"desired": DESIRED, "envelope": ENVELOPE,
                                      "desired-envelope": DESIRED_ENVELOPE}

Validator = Callable[[Any], Any]
_compiled: dict[str, Validator] = {}


def validator(name: str) -> Validator:
    """The compiled validator of a command's args (``desired``, ``envelope`` included).
    fastjsonschema loads here: the config reads COMMANDS without it."""
    import fastjsonschema

    if name not in _compiled:
        _compiled[name] = fastjsonschema.compile(SCHEMAS.get(name) or ARGS[name])
    return _compiled[name]


def check(name: str, value: Any) -> str | None:
    """None when ``value`` fits schema ``name``, else what is wrong."""
    import fastjsonschema

    try:
        validator(name)(value)
    except fastjsonschema.JsonSchemaValueException as error:
        return refusal(error.message, error.name or "data", error.rule or "", error.value,
                       error.definition)
    return _strict(SCHEMAS.get(name) or ARGS[name], value, "data")


def _strict(schema: Any, value: Any, where: str) -> str | None:
    """What fastjsonschema lets through: a float where an integer is declared (1e300), a
    NaN or infinity where a number is (its range checks are comparisons NaN passes).
    Every value is walked, a ``oneOf`` branch's schema-less (none holds an integer)."""
    rule = schema if isinstance(schema, dict) else {}
    if isinstance(value, float):
        if not math.isfinite(value):
            return f"{where} must be a finite number"
        if rule.get("type") == "integer":
            return f"{where} must be integer"
    elif isinstance(value, dict):
        properties = rule.get("properties", {})
        for key, item in value.items():
            problem = _strict(properties.get(key), item, f"{where}.{key}")
            if problem:
                return problem
    elif isinstance(value, list):
        for index, item in enumerate(value):
            problem = _strict(rule.get("items"), item, f"{where}[{index}]")
            if problem:
                return problem
    return None
