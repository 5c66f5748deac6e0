"""Fleet control: every incoming command is checked here, and accepted ones run one at a time.

Checks, in order, each with its reply code: retained, oversized, malformed (JSON, envelope
schema, command name), wrong_target, unsigned / bad_signature / unknown_key, expired /
not_yet_valid, replayed (a seen id: the stored reply again, never a second run),
unknown_command, not_allowed, bad_args.  A rejection changes nothing and leaves an audit
line in the log.  Replies go to ``<node>/cmd/<name>/res`` and, under MQTT 5, also to the
message's response topic with its correlation data.

Desired state (``<node>/desired`` and ``group/<g>/desired``, retained, signed like a command)
is converged by the same worker; what the node then runs is published retained on
``<node>/reported``.
"""

from __future__ import annotations

import json
import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from agent import protocol
from agent.control import schemas
from agent.control.envelope import EnvelopeError, TrustedKeys
from agent.control.store import CommandStore

logger = logging.getLogger(__name__)
audit = logging.getLogger("agent.audit")

PRUNE_INTERVAL_S = 3600.0  # how often the worker forgets ids a day past their expiry


class CommandFailed(Exception):
    """A command that ran and failed: ``code`` goes into the reply."""

    def __init__(self, code: str, message: str, result: dict[str, Any] | None = None) -> None:
        self.code, self.result = code, result
        super().__init__(message)


Progress = Callable[[str], None]
Handler = Callable[[dict[str, Any], Progress], dict[str, Any]]
Reply = Callable[[str, dict[str, Any], str | None, bytes | None], None]


@dataclass(frozen=True)
class Identity:
    """Who this node is on the bus: its topic root and the scopes it listens to."""

    fleet: str
    node_id: str
    groups: tuple[str, ...] = ()

    @property
    def root(self) -> str:
        return protocol.node_root(self.fleet, self.node_id)

    def scopes(self) -> dict[str, str]:
        """Topic prefix -> the target an envelope there must name."""
        prefixes = {self.root: f"node:{self.node_id}",
                    protocol.scope_root(self.fleet, protocol.ALL): protocol.ALL}
        prefixes.update({protocol.scope_root(self.fleet, protocol.group_scope(g)): f"group:{g}"
                         for g in self.groups})
        return prefixes


@dataclass
class Incoming:
    """What the controller needs of an MQTT message (paho's MQTTMessage fits)."""

    topic: str
    payload: bytes
    retain: bool = False
    response_topic: str | None = None
    correlation: bytes | None = None


class Controller:
    def __init__(self, identity: Identity, keys: TrustedKeys, allow: set[str],
                 store: CommandStore, handlers: Mapping[str, Handler], reply: Reply,
                 converge: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
                 max_payload_bytes: int = 16 * 1024, max_skew_s: float = 30.0,
                 max_ttl_s: float = 86400.0, clock: Callable[[], float] = time.time,
                 prune_interval_s: float = PRUNE_INTERVAL_S) -> None:
        self.identity, self.keys, self.allow, self.store = identity, keys, allow, store
        self.handlers, self.reply, self.converge = handlers, reply, converge
        self.max_payload_bytes, self.max_skew_s, self.max_ttl_s = (
            max_payload_bytes, max_skew_s, max_ttl_s)
        self.clock, self.prune_interval_s = clock, prune_interval_s
        self._next_prune = float("-inf")  # by self.clock
        self._scopes = identity.scopes()
        self._jobs: queue.Queue[tuple[Callable[[], None], str] | None] = queue.Queue()
        self._worker: threading.Thread | None = None
        self._desired: dict[str, dict[str, Any]] = {}  # scope target -> envelope
        self.rejected = 0

    # -- lifecycle --------------------------------------------------------------------------

    def subscriptions(self) -> tuple[str, ...]:
        topics = [protocol.topic(prefix, protocol.command_suffix("+")) for prefix in self._scopes]
        topics += [protocol.topic(prefix, protocol.DESIRED) for prefix, target
                   in self._scopes.items() if target != protocol.ALL]
        return tuple(topics)

    def start(self) -> None:
        self._prune_if_due()
        self._worker = threading.Thread(target=self._work, name="control", daemon=True)
        self._worker.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._jobs.put(None)
        if self._worker is not None:
            self._worker.join(timeout)

    def _work(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=self.prune_interval_s)
            except queue.Empty:  # idle: still prune on time
                self._prune_if_due()
                continue
            self._prune_if_due()
            if job is None:
                return
            run, label = job
            try:
                run()
            except Exception:  # a bug in one command must not end command handling
                logger.exception("control: %s crashed", label)

    def _prune_if_due(self) -> None:
        """Forget command ids a day past their expiry, so the store does not grow forever.
        A replay of a forgotten id is still refused: expiry is checked before the store."""
        now = self.clock()
        if now < self._next_prune:
            return
        self._next_prune = now + self.prune_interval_s
        try:
            removed = self.store.prune(int(now * 1000))
        except sqlite3.Error as error:  # retried at the next prune point
            logger.error("control: pruning the command store failed: %s", error)
            return
        if removed:
            logger.info("control: forgot %d command id(s) a day past their expiry", removed)

    # -- incoming ---------------------------------------------------------------------------

    def on_message(self, message: Any) -> None:
        """Called by the link thread: check, answer ``accepted`` or why not, queue the run."""
        incoming = _incoming(message)
        command = protocol.command_of(incoming.topic)
        if command is not None and command[0] in self._scopes:
            self._command(incoming, *command)
        elif protocol.desired_of(incoming.topic) is not None:
            self._desired_state(incoming)

    def _command(self, incoming: Incoming, prefix: str, name: str) -> None:
        envelope: dict[str, Any] = {}
        try:
            envelope = self._checked(incoming, prefix, name)
        except EnvelopeError as error:
            self._reject(incoming, name, envelope or _loose_id(incoming.payload), error)
            return
        stored = self.store.get(envelope["id"])
        if stored is not None:
            audit.warning("audit: replayed command %s id %s: answered from the store", name,
                          envelope["id"])
            self._send(incoming, name, {**stored, "duplicate": True, "code": "replayed"})
            return
        try:
            self._allowed(name, envelope["args"])
        except EnvelopeError as error:
            reply = self._reply_body(envelope, name, protocol.REJECTED, error.code, str(error))
            self.store.record(envelope["id"], name, envelope["expires_at"], reply)
            self._reject(incoming, name, envelope, error, stored=reply)
            return
        accepted = self._reply_body(envelope, name, protocol.ACCEPTED)
        self.store.record(envelope["id"], name, envelope["expires_at"], accepted)
        audit.info("audit: accepted %s id %s from key %s", name, envelope["id"],
                   envelope.get("key_id"))
        self._send(incoming, name, accepted)
        self._jobs.put((lambda: self._run(incoming, name, envelope), f"{name} {envelope['id']}"))

    def _checked(self, incoming: Incoming, prefix: str, name: str) -> dict[str, Any]:
        if incoming.retain:
            raise EnvelopeError("retained", "retained command messages are never executed "
                                "(they would run again on every reconnect)")
        if len(incoming.payload) > self.max_payload_bytes:
            raise EnvelopeError("oversized", f"{len(incoming.payload)} bytes, above the "
                                f"{self.max_payload_bytes}-byte command limit")
        try:
            envelope = json.loads(incoming.payload)
        except ValueError as error:
            raise EnvelopeError("malformed", f"not JSON: {error}") from None
        problem = schemas.check("envelope", envelope)
        if problem:
            raise EnvelopeError("malformed", f"envelope: {problem}")
        if envelope["command"] != name:
            raise EnvelopeError("malformed", f"the envelope is for {envelope['command']!r}, "
                                f"the topic for {name!r}")
        if envelope["target"] != self._scopes[prefix]:
            raise EnvelopeError("wrong_target", f"target {envelope['target']!r} does not match "
                                f"this topic's {self._scopes[prefix]!r}")
        self.keys.verify(envelope)
        self._current(envelope)
        return dict(envelope)

    def _current(self, envelope: Mapping[str, Any]) -> None:
        now_ms = int(self.clock() * 1000)
        if envelope["expires_at"] < now_ms:
            raise EnvelopeError("expired", f"expired {now_ms - envelope['expires_at']} ms ago")
        if envelope["issued_at"] > now_ms + self.max_skew_s * 1000:
            raise EnvelopeError("not_yet_valid", "issued in the future (check the clocks)")
        if envelope["expires_at"] - envelope["issued_at"] > self.max_ttl_s * 1000:
            raise EnvelopeError("ttl_too_long", f"valid for more than {self.max_ttl_s:.0f} s")

    def _allowed(self, name: str, args: Any) -> None:
        if name not in self.handlers:
            raise EnvelopeError("unknown_command", f"{name!r} is not a command; known: "
                                f"{', '.join(sorted(self.handlers))}")
        if name not in self.allow:
            raise EnvelopeError("not_allowed", f"{name!r} is not in control.allow on this node")
        problem = schemas.check(name, args)
        if problem:
            raise EnvelopeError("bad_args", f"args: {problem}")

    # -- running ----------------------------------------------------------------------------

    def _run(self, incoming: Incoming, name: str, envelope: dict[str, Any]) -> None:
        if envelope["expires_at"] < int(self.clock() * 1000):  # waited too long in the queue
            self._finish(incoming, name, envelope, protocol.EXPIRED, "expired",
                         "expired before it could run")
            return

        def progress(step: str) -> None:
            self._send(incoming, name, self._reply_body(envelope, name, protocol.IN_PROGRESS,
                                                          step=step))

        try:
            result = self.handlers[name](envelope["args"], progress)
        except CommandFailed as failure:
            self._finish(incoming, name, envelope, protocol.FAILED, failure.code, str(failure),
                         failure.result)
            return
        except Exception as error:  # reported, not raised: the fleet must hear about it
            logger.exception("control: %s failed", name)
            self._finish(incoming, name, envelope, protocol.FAILED, "error", str(error))
            return
        self._finish(incoming, name, envelope, protocol.SUCCEEDED, "ok", None, result)

    def _finish(self, incoming: Incoming, name: str, envelope: dict[str, Any], status: str,
                code: str, message: str | None, result: dict[str, Any] | None = None) -> None:
        reply = self._reply_body(envelope, name, status, code, message, result=result)
        self.store.record(envelope["id"], name, envelope["expires_at"], reply)
        self._send(incoming, name, reply)

    # -- desired state ----------------------------------------------------------------------

    def _desired_state(self, incoming: Incoming) -> None:
        prefix = protocol.desired_of(incoming.topic)
        if prefix is None or prefix not in self._scopes or self.converge is None:
            return
        target = self._scopes[prefix]
        if not incoming.payload:  # cleared
            self._desired.pop(target, None)
            return
        try:
            envelope = json.loads(incoming.payload)
            problem = schemas.check("envelope", envelope) or schemas.check(
                "desired", envelope.get("args"))
            if problem or envelope["command"] != "desired" or envelope["target"] != target:
                raise EnvelopeError("malformed", problem or "not a desired-state envelope "
                                    f"for {target}")
            self.keys.verify(envelope)
        except (ValueError, EnvelopeError) as error:
            code = getattr(error, "code", "malformed")
            audit.warning("audit: rejected desired state on %s: %s (%s)", incoming.topic,
                          error, code)
            return
        self._desired[target] = envelope
        self._jobs.put((self._converge_now, "desired state"))

    def _converge_now(self) -> None:
        """The node's own desired state wins over a group's; the newest group's otherwise."""
        assert self.converge is not None
        node = self._desired.get(f"node:{self.identity.node_id}")
        groups = [e for t, e in self._desired.items() if t.startswith("group:")]
        chosen = node or max(groups, key=lambda e: e["issued_at"], default=None)
        if chosen is not None:
            self.converge(chosen)

    # -- replies ----------------------------------------------------------------------------

    def _reply_body(self, envelope: Mapping[str, Any], name: str, status: str,
                    code: str | None = None, message: str | None = None,
                    step: str | None = None,
                    result: dict[str, Any] | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"schema": protocol.REPLY_SCHEMA, "id": envelope.get("id"),
                                "command": name, "node_id": self.identity.node_id,
                                "status": status, "ts": int(self.clock() * 1000)}
        for key, value in (("code", code), ("message", message), ("step", step),
                           ("result", result)):
            if value is not None:
                body[key] = value
        return body

    def _reject(self, incoming: Incoming, name: str, envelope: Mapping[str, Any],
                error: EnvelopeError, stored: dict[str, Any] | None = None) -> None:
        self.rejected += 1
        status = protocol.EXPIRED if error.code == "expired" else protocol.REJECTED
        audit.warning("audit: rejected %s id %s on %s: %s (%s)", name, envelope.get("id"),
                      incoming.topic, error, error.code)
        self._send(incoming, name, stored or self._reply_body(envelope, name, status,
                                                               error.code, str(error)))

    def _send(self, incoming: Incoming, name: str, body: dict[str, Any]) -> None:
        """The node's res topic always; the request's response topic only under the fleet's
        operator tree, so a message cannot steer replies onto arbitrary topics."""
        response = incoming.response_topic
        if response is not None and not response.startswith(
                f"{protocol.operator_root(self.identity.fleet)}/"):
            response = None
        self.reply(protocol.topic(self.identity.root, protocol.reply_suffix(name)), body,
                   response, incoming.correlation)


def _incoming(message: Any) -> Incoming:
    if isinstance(message, Incoming):
        return message
    properties = getattr(message, "properties", None)
    return Incoming(topic=message.topic, payload=bytes(message.payload),
                    retain=bool(message.retain),
                    response_topic=getattr(properties, "ResponseTopic", None),
                    correlation=getattr(properties, "CorrelationData", None))


def _loose_id(payload: bytes) -> dict[str, Any]:
    """The id of a message that failed a check, when it has one, to address the reply."""
    try:
        document = json.loads(payload)
    except ValueError:
        return {}
    value = document.get("id") if isinstance(document, dict) else None
    return {"id": value} if isinstance(value, str) and len(value) <= 128 else {}
