"""The default ``node_id``: the hostname, readable, plus ``-`` and the first 6 hex digits of
the sha256 of ``/etc/machine-id``, so devices that share a hostname (boards left at their
image's name) still get distinct MQTT client ids and topic roots.  A card cloned after its
first boot copies the machine id too: the link diagnoses that collision (agent.link.takeover).

The machine id is read through the config's root (``agent.kernel.fsroot``), like every read
of ``/etc``; the hostname is the running kernel's.  Without a usable machine id the default is
the hostname alone, and ``default_id_warning`` says why ids may collide (``run`` logs it, and
the status lists it among the warnings).
"""

from __future__ import annotations

import functools
import hashlib
import re
import socket

from agent.kernel.fsroot import Root

MACHINE_ID = "/etc/machine-id"
SUFFIX_HEX = 6
MAX_LENGTH = 64  # checks.TOPIC_LEVEL's bound
_MACHINE_ID = re.compile(r"[0-9a-f]{32}")  # machine-id(5): 32 lower-case hex digits


def node_id_for(hostname: str, machine_id: str | None) -> str:
    """The default id from its two sources: a valid topic level of at most 64 characters
    (characters MQTT or the config refuse become ``-``), the suffix kept whole."""
    base = re.sub(r"[^A-Za-z0-9_.-]", "-", hostname) or "node"  # as checks.TOPIC_LEVEL
    if machine_id is None:
        return base[:MAX_LENGTH]
    suffix = hashlib.sha256(machine_id.encode()).hexdigest()[:SUFFIX_HEX]
    return f"{base[:MAX_LENGTH - SUFFIX_HEX - 1]}-{suffix}"


def parse_machine_id(text: str) -> str | None:
    """The id in a ``machine-id`` file, or None: empty, or ``uninitialized`` (an image made
    for first boot), or anything that is not one."""
    value = text.strip()
    return value if _MACHINE_ID.fullmatch(value) else None


@functools.lru_cache(maxsize=8)  # read once per root and process
def _machine_id(root: str) -> tuple[str | None, str | None]:
    """(this device's machine id below ``root``, or None and why it is not usable)."""
    where = MACHINE_ID if root == "/" else f"{MACHINE_ID} below {root}"
    try:
        with open(Root(root).host_path(MACHINE_ID), "rb") as handle:  # bounded: 33 bytes
            text = handle.read(4096).decode("ascii", errors="replace")
    except OSError as error:
        return None, f"{where} cannot be read ({error.strerror or error})"
    found = parse_machine_id(text)
    return found, None if found else f"{where} holds no machine id (empty, uninitialized " \
        "or malformed)"


def default_node_id(root: str = "/") -> str:
    """The node id of a config that sets none (see the module)."""
    return node_id_for(socket.gethostname(), _machine_id(root)[0])


def default_id_warning(root: str = "/") -> str | None:
    """Why the default node id may be another device's too, or None: its machine id is
    usable."""
    problem = _machine_id(root)[1]
    if problem is None:
        return None
    return (f"node_id: {problem}: the default node id is the hostname alone "
            f"({default_node_id(root)}), which every device with this hostname shares; set "
            "node_id in agent.yaml")
