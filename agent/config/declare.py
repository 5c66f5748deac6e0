"""A YAML section declared once: a frozen dataclass whose fields say their rule and default.

From the declaration come the schema that ``agent.validation`` checks a document against
(so messages name the file, key path, value and what is allowed), the defaults as the file
spells them, and the typed object built from the checked, merged document.  A new key is
one field.  Fields without this metadata (a config's ``source``) are not keys of the file.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import MISSING, dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from agent.validation import SettingsError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")
_KEY = "key"  # the field metadata entry that holds a Setting, Section or Entries


@dataclass(frozen=True)
class Setting:
    """A value: its rule, its default as the file spells it (MISSING: the key is required)
    or a factory for one, and how the file's value becomes the typed one (lists become
    tuples when there is no ``convert``)."""

    rule: Any
    default: Any = MISSING
    factory: Callable[[], Any] | None = None
    convert: Callable[[Any], Any] | None = None

    def schema(self) -> Any:
        return self.rule

    @property
    def required(self) -> bool:
        return self.default is MISSING and self.factory is None

    def fallback(self) -> Any:
        return self.factory() if self.factory is not None else copy.deepcopy(self.default)

    def build(self, value: Any, path: str, file: str, error: type[SettingsError]) -> Any:
        if self.convert is not None:
            return self.convert(value)
        return tuple(value) if isinstance(value, list) else value


@dataclass(frozen=True)
class Section:
    """A mapping declared by ``kind``.  ``nullable``: null by default, and what an empty
    mapping means, for the message that says what the value may be.  ``switchable``: on
    (its defaults) unless the file says false, which builds None."""

    kind: type[DataclassInstance]
    nullable: str | None = None
    switchable: bool = False
    required = False

    def schema(self) -> Any:
        rule = schema(self.kind)
        if self.switchable:
            return ("switch", rule, f"a mapping with keys {', '.join(rule)}")
        if self.nullable is None:
            return rule
        return ("nullable", rule, f"a mapping with keys {', '.join(rule)} ({self.nullable})")

    def fallback(self) -> Any:
        return None if self.nullable is not None else defaults(self.kind)

    def build(self, value: Any, path: str, file: str, error: type[SettingsError]) -> Any:
        if value is None or value is False:
            return None
        return build(self.kind, value, path, file, error)


@dataclass(frozen=True)
class Entries:
    """A list of mappings declared by ``kind``, empty by default."""

    kind: type[DataclassInstance]
    required = False

    def schema(self) -> Any:
        return ("list", schema(self.kind))

    def fallback(self) -> Any:
        return []

    def build(self, value: Any, path: str, file: str, error: type[SettingsError]) -> Any:
        return tuple(build(self.kind, item, f"{path}[{index}]", file, error)
                     for index, item in enumerate(value))


Key = Setting | Section | Entries


def setting(rule: Any, default: Any = MISSING, *, factory: Callable[[], Any] | None = None,
            convert: Callable[[Any], Any] | None = None) -> Any:
    """A field that is a value of the file (see Setting)."""
    return dataclasses.field(metadata={_KEY: Setting(rule, default, factory, convert)})


def section(kind: type[DataclassInstance], nullable: str | None = None,
            switchable: bool = False) -> Any:
    """A field that is a nested mapping (see Section)."""
    return dataclasses.field(metadata={_KEY: Section(kind, nullable, switchable)})


def entries(kind: type[DataclassInstance]) -> Any:
    """A field that is a list of mappings (see Entries)."""
    return dataclasses.field(metadata={_KEY: Entries(kind)})


def keys(kind: type[DataclassInstance]) -> dict[str, Key]:
    """The declared keys of ``kind``, in the order the file's messages list them."""
    return {f.name: f.metadata[_KEY] for f in dataclasses.fields(kind) if _KEY in f.metadata}


def schema(kind: type[DataclassInstance]) -> dict[str, Any]:
    """The rule tree ``agent.validation.validate`` checks a document against."""
    return {name: key.schema() for name, key in keys(kind).items()}


def defaults(kind: type[DataclassInstance]) -> dict[str, Any]:
    """Every key that has a default, as the file would spell it."""
    return {name: key.fallback() for name, key in keys(kind).items() if not key.required}


def build(kind: type[T], document: dict[str, Any], path: str, file: str,
          error: type[SettingsError], **extra: Any) -> T:
    """The typed ``kind`` from a checked document; keys it lacks take their defaults, and a
    required one missing is ``error``.  ``extra``: the fields that are not keys."""
    values = dict(extra)
    for name, key in keys(kind).items():
        if name not in document and key.required:
            raise error(file, path, f"missing {name}")
        value = document[name] if name in document else key.fallback()
        values[name] = key.build(value, f"{path}.{name}" if path else name, file, error)
    return kind(**values)
