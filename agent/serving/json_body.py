"""JSON bodies parsed within bounds: a document's elements are counted before it is parsed
(a parse holds the GIL, and so the event loop, for its whole length) and what they can
become is admitted against the request's memory reservation first: 60 MB of ``{}`` would
be 1.6 GB of dicts and seconds of parsing.  Integers are bounded in digits before Python
converts them (the conversion is quadratic in their length before 3.11).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from agent.serving.budget import Reservation
from agent.serving.errors import invalid

MAX_INT_DIGITS = 40  # beyond int64/uint64: refused before Python parses it (quadratic in 3.10)
# What parsing JSON can cost, at most (tracemalloc over the worst shapes: ``[{},{},…]``,
# ``[[{}],…]``, ``{"k1":{},…}``, short strings, astral characters): up to 64 bytes of
# objects per element (each separator or opening bracket starts one), plus the text and
# the strings decoded from it, twice its bytes when ASCII, eight times when a character
# beyond Latin-1 makes Python store every character of a string in four bytes.
JSON_ELEMENT_BYTES = 64
JSON_TEXT_FACTOR = (2, 8)  # (ASCII, any other)
# A parse holds the GIL (and so the event loop) for about 0.25 us an element: 4M elements,
# a [1, 3, 1024, 1024] image in JSON, is about a second.
MAX_JSON_ELEMENTS = 1 << 22
SCAN_BLOCK = 1 << 20  # the scan's temporary: one byte per byte of a block
_STARTS_ELEMENT = np.zeros(256, np.bool_)  # the bytes that begin a JSON element: , : [ {
_STARTS_ELEMENT[list(b",:[{")] = True


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise invalid(f"JSON integer of {len(text)} digits is out of range")
    return int(text)


def json_elements(raw: bytes | bytearray) -> int:
    """An upper bound of the values and keys in ``raw``: each begins after a separator or
    an opening bracket.  One table look-up per byte in blocks of SCAN_BLOCK (numpy: several
    times faster than four ``bytes.count``, under 3 % of the parse)."""
    data = np.frombuffer(raw, np.uint8)
    return 1 + sum(int(np.count_nonzero(np.take(_STARTS_ELEMENT, data[at:at + SCAN_BLOCK])))
                   for at in range(0, len(data), SCAN_BLOCK))


def loads(raw: bytes | bytearray, what: str, reservation: Reservation) -> Any:
    """A JSON document, or a 400 naming ``what`` and why it is not one.  Before it is
    parsed, its elements are bounded (MAX_JSON_ELEMENTS: the parse holds the GIL) and what
    they can become is admitted against ``reservation`` (503 when it does not fit)."""
    elements = json_elements(raw)
    if elements > MAX_JSON_ELEMENTS:
        raise invalid(f"{what} holds up to {elements} JSON values, at most "
                      f"{MAX_JSON_ELEMENTS}; send large tensors with the binary tensor "
                      "extension")
    reservation.grow(JSON_TEXT_FACTOR[not raw.isascii()] * len(raw)
                     + JSON_ELEMENT_BYTES * elements, f"{what} as JSON")
    try:
        text = str(raw, "utf-8")
        return json.loads(text, parse_int=_parse_int)
    except UnicodeDecodeError:
        raise invalid(f"{what} is not UTF-8") from None
    except RecursionError:
        raise invalid(f"{what} is nested too deeply") from None
    except ValueError as error:
        raise invalid(f"{what} is not JSON ({error})") from None
