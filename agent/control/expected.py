"""What a JSON Schema rule accepts, in words, for a refusal's message.

fastjsonschema names the key and the rule that failed ("data.qos.p99_ms must be number",
"must not contain {'extra'} properties") but not what would have been accepted; an operator
should not need the schema to correct a command, so a refusal ends with it.
"""

from __future__ import annotations

from typing import Any

TYPES = {"number": "a number", "integer": "an integer", "string": "a string",
         "boolean": "true or false", "null": "null", "object": "an object",
         "array": "a list"}


def expected(rule: str, definition: Any) -> str:
    """The words for what ``definition`` accepts where ``rule`` of it failed; "" when the
    refusal says it already (an enum lists its values)."""
    if not isinstance(definition, dict) or rule == "enum":
        return ""
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
