"""What a JSON Schema rule accepts, in words, for a refusal's message.

fastjsonschema names the key and the rule that failed ("data.qos.p99_ms must be number",
"must not contain {'extra'} properties") but not what would have been accepted; an operator
should not need the schema to correct a command, so a refusal ends with it.
"""

from __future__ import annotations

import re
from typing import Any

TYPES = {"number": "a number", "integer": "an integer", "string": "a string",
         "boolean": "true or false", "null": "null", "object": "an object",
         "array": "a list"}


def refusal(message: str, name: str, rule: str, value: Any, definition: Any) -> str:
    """fastjsonschema's ``message`` for ``value`` at ``name`` in plain words where its own
    are the schema's ("must be valid exactly by one definition", "must contain ['model']
    properties"), with what would have been accepted."""
    keys = value if isinstance(value, dict) else {}
    rules = definition if isinstance(definition, dict) else {}
    if rule == "oneOf":
        message = f"{name}: {value!r} is not allowed"
    elif rule == "required":
        missing = [key for key in rules.get("required", ()) if key not in keys]
        message = f"{name}: {', '.join(missing) or 'a key'} missing"
    elif rule == "additionalProperties":
        known = rules.get("properties", {})
        if not known:
            return f"{name}: takes no arguments"
        message = f"{name}: unknown key {', '.join(k for k in keys if k not in known)}"
    elif rule == "propertyNames":
        pattern = (rules.get("propertyNames") or {}).get("pattern", "")
        bad = [key for key in keys if not re.search(pattern, str(key))]
        message = f"{name}: {', '.join(map(repr, bad)) or 'a name'} is not a name allowed here"
    words = expected(rule, definition)
    return message + (f" (expected {words})" if words else "")


def expected(rule: str, definition: Any) -> str:
    """The words for what ``definition`` accepts where ``rule`` of it failed; "" when the
    refusal says it already (an enum lists its values)."""
    if not isinstance(definition, dict) or rule in ("enum", "pattern", "const"):
        return ""  # the refusal names the values, the pattern
    if rule == "propertyNames":
        return f"each name {describe(definition.get('propertyNames'))}"
    if rule in ("maxProperties", "maxItems", "minItems", "uniqueItems"):
        return ""  # the refusal gives the bound
    return describe(definition)


def describe(definition: Any) -> str:
    """``definition`` in a phrase: its type with range or pattern, its keys, its choices."""
    if not isinstance(definition, dict):
        return "anything"
    if "oneOf" in definition:
        return "; or ".join(describe(branch) for branch in definition["oneOf"])
    if "enum" in definition:
        return "one of " + ", ".join(map(_literal, definition["enum"]))
    if "const" in definition:
        return _literal(definition["const"])
    kinds = definition.get("type", [])
    words = [_one_type(kind, definition)
             for kind in ([kinds] if isinstance(kinds, str) else kinds)]
    return "; or ".join(words) or "anything"


def _one_type(kind: str, definition: dict[str, Any]) -> str:
    words = TYPES.get(kind, kind)
    if kind in ("number", "integer"):
        low = definition.get("minimum", definition.get("exclusiveMinimum"))
        high = definition.get("maximum", definition.get("exclusiveMaximum"))
        if low is not None or high is not None:
            words += f" {'' if low is None else low}..{'' if high is None else high}"
    elif kind == "string" and "pattern" in definition:
        words += f" matching {definition['pattern']}"
    elif kind == "object" and "properties" in definition:
        required = set(definition.get("required", ()))
        keys = [f"{key} (required)" if key in required else key
                for key in definition["properties"]]
        words += " with keys " + ", ".join(keys)
    elif kind == "array" and "items" in definition:
        words += f" of {describe(definition['items'])}"
    return words


def _literal(value: Any) -> str:
    return "null" if value is None else repr(value) if isinstance(value, str) else str(value)
