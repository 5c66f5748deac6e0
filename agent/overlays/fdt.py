"""A minimal reader of flattened device trees (``.dtb``/``.dtbo``), enough to inspect overlays.

Installing and validating an overlay needs its fragments, their targets and the labels it
references (``__fixups__``); reading the blob directly avoids a round trip through
``dtc``'s text output.  Format: devicetree-specification, "Flattened Devicetree Format".
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

MAGIC = 0xD00DFEED
BEGIN_NODE, END_NODE, PROP, NOP, END = 1, 2, 3, 4, 9


class FdtError(ValueError):
    """Not a flattened device tree, or a damaged one."""


@dataclass
class Node:
    name: str
    props: dict[str, bytes] = field(default_factory=dict)
    children: dict[str, Node] = field(default_factory=dict)

    def string(self, prop: str) -> str | None:
        value = self.props.get(prop)
        return None if value is None else value.rstrip(b"\0").decode(errors="replace")

    def strings(self, prop: str) -> list[str]:
        """A NUL-separated string list such as ``compatible``."""
        value = self.props.get(prop, b"")
        return [s.decode(errors="replace") for s in value.rstrip(b"\0").split(b"\0") if s]

    def cells(self, prop: str) -> list[int]:
        value = self.props.get(prop, b"")
        return list(struct.unpack(f">{len(value) // 4}I", value[:len(value) // 4 * 4]))


def parse(blob: bytes) -> Node:
    """The tree of a ``.dtb``/``.dtbo``; raises :class:`FdtError` when it is not one."""
    if len(blob) < 40 or struct.unpack_from(">I", blob, 0)[0] != MAGIC:
        raise FdtError("not a flattened device tree (bad magic)")
    off_struct, off_strings = struct.unpack_from(">II", blob, 8)
    stack: list[Node] = []
    root: Node | None = None
    offset = off_struct
    try:
        while True:
            (token,) = struct.unpack_from(">I", blob, offset)
            offset += 4
            if token == BEGIN_NODE:
                end = blob.index(b"\0", offset)
                node = Node(blob[offset:end].decode(errors="replace"))
                offset = (end + 4) & ~3
                if stack:
                    stack[-1].children[node.name] = node
                else:
                    root = node
                stack.append(node)
            elif token == END_NODE:
                stack.pop()
            elif token == PROP:
                length, name_offset = struct.unpack_from(">II", blob, offset)
                offset += 8
                name_start = off_strings + name_offset
                name = blob[name_start:blob.index(b"\0", name_start)].decode(errors="replace")
                stack[-1].props[name] = blob[offset:offset + length]
                offset = (offset + length + 3) & ~3
            elif token == END:
                break
            elif token != NOP:
                raise FdtError(f"unknown token {token:#x} at offset {offset - 4}")
    except FdtError:
        raise
    except (struct.error, IndexError, ValueError) as error:
        raise FdtError(f"truncated or damaged device tree: {error}") from None
    if root is None:
        raise FdtError("no root node")
    return root
