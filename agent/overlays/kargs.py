"""Kernel command-line tokens inside a boot config's argument string: pure text edits.

The kernel treats ``-`` and ``_`` in a parameter's name alike (kernel/params.c, parameq), and
for the arguments edge-agent manages the last occurrence wins, so that is the one read and
replaced.  Tokens are checked before they reach a boot config: a space, quote, ``$``, ``#``
or newline in a value would add arguments, or break the file, rather than set one.
"""

from __future__ import annotations

import re

TOKEN = re.compile(r"^[A-Za-z0-9_.-]+(=[A-Za-z0-9_.,:+-]+)?$")
_SPLIT = re.compile(r"(\s+)")


def name_of(token: str) -> str:
    return token.split("=", 1)[0].replace("-", "_")


def check_token(token: str) -> None:
    """Refuse anything but ``name`` or ``name=value`` built from a plain character set."""
    if not TOKEN.match(token):
        raise ValueError(f"{token[:60]!r} is not a plain kernel argument (letters, digits and "
                         "_.-, then =value with letters, digits and _.,:+-; no spaces, quotes "
                         "or $)")


def _last(parts: list[str], name: str) -> int | None:
    hits = [i for i in range(0, len(parts), 2) if parts[i] and name_of(parts[i]) ==
            name.replace("-", "_")]
    return hits[-1] if hits else None


def find(value: str, name: str) -> str:
    """The last token for ``name`` in an argument string; "" when it is not there."""
    parts = _SPLIT.split(value)
    index = _last(parts, name)
    return "" if index is None else parts[index]


def set_token(value: str, name: str, token: str) -> str:
    """``value`` with ``name``'s last token replaced by ``token`` (appended when absent),
    or taken out with the whitespace before it when ``token`` is ""; the rest is kept byte
    for byte, so taking out what was appended gives the original string back."""
    if token:
        check_token(token)
        if name_of(token) != name.replace("-", "_"):
            raise ValueError(f"{token!r} is not an argument named {name}")
    parts = _SPLIT.split(value)  # tokens at even indexes, whitespace at odd ones
    index = _last(parts, name)
    if index is None:
        if not token:
            return value
        body = value.rstrip()
        return body + (" " if body else "") + token + value[len(body):]
    if token:
        parts[index] = token
    elif index > 0:
        del parts[index - 1:index + 1]
    else:
        del parts[index:index + 2]
    return "".join(parts)
