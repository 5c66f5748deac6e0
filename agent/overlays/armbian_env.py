"""Armbian's ``/boot/armbianEnv.txt`` (``orangepiEnv.txt`` on Orange Pi): pure text edits.

The boot script loads ``user_overlays=`` names from ``/boot/overlay-user/<name>.dtbo`` and
``overlays=`` names from ``/boot/dtb/<vendor>/overlay/<overlay_prefix>-<name>.dtbo``, both
space-separated.  Only ``user_overlays`` and ``extraargs`` (kernel arguments the boot script
appends to ``bootargs``) are ever edited here; U-Boot's ``env import`` lets the last
assignment of a key win, so that is the line edited.
"""

from __future__ import annotations

from agent.overlays import kargs

USER = "user_overlays"
VENDOR = "overlays"
ARGS = "extraargs"


def _split(line: str) -> tuple[str, str]:
    """value, line ending of a ``key=value`` line."""
    body = line.rstrip("\r\n")
    return body.split("=", 1)[1], line[len(body):]


def _find(lines: list[str], key: str) -> int | None:
    hits = [i for i, line in enumerate(lines) if line.startswith(f"{key}=")]
    return hits[-1] if hits else None


def value(text: str, key: str) -> str | None:
    lines = text.splitlines(keepends=True)
    index = _find(lines, key)
    return None if index is None else _split(lines[index])[0].strip()


def names(text: str, key: str) -> list[str]:
    return (value(text, key) or "").split()


def register(text: str, name: str) -> str:
    """Add ``name`` to ``user_overlays=`` (adding the line when there is none)."""
    lines = text.splitlines(keepends=True)
    index = _find(lines, USER)
    if index is None:
        return text + ("" if not text or text.endswith("\n") else "\n") + f"{USER}={name}\n"
    current, ending = _split(lines[index])
    if name in current.split():
        return text
    lines[index] = f"{USER}={current.rstrip() + ' ' + name if current.strip() else name}{ending}"
    return "".join(lines)


def unregister(text: str, name: str) -> str:
    """Take ``name`` out of ``user_overlays=``; the line goes when nothing is left on it."""
    lines = text.splitlines(keepends=True)
    index = _find(lines, USER)
    if index is None:
        return text
    current, ending = _split(lines[index])
    if name not in current.split():
        return text
    rest = [n for n in current.split() if n != name]
    if rest:
        lines[index] = f"{USER}={' '.join(rest)}{ending}"
    else:
        del lines[index]
    return "".join(lines)


def argument(text: str, name: str) -> str:
    """The kernel argument ``name`` (the whole token) in ``extraargs=``; "" if none."""
    return kargs.find(value(text, ARGS) or "", name)


def set_argument(text: str, name: str, token: str) -> str:
    """Set (``token``) or take out ("") a kernel argument in ``extraargs=``; the line is
    added for the first argument and goes when nothing is left on it."""
    lines = text.splitlines(keepends=True)
    index = _find(lines, ARGS)
    if index is None:
        if not token:
            return text
        kargs.check_token(token)
        return text + ("" if not text or text.endswith("\n") else "\n") + f"{ARGS}={token}\n"
    current, ending = _split(lines[index])
    updated = kargs.set_token(current, name, token)
    if updated == current:
        return text
    if updated.strip():
        lines[index] = f"{ARGS}={updated}{ending}"
    else:
        del lines[index]
    return "".join(lines)
