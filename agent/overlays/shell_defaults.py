"""Kernel arguments in files a shell sources (``/etc/default/grub``, ``/etc/default/u-boot``)
and in one-line argument files (the Pi's ``cmdline.txt``, ``/etc/kernel/cmdline``): pure
text edits.

update-grub (grub-mkconfig) and u-boot-update source their ``/etc/default`` file as shell, so
the last assignment of a variable wins; that line is edited.  Only a literal value is edited
(unquoted, or in ``"..."``/``'...'`` without ``$``, backquotes or backslashes): anything the
shell would expand is refused rather than rewritten, naming the file and the variable.
"""

from __future__ import annotations

import re

from agent.overlays import kargs
from agent.overlays.errors import InstallRefused

_ASSIGN = r"^[ \t]*(?:export[ \t]+)?{name}=(.*?)[ \t]*(\r?\n)?$"


def _last(lines: list[str], name: str) -> int | None:
    pattern = re.compile(_ASSIGN.format(name=re.escape(name)))
    hits = [i for i, line in enumerate(lines) if pattern.match(line)]
    return hits[-1] if hits else None


def raw_value(text: str, name: str) -> str | None:
    """The right-hand side of the last ``name=`` line as written; None without one."""
    lines = text.splitlines(keepends=True)
    index = _last(lines, name)
    if index is None:
        return None
    match = re.match(_ASSIGN.format(name=re.escape(name)), lines[index])
    return match.group(1) if match else None


def _literal(raw: str, file: str, name: str) -> tuple[str, str]:
    """(quote, value) of a literal right-hand side; refused when the shell would expand it."""
    quote = raw[0] if raw[:1] in ("'", '"') else ""
    value = raw[1:-1] if quote and raw.endswith(quote) and len(raw) > 1 else raw
    if (quote and not raw.endswith(quote)) or any(c in value for c in "$`\\\"'") or (
            not quote and " " in value):
        raise InstallRefused(f"{file}: {name}={raw} is not a literal value (the shell would "
                             "expand or split it); edge-agent edits only a plain quoted "
                             f"string: set {name}=\"...\" first")
    return quote, value


def argument(text: str, file: str, name: str, argument_name: str) -> str:
    """The kernel argument ``argument_name`` in variable ``name``; "" when absent."""
    raw = raw_value(text, name)
    return "" if raw is None else kargs.find(_literal(raw, file, name)[1], argument_name)


def set_argument(text: str, file: str, name: str, argument_name: str, token: str) -> str:
    """Set (``token``) or take out ("") a kernel argument in the last ``name=`` line; a line
    is added (quoted) for the first argument when there is none."""
    lines = text.splitlines(keepends=True)
    index = _last(lines, name)
    if index is None:
        if not token:
            return text
        kargs.check_token(token)
        return text + ("" if not text or text.endswith("\n") else "\n") + f'{name}="{token}"\n'
    pattern = re.compile(_ASSIGN.format(name=re.escape(name)))
    match = pattern.match(lines[index])
    assert match is not None  # _last matched it
    quote, value = _literal(match.group(1), file, name)
    updated = kargs.set_token(value, argument_name, token)
    if updated == value:
        return text
    quote = quote or ('"' if " " in updated.strip() else "")
    start = lines[index][:match.start(1)]
    lines[index] = f"{start}{quote}{updated}{quote}{match.group(2) or ''}"
    return "".join(lines)


def line_argument(text: str, argument_name: str) -> str:
    """The argument in a one-line argument file (cmdline.txt); "" when absent."""
    return kargs.find(text.split("\n", 1)[0], argument_name)


def set_line_argument(text: str, argument_name: str, token: str) -> str:
    """A one-line argument file with the argument set or taken out; the rest of the file (a
    final newline) is kept byte for byte."""
    first, newline, rest = text.partition("\n")
    return kargs.set_token(first, argument_name, token) + newline + rest
