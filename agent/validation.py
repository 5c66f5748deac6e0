"""Declarative checks for YAML documents (profiles, the agent's config) and one validator.

A schema is a dict of key -> Check, a nested dict (a mapping with fixed keys), ``("list",
rule)``, ``("map", key_check, rule)`` or ``("nullable", mapping_rule, what)`` (null, or a
mapping that ``mapping_rule`` accepts; ``what`` describes the mapping for the message) or
``("switch", mapping_rule, what)`` (false for "off", or such a mapping).
Errors name the file, the key path, the value and what is allowed, so an operator can fix
the file without reading the code.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

Check = Callable[[Any], str | None]  # None when fine, else what is allowed


class SettingsError(ValueError):
    """A document that cannot be used: ``file: key.path: message``."""

    def __init__(self, file: str, key: str, message: str) -> None:
        self.file, self.key, self.message = file, key, message
        super().__init__(f"{file}: {key}: {message}" if key else f"{file}: {message}")


def missing_directory(path: str) -> str | None:
    """``PATH: no such directory`` unless ``path`` is one: the wording of ``--root`` and
    ``root:`` alike (the caller puts the flag or ``file: key`` in front)."""
    return None if Path(path).is_dir() else f"{path}: no such directory"


def shown(value: Any, _outer: tuple[int, ...] = ()) -> str:
    """A value as the YAML file spells it (true, null, [a, b]), strings quoted so that '5'
    and 5 differ: what an error message quotes back to the person who wrote it.  An alias
    that contains itself (``&m {a: *m}``) is shown as ``...`` where it recurs."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, list | tuple | dict):
        if id(value) in _outer:
            return "..."
        outer = (*_outer, id(value))
        if isinstance(value, dict):
            return "{" + ", ".join(f"{shown(k, outer)}: {shown(v, outer)}"
                                   for k, v in value.items()) + "}"
        return "[" + ", ".join(shown(item, outer) for item in value) + "]"
    return repr(value)


def _word(value: object) -> str:
    """An allowed value in a list of them: strings bare (``one of madvise, never``)."""
    return value if isinstance(value, str) else shown(value)


def key_label(name: object) -> str:
    """A key in a key path: as written, or shown when it is '' or not a string (true: ...)."""
    return name if isinstance(name, str) and name else shown(name)


def choice(*allowed: object) -> Check:
    """Equal and of the same type: YAML's true is not the kernel's 1, nor 2.0 its 2."""
    def check(value: Any) -> str | None:
        ok = any(value == a and type(value) is type(a) for a in allowed)
        if ok:
            return None
        if len(allowed) == 2 and all(isinstance(a, bool) for a in allowed):
            return "true or false"
        return "one of " + ", ".join(map(_word, allowed))
    return check


def integer(low: int, high: int | None = None) -> Check:
    def check(value: Any) -> str | None:
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= low and (
            high is None or value <= high)
        return None if ok else f"an integer {low}..{high if high is not None else ''}".rstrip(".")
    return check


def number(low: float, high: float) -> Check:
    """A finite number in range: YAML's .nan and .inf are floats, and NaN passes no range
    check by comparison alone only because every comparison with it is false."""
    def check(value: Any) -> str | None:
        ok = isinstance(value, int | float) and not isinstance(value, bool) and (
            isinstance(value, int) or math.isfinite(value)) and low <= value <= high
        return None if ok else f"a number {low}..{high}" + _exponent_hint(value)
    return check


def _exponent_hint(value: Any) -> str:
    """YAML 1.1 (PyYAML) reads 5e1 as text: a float needs a dot and the exponent's sign."""
    match = re.fullmatch(r"([-+]?[0-9]+)(\.[0-9]*)?[eE]([-+]?)([0-9]+)", value) \
        if isinstance(value, str) else None
    if match is None:
        return ""
    whole, fraction, sign, digits = match.groups()
    return (f" (YAML reads {value} as text: write {float(value):g}, or "
            f"{whole}{fraction if fraction and fraction != '.' else '.0'}e{sign or '+'}{digits})")


def text(pattern: re.Pattern[str] | None = None, what: str = "a string") -> Check:
    def check(value: Any) -> str | None:
        ok = isinstance(value, str) and bool(value) and (pattern is None or pattern.match(value))
        return None if ok else what
    return check


def optional(check: Check) -> Check:
    """``check``, or null (YAML ``~``) for "not set"."""
    def nullable(value: Any) -> str | None:
        allowed = None if value is None else check(value)
        return None if allowed is None else f"{allowed}, or null"
    return nullable


def validate(value: Any, rule: Any, key: str, file: str,
             error: type[SettingsError] = SettingsError) -> None:
    """Check ``value`` against ``rule``; raise ``error`` at the first key that is wrong."""
    if isinstance(rule, dict):
        if not isinstance(value, dict):
            raise error(file, key, f"expected a mapping with keys {', '.join(rule)}")
        for name, item in value.items():
            label = key_label(name)
            path = f"{key}.{label}" if key else label
            if name not in rule:
                raise error(file, path, f"unknown key (allowed: {', '.join(rule)})")
            validate(item, rule[name], path, file, error)
    elif isinstance(rule, tuple) and rule[0] == "list":
        if not isinstance(value, list):
            raise error(file, key, "expected a list")
        for index, item in enumerate(value):
            validate(item, rule[1], f"{key}[{index}]", file, error)
    elif isinstance(rule, tuple) and rule[0] == "map":
        if not isinstance(value, dict) or not value:
            raise error(file, key, "expected a non-empty mapping")
        for name, item in value.items():
            path = f"{key}.{key_label(name)}"
            allowed = rule[1](name)
            if allowed is not None:
                raise error(file, path, f"bad key {shown(name)}: expected {allowed}")
            validate(item, rule[2], path, file, error)
    elif isinstance(rule, tuple) and rule[0] == "nullable":
        if value is not None and not isinstance(value, dict):
            raise error(file, key, f"{shown(value)} is not allowed: expected {rule[2]}, or null")
        if value is not None:
            validate(value, rule[1], key, file, error)
    elif isinstance(rule, tuple) and rule[0] == "switch":
        if value is not False and not isinstance(value, dict):
            raise error(file, key, f"{shown(value)} is not allowed: expected {rule[2]}, or "
                        "false to turn it off")
        if value is not False:
            validate(value, rule[1], key, file, error)
    else:
        allowed = rule(value)
        if allowed is not None:
            raise error(file, key, f"{shown(value)} is not allowed: expected {allowed}")
