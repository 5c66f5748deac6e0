"""Tensors by reference: the ``shared_memory_*`` parameters of an input or a requested output,
resolved against the registered regions and bounds-checked before a byte moves.

Both front ends use these, so a reference is refused with the same words whichever way it
came; our own clients build their references with ``RegionRef`` too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agent.serving.core import Tensor
from agent.serving.errors import invalid
from agent.serving.shm import Region, RegionLookup
from agent.serving.tensors import from_raw, raw_size, to_raw

REGION = "shared_memory_region"
BYTE_SIZE = "shared_memory_byte_size"
OFFSET = "shared_memory_offset"


@dataclass(frozen=True)
class RegionRef:
    """``byte_size`` bytes at ``offset`` of the registered region ``region``."""

    region: str
    byte_size: int
    offset: int = 0

    def parameters(self) -> dict[str, Any]:
        """The tensor parameters that carry this reference (offset only when not 0, as
        tritonclient sends it)."""
        found: dict[str, Any] = {REGION: self.region, BYTE_SIZE: self.byte_size}
        if self.offset:
            found[OFFSET] = self.offset
        return found


@dataclass(frozen=True)
class RegionInput:
    """An input a client leaves in a region: what the request says of it."""

    datatype: str
    shape: tuple[int, ...]
    ref: RegionRef


def _count(params: Mapping[str, Any], key: str, what: str, default: int | None) -> int:
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise invalid(f"{what}: {key} must be an integer 0 or above")
    return value


def region_ref(params: Mapping[str, Any], what: str) -> RegionRef | None:
    """The reference in a tensor's parameters, None when it has none; the region and byte
    size go together, the offset is optional."""
    if not any(key in params for key in (REGION, BYTE_SIZE, OFFSET)):
        return None
    region = params.get(REGION)
    if not isinstance(region, str) or not region:
        raise invalid(f"{what}: {REGION} must name a registered region, given with {BYTE_SIZE}")
    return RegionRef(region, _count(params, BYTE_SIZE, what, None),
                     _count(params, OFFSET, what, 0))


@dataclass(frozen=True)
class Window:
    """A reference resolved: the region itself, held for the rest of the request."""

    region: Region
    offset: int
    byte_size: int


def resolve(regions: RegionLookup, ref: RegionRef, what: str) -> Window:
    region = regions.get(ref.region)
    if ref.offset + ref.byte_size > region.byte_size:
        raise invalid(f"{what}: offset {ref.offset} + byte size {ref.byte_size} is beyond "
                      f"shared memory region {ref.region!r} of {region.byte_size} bytes")
    return Window(region, ref.offset, ref.byte_size)


def read_input(window: Window, name: str, datatype: Any, shape: Sequence[Any]) -> Tensor:
    """The input's bytes copied out of its region, refused unless the byte size is exactly
    what the shape and datatype need."""
    needed = raw_size(name, datatype, shape)
    if window.byte_size != needed:
        raise invalid(f"input {name}: {BYTE_SIZE} {window.byte_size}, but shape {list(shape)} "
                      f"of {datatype} needs {needed} bytes")
    return from_raw(name, datatype, shape, window.region.read(window.offset, needed))


def write_output(window: Window, tensor: Tensor) -> dict[str, Any]:
    """The output written into its region; the parameters the response names it with."""
    raw = to_raw(tensor.array)
    if len(raw) > window.byte_size:
        raise invalid(f"output {tensor.name}: its {len(raw)} bytes do not fit the "
                      f"{window.byte_size} given in shared memory region "
                      f"{window.region.name!r}")
    window.region.write(window.offset, raw)
    return {REGION: window.region.name, BYTE_SIZE: len(raw)}
