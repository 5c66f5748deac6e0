"""The fleet's MQTT protocol: the topic tree, the command reply statuses and chunking.

The agent (link, controller, service) and the operator client (``edge-agent fleet``, the tests)
both build and parse topics here, so the two ends cannot drift apart.

The topic tree: every node publishes under ``edge/v1/<fleet>/<node>/`` (``state``,
``birth``, ``telemetry``, ``event``, ``reported``) and takes commands on
``<scope>/cmd/<name>``, answering on ``<node>/cmd/<name>/res``; a scope is the node itself,
``all`` or ``group/<g>``.  Desired state is retained on ``<scope>/desired`` (not ``all``).
An operator's replies-to and sync markers live under ``edge/v1/<fleet>/operator/<client>/``.
"""

from __future__ import annotations

import json
from typing import Any

from agent.telemetry.records import encode

PREFIX = "edge/v1"

# What a node publishes under its root.
STATE = "state"
BIRTH = "birth"
TELEMETRY = "telemetry"
EVENT = "event"
REPORTED = "reported"
DESIRED = "desired"
RETAINED = (STATE, BIRTH, REPORTED)  # kept per node by a watcher, even when live
NODE_FACTS = (STATE, BIRTH, REPORTED, TELEMETRY)  # what a watcher knows of each node

# Scopes besides a node id.
ALL = "all"
GROUP = "group"

# cmd-res/1 statuses: ``accepted`` and ``in_progress`` come first, then one final status.
REPLY_SCHEMA = "cmd-res/1"
ACCEPTED = "accepted"
IN_PROGRESS = "in_progress"
SUCCEEDED = "succeeded"
FAILED = "failed"
REJECTED = "rejected"
EXPIRED = "expired"
FINAL = (SUCCEEDED, FAILED, REJECTED, EXPIRED)

MAX_TOPIC_BYTES = 65535  # an MQTT string's length is two bytes

CHUNK_OVERHEAD = 2048  # bytes left for each chunk's envelope (id, status, chunk index...)
MIN_CHUNK = 1024


# -- building topics -------------------------------------------------------------------------


def fleet_root(fleet: str) -> str:
    return f"{PREFIX}/{fleet}"


def scope_root(fleet: str, scope: str) -> str:
    """``edge/v1/<fleet>/<scope>``: scope is a node id, ``all`` or ``group/<g>``."""
    return f"{fleet_root(fleet)}/{scope}"


def node_root(fleet: str, node: str) -> str:
    return scope_root(fleet, node)


def group_scope(group: str) -> str:
    return f"{GROUP}/{group}"


def topic(root: str, suffix: str) -> str:
    """A topic under a node or scope root (``state``, ``desired``, ``cmd/ping``...)."""
    return f"{root}/{suffix}"


def command_suffix(name: str) -> str:
    """``cmd/<name>``; ``+`` matches every command."""
    return f"cmd/{name}"


def reply_suffix(name: str) -> str:
    """``cmd/<name>/res``; ``+`` matches every command's replies."""
    return f"cmd/{name}/res"


def each_node(fleet: str, suffix: str) -> str:
    """The subscription pattern for ``suffix`` of every node of the fleet."""
    return topic(scope_root(fleet, "+"), suffix)


def operator_root(fleet: str) -> str:
    """The operators' tree: a request's response topic is honoured only under it."""
    return scope_root(fleet, "operator")


def sync_topic(fleet: str, client_id: str) -> str:
    """An operator's own marker, echoed back once the retained messages before it are in."""
    return topic(topic(operator_root(fleet), client_id), "sync")


def target_of(text: str) -> tuple[str, str]:
    """(envelope target, topic scope) for ``node``, ``group:G`` or ``all``."""
    if text == ALL:
        return ALL, ALL
    if text.startswith(f"{GROUP}:"):
        return text, group_scope(text.removeprefix(f"{GROUP}:"))
    return f"node:{text}", text


def topic_problem(name: object) -> str | None:
    """Why a message cannot be published to ``name`` (paho or the broker would refuse it),
    or None.  A response topic comes from whoever sent the request: it is checked before a
    reply is queued for it, never found out inside the link's pump."""
    if not isinstance(name, str):
        return "not a string"
    if not name:
        return "empty"
    if "+" in name or "#" in name:
        return "contains a wildcard"
    if "\0" in name:
        return "contains NUL"
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        return "not valid UTF-8"
    if size > MAX_TOPIC_BYTES:
        return f"{size} bytes, above {MAX_TOPIC_BYTES}"
    return None


def publishable_topic(name: object) -> bool:
    """Whether ``name`` can be published to as it stands: ``topic_problem`` finds nothing."""
    return topic_problem(name) is None


# -- parsing topics --------------------------------------------------------------------------


def node_topic(fleet: str, name: str) -> tuple[str, str] | None:
    """(node, suffix) of a topic a node published under its root, or None for another fleet
    or the ``all`` and ``group`` scopes."""
    prefix = f"{fleet_root(fleet)}/"
    if not name.startswith(prefix):
        return None
    node, _, suffix = name.removeprefix(prefix).partition("/")
    if node in (ALL, GROUP):
        return None
    return node, suffix


def command_of(name: str) -> tuple[str, str] | None:
    """(scope root, command name) of a ``<root>/cmd/<name>`` topic, else None."""
    root, _, command = name.rpartition("/cmd/")
    if not command or "/" in command:
        return None
    return root, command


def desired_of(name: str) -> str | None:
    """The scope root of a ``<root>/desired`` topic, else None."""
    suffix = f"/{DESIRED}"
    return name.removesuffix(suffix) if name.endswith(suffix) else None


def suffix_of(name: str) -> str:
    """The last level of a topic: ``state`` of ``edge/v1/lab/orin-1/state``."""
    return name.rpartition("/")[2]


def is_reply(name: str) -> bool:
    return name.endswith("/res")



# -- chunking --------------------------------------------------------------------------------


def chunked(body: dict[str, Any], limit: int) -> list[dict[str, Any]]:
    """A reply as it goes on the wire: itself when it fits in ``limit`` bytes (or has no
    ``result``), else numbered chunks of its encoded result, each with the other fields."""
    if len(encode(body)) <= limit or "result" not in body:
        return [body]
    text = encode(body["result"]).decode()
    size = max(MIN_CHUNK, limit - CHUNK_OVERHEAD)
    parts = [text[i:i + size] for i in range(0, len(text), size)]
    head = {k: v for k, v in body.items() if k != "result"}
    return [{**head, "chunk": {"index": index, "count": len(parts), "data": part}}
            for index, part in enumerate(parts)]


def reassembled(chunks: dict[int, str], reply: dict[str, Any]) -> dict[str, Any] | None:
    """The whole reply once every chunk is in ``chunks`` (filled by index as they come),
    None while some are missing; a reply that is not a chunk is returned as it is."""
    if "chunk" not in reply:
        return reply
    chunk = reply["chunk"]
    chunks[chunk["index"]] = chunk["data"]
    if len(chunks) < chunk["count"]:
        return None
    return {**reply, "result": json.loads("".join(chunks[i] for i in range(chunk["count"])))}
