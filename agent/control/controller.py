"""Fleet control: every incoming command is checked here, and accepted ones run one at a time
(a long one's work as a job beside them, ``running``).

Checks, in order, each with its reply code: retained, oversized, malformed (JSON, nesting,
NaN, envelope schema), unsigned, bad_signature / unknown_key, then, the signature valid,
malformed (command name), wrong_target, unbound / wrong_fleet, expired / not_yet_valid /
ttl_too_long, replayed (a seen id: the stored reply again, never a second run),
unknown_command, not_allowed, bad_args.  A rejection changes nothing and leaves a JSON audit
record.  Replies go to ``<node>/cmd/<name>/res`` and, under MQTT 5, also to the message's
response topic with its correlation data.  Replies to junk (refused before a valid
signature) are rate-limited and counted; nothing a message holds can raise out of
``on_message`` into the link thread.

Desired state (``<node>/desired`` and ``group/<g>/desired``, retained, signed like a command,
in time and in order per scope) is converged by the same worker; what the node then runs is
published retained on ``<node>/reported``.
"""

from __future__ import annotations

import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from agent import protocol
from agent.control import schemas
from agent.control.audit import JUNK_BURST, JUNK_REPLIES_PER_S, JunkCounter, TokenBucket, record
from agent.control.checks import Checks, Limits
from agent.control.desired import REDELIVERED, DesiredStates
from agent.control.envelope import EnvelopeError, TrustedKeys
from agent.control.incoming import Incoming as Incoming
from agent.control.incoming import incoming_of, loose_id
from agent.control.running import CommandFailed as CommandFailed
from agent.control.running import Job, JobRunner, outcome_of
from agent.control.running import Progress as Progress
from agent.control.store import CommandStore

logger = logging.getLogger(__name__)
# Incoming, CommandFailed and Progress are imported from here too (handlers, tests).

PRUNE_INTERVAL_S = 3600.0  # how often the worker forgets ids a day past their expiry


# A handler's result, or the Job it hands back when its work is long (running.py).
Handler = Callable[[dict[str, Any], Progress], dict[str, Any] | Job]


class Reply(Protocol):
    """Publishes one reply; ``droppable``: a reply to junk the link may shed under load."""

    def __call__(self, topic: str, body: dict[str, Any], response_topic: str | None,
                 correlation: bytes | None, droppable: bool = False) -> None: ...


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


class Controller:
    def __init__(self, identity: Identity, keys: TrustedKeys, allow: set[str],
                 store: CommandStore, handlers: Mapping[str, Handler], reply: Reply,
                 converge: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
                 refused: Callable[[dict[str, Any]], None] | None = None,
                 max_payload_bytes: int = 16 * 1024, max_skew_s: float = 30.0,
                 max_ttl_s: float = 86400.0, clock: Callable[[], float] = time.time,
                 prune_interval_s: float = PRUNE_INTERVAL_S, *,
                 desired_max_ttl_s: float = Limits.desired_max_ttl_s,
                 accept_unbound: bool = False, junk_bucket: TokenBucket | None = None) -> None:
        self.identity, self.keys, self.allow, self.store = identity, keys, allow, store
        self.handlers, self.reply, self.converge = handlers, reply, converge
        self.refused = refused  # told of a signed desired state refused (reported says it)
        self.limits = Limits(max_payload_bytes, max_skew_s, max_ttl_s, desired_max_ttl_s,
                             accept_unbound)
        self.checks = Checks(identity.fleet, keys, self.limits, clock)
        self.clock, self.prune_interval_s = clock, prune_interval_s
        self._next_prune = float("-inf")  # by self.clock
        self._scopes = identity.scopes()
        self._jobs: queue.Queue[tuple[Callable[[], None], str] | None] = queue.Queue()
        self._worker: threading.Thread | None = None
        self.long_jobs = JobRunner()  # long commands' work, beside the worker
        self.desired = DesiredStates(store, f"node:{identity.node_id}")
        self.junk = JunkCounter(junk_bucket or TokenBucket(JUNK_REPLIES_PER_S, JUNK_BURST))
        self.rejected = 0
        self.errors = 0  # messages whose handling raised: answered, logged, counted
        self.desired_ignored = 0  # unsigned empty payloads on a desired topic
        if accept_unbound:
            logger.warning("control: control.accept_unbound_envelopes is true: envelopes "
                           "that name no fleet are accepted (a migration window only)")

    def metrics(self) -> dict[str, Any]:
        """The ``control`` telemetry group: refusals by code, what junk was not answered."""
        return {"rejected": dict(self.junk.by_code), "rejected_total": self.rejected,
                "replies_suppressed": self.junk.suppressed, "errors": self.errors,
                "desired_ignored": self.desired_ignored,
                "jobs_running": len(self.long_jobs.running())}

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
        """The worker ends after its current command; jobs are cancelled, waited for a
        bounded time, and answered ``cancelled`` when they do not end in it."""
        self.long_jobs.cancel()  # first: a job does not wait for the worker's command
        self._jobs.put(None)
        if self._worker is not None:
            self._worker.join(timeout)
        self.long_jobs.stop()

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
        """Called by the link thread: check, answer ``accepted`` or why not, queue the run.
        Whatever goes wrong in handling one message is logged, answered and counted here."""
        incoming: Incoming | None = None
        try:
            incoming = incoming_of(message)
            command = protocol.command_of(incoming.topic)
            if command is not None and command[0] in self._scopes:
                self._command(incoming, *command)
            elif protocol.desired_of(incoming.topic) is not None:
                self._desired_state(incoming)
        except Exception as error:  # a bug must not end the link: this message fails alone
            self.errors += 1
            logger.exception("control: handling a message on %r failed",
                             getattr(message, "topic", None))
            self._crashed(incoming, error)

    def _crashed(self, incoming: Incoming | None, error: Exception) -> None:
        """Answer a message whose handling raised (a command: ``failed``, ``internal_error``)."""
        try:
            command = protocol.command_of(incoming.topic) if incoming is not None else None
            record("error", logging.ERROR, topic=getattr(incoming, "topic", None),
                   code="internal_error", reason=f"{type(error).__name__}: {error}")
            if incoming is None or command is None or command[0] not in self._scopes:
                return
            if self.junk.admit("internal_error") is not None:
                self._send(incoming, command[1], self._reply_body(
                    loose_id(incoming.payload), command[1], protocol.FAILED,
                    "internal_error", "the node could not handle this message"),
                    droppable=True)
        except Exception:
            logger.exception("control: answering a failed message failed too")

    def _command(self, incoming: Incoming, prefix: str, name: str) -> None:
        try:
            if incoming.retain:
                raise EnvelopeError("retained", "retained command messages are never executed "
                                    "(they would run again on every reconnect)")
            envelope = self.checks.command(incoming.payload, name, self._scopes[prefix])
        except EnvelopeError as error:
            self._reject(incoming, name, loose_id(incoming.payload), error)
            return
        stored = self.store.get(envelope["id"])
        if stored is not None:
            self.junk.count("replayed")
            record("replayed", logging.WARNING, id=envelope["id"], command=name,
                   key_id=envelope.get("key_id"), topic=incoming.topic,
                   reason="answered from the store")
            self._send(incoming, name, {**stored, "duplicate": True, "code": "replayed"})
            return
        try:
            self._allowed(name, envelope["args"])
        except EnvelopeError as error:
            error.verified = True
            reply = self._reply_body(envelope, name, protocol.REJECTED, error.code, str(error))
            self.store.record(envelope["id"], name, envelope["expires_at"], reply)
            self._reject(incoming, name, envelope, error, stored=reply)
            return
        accepted = self._reply_body(envelope, name, protocol.ACCEPTED)
        self.store.record(envelope["id"], name, envelope["expires_at"], accepted)
        record("accepted", id=envelope["id"], command=name, key_id=envelope.get("key_id"),
               target=envelope["target"], fleet=envelope.get("fleet"))
        self._send(incoming, name, accepted)
        self._jobs.put((lambda: self._run(incoming, name, envelope), f"{name} {envelope['id']}"))

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

        def finish(status: str, code: str, message: str | None,
                   result: dict[str, Any] | None) -> None:
            self._finish(incoming, name, envelope, status, code, message, result)

        outcome = outcome_of(name, lambda: self.handlers[name](envelope["args"], progress))
        if not isinstance(outcome, Job):
            finish(*outcome)
            return
        running = self.long_jobs.start(envelope["id"], name, outcome, progress, finish)
        if running is not None:  # one job per slot: answered now, never queued
            finish(protocol.FAILED, "busy", f"command {running} is running a {outcome.slot} "
                   "job; one runs at a time", {"running": running})

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
        if target == protocol.ALL:
            return
        if not incoming.payload:  # no longer a clear: that is a signed envelope now
            self.desired_ignored += 1
            if self.junk.admit("unsigned_clear") is not None:
                record("ignored", logging.WARNING, topic=incoming.topic, scope=target,
                       code="unsigned_clear", reason="an empty desired state is not a "
                       "clear (a clear is signed: fleet desired --clear)")
            return
        try:
            envelope = self.checks.desired(incoming.payload, target)
            if self.desired.admit(target, envelope) == REDELIVERED:
                return
        except EnvelopeError as error:
            self.rejected += 1
            loose = loose_id(incoming.payload)
            if error.verified or error.code == "stale":
                self.junk.count(error.code)
            elif self.junk.admit(error.code) is None:
                return
            record("rejected", logging.WARNING, command="desired", id=loose.get("id"),
                   topic=incoming.topic, scope=target, code=error.code, reason=str(error))
            if (error.verified or error.code == "stale") and self.refused is not None:
                # an operator signed it (stale: its signature checked before its time)
                tell, refusal = self.refused, {"desired_id": loose.get("id"), "scope": target,
                                               "code": error.code, "message": str(error)}
                self._jobs.put((lambda: tell(refusal), "desired state refused"))
            return
        record("desired", id=envelope["id"], scope=target, key_id=envelope.get("key_id"),
               fleet=envelope.get("fleet"), clear=bool(envelope.get("clear")),
               issued_at=envelope["issued_at"])
        self._jobs.put((self._converge_now, "desired state"))

    def _converge_now(self) -> None:
        """The node's own desired state wins over a group's; the newest group's otherwise."""
        assert self.converge is not None
        chosen = self.desired.chosen()
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
        """Audit and answer a refusal; one of junk only while the bucket allows."""
        self.rejected += 1
        if error.verified:
            self.junk.count(error.code)
            skipped = 0
        else:
            admitted = self.junk.admit(error.code)
            if admitted is None:
                return
            skipped = admitted
        status = protocol.EXPIRED if error.code == "expired" else protocol.REJECTED
        record("rejected", logging.WARNING, id=envelope.get("id"), command=name,
               key_id=envelope.get("key_id") if error.verified else None,
               topic=incoming.topic, code=error.code, reason=str(error),
               suppressed_before=skipped or None)
        self._send(incoming, name, stored or self._reply_body(envelope, name, status,
                                                               error.code, str(error)),
                   droppable=not error.verified)

    def _send(self, incoming: Incoming, name: str, body: dict[str, Any],
              droppable: bool = False) -> None:
        """The node's res topic always; the request's response topic only when it can be
        published to and lies under the fleet's operator tree, so a message can neither
        steer replies onto arbitrary topics nor hand the link one it cannot publish."""
        response = incoming.response_topic
        if response is not None and not (protocol.publishable_topic(response) and response
                                         .startswith(f"{protocol.operator_root(self.identity.fleet)}/")):
            response = None
        correlation = incoming.correlation if isinstance(incoming.correlation, bytes) else None
        self._publish(protocol.topic(self.identity.root, protocol.reply_suffix(name)), body,
                      response, correlation, droppable)

    def _publish(self, topic: str, body: dict[str, Any], response: str | None,
                 correlation: bytes | None, droppable: bool) -> None:
        """The one call into the link.  ``droppable``: a reply to junk that the link may shed
        under load; a reply to a validly signed command never is."""
        self.reply(topic, body, response, correlation, droppable=droppable)

