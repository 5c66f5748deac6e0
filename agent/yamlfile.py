"""Reading a person's YAML file: UTF-8 text, and a mapping that gives no key twice.

``yaml.safe_load`` keeps the last of two equal keys without a word, so a second ``mqtt:``
section silently replaces the first; the loader here refuses it with both lines.  Everything
else is ``safe_load``'s: the same tags, no arbitrary objects.  The callers turn the errors into
their own (ConfigError, ProfileError, ModelSettingsError), which name the file.
"""

from __future__ import annotations

import codecs
from typing import Any

import yaml

from agent.validation import key_label

# libyaml's safe loader when PyYAML was built with it: several times faster than pure Python
_BASE: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_MERGE = "tag:yaml.org,2002:merge"
_NO_KEY = object()  # a key node that builds no hashable value: the constructor refuses it


class DuplicateKeyError(yaml.YAMLError):
    """A key given twice in one mapping: ``path`` is its dotted key path, lines count from 1."""

    def __init__(self, path: str, first: int, second: int) -> None:
        self.path, self.first, self.second = path, first, second
        super().__init__(f"{path}: given twice (lines {first} and {second})")

    @property
    def message(self) -> str:
        """The words after the key path, for the callers' ``file: key: message`` errors."""
        return f"given twice (lines {self.first} and {self.second})"


class NotUtf8Error(ValueError):
    """A file that is not UTF-8 text; the message says what it looks like instead."""


class UniqueKeyLoader(_BASE):  # type: ignore[valid-type,misc]
    """The safe loader, refusing a mapping key given twice, at any depth."""

    def construct_document(self, node: yaml.Node) -> Any:
        self._check_unique(node)
        return super().construct_document(node)

    def _check_unique(self, root: yaml.Node) -> None:
        """Walk the composed nodes (before any merge key is flattened into a mapping, which
        would make an override look like a repeat), each once: an alias may be recursive.
        A loop, not recursion: a deeply nested document is the parser's to refuse."""
        seen: set[int] = set()
        stack: list[tuple[yaml.Node, str]] = [(root, "")]
        while stack:
            node, path = stack.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            if isinstance(node, yaml.SequenceNode):
                stack += [(item, f"{path}[{index}]") for index, item in enumerate(node.value)]
            elif isinstance(node, yaml.MappingNode):
                stack += self._mapping_children(node, path)

    def _mapping_children(self, node: yaml.MappingNode,
                          path: str) -> list[tuple[yaml.Node, str]]:
        """The values under ``node`` with their key paths; DuplicateKeyError for a repeat."""
        lines: dict[Any, int] = {}
        children = []
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE:  # <<: its keys may be overridden here
                children.append((value_node, path))
                continue
            key = self._key(key_node)
            inner = f"{path}.{key_label(key)}" if path else key_label(key)
            line = key_node.start_mark.line + 1
            if key is not _NO_KEY and key in lines:
                raise DuplicateKeyError(inner, lines[key], line)
            if key is not _NO_KEY:
                lines[key] = line
            children.append((value_node, inner))
        return children

    def _key(self, node: yaml.Node) -> Any:
        """A scalar key's value (``1`` and ``0x1``, ``yes`` and ``true`` are the same key in
        the mapping built); _NO_KEY for a key that cannot be one (the constructor says why)."""
        if not isinstance(node, yaml.ScalarNode):
            return _NO_KEY
        key = self.construct_object(node)
        try:
            hash(key)
        except TypeError:
            return _NO_KEY
        return key


def load(text: str) -> Any:
    """``yaml.safe_load`` that raises DuplicateKeyError for a key given twice."""
    return yaml.load(text, Loader=UniqueKeyLoader)


def decode(data: bytes) -> str:
    """``data`` as UTF-8 text (a UTF-8 byte order mark is allowed), else NotUtf8Error saying
    what it is: Notepad saves UTF-16 by default, which no YAML reader here expects."""
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        raise NotUtf8Error("is UTF-16 text (by its byte order mark), not UTF-8: save it as "
                           "UTF-8")
    if b"\0" in data:
        line = data[:data.index(b"\0")].count(b"\n") + 1
        raise NotUtf8Error(f"is not UTF-8 text: NUL bytes from line {line} (UTF-16?): save "
                           "it as UTF-8")
    data = data.removeprefix(codecs.BOM_UTF8)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data[:error.start].count(b"\n") + 1
        raise NotUtf8Error(f"is not UTF-8 text: byte 0x{data[error.start]:02x} on line "
                           f"{line}: save it as UTF-8") from None
