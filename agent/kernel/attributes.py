"""How a kernel attribute file reads after a write, for fixture roots: a board tree's plain
files then behave like sysfs/procfs where tuning depends on it (a selection file, a cgroup's
subtree_control), so a plan, apply and rollback there is judged as on a device."""

from __future__ import annotations

import errno
import re

_SELECTION = re.compile(r"\[([^\]\s]+)\]")


def emulate_attribute_write(current: bytes, value: str, path: str) -> bytes:
    """What a sysfs/procfs attribute reads after ``value`` is written to it.

    A selection file (``always [madvise] never``) moves its brackets to the written word and
    refuses words it does not offer (EINVAL, as the kernel does); ``cgroup.subtree_control``
    takes ``+name``/``-name`` edits; any other attribute reads back the value and a newline.
    """
    text = current.decode(errors="replace")
    if path == "/proc/sys/kernel/io_uring_disabled" and value.strip() not in ("0", "1", "2"):
        raise OSError(errno.EINVAL, f"{path}: {value.strip()!r} is outside 0..2")  # minmax
    if path.endswith("/cgroup.subtree_control"):  # "+cpu -io" edits the enabled set
        enabled = text.split()
        for token in value.split():
            name = token[1:]
            if token[0] == "+" and name not in enabled:
                enabled.append(name)
            elif token[0] == "-" and name in enabled:
                enabled.remove(name)
        return (" ".join(enabled) + "\n").encode()
    if _SELECTION.search(text) is None:
        return (value.strip() + "\n").encode()
    word = value.strip()
    options = [w.strip("[]") for w in text.split()]
    if word not in options:
        raise OSError(errno.EINVAL, f"{path}: {word!r} is not one of {options}")
    unbracketed = _SELECTION.sub(lambda m: m.group(1), text)
    return re.sub(rf"(?<!\S){re.escape(word)}(?!\S)", f"[{word}]", unbracketed, count=1).encode()
