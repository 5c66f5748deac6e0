"""The checks an incoming envelope passes before the controller acts on it, commands and
desired state alike, in the order whose codes the README lists.

Until the signature is verified, nothing in a message is trusted and a refusal is junk (its
reply may be rate-limited); a refusal after it (``verified``) is always answered.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from agent.control import schemas
from agent.control.envelope import EnvelopeError, TrustedKeys, parse

DESIRED_MAX_TTL_S = 365 * 86400.0  # desired state waits for nodes that are offline for long


@dataclass(frozen=True)
class Limits:
    """What ``control`` in the config bounds."""

    max_payload_bytes: int = 16 * 1024
    max_skew_s: float = 30.0
    max_ttl_s: float = 86400.0
    desired_max_ttl_s: float = DESIRED_MAX_TTL_S
    accept_unbound: bool = False  # control.accept_unbound_envelopes: envelopes with no fleet


def verified(error: EnvelopeError) -> EnvelopeError:
    """Mark a refusal of a validly signed envelope: its reply is never dropped."""
    error.verified = True
    return error


class Checks:
    def __init__(self, fleet: str, keys: TrustedKeys, limits: Limits,
                 clock: Callable[[], float]) -> None:
        self.fleet, self.keys, self.limits, self.clock = fleet, keys, limits, clock

    def document(self, payload: bytes, what: str) -> dict[str, Any]:
        """Bounded, parsed, an object, signed at all: the checks before the schema's."""
        if len(payload) > self.limits.max_payload_bytes:
            raise EnvelopeError("oversized", f"{len(payload)} bytes, above the "
                                f"{self.limits.max_payload_bytes}-byte {what} limit")
        try:
            document = parse(payload)
        except ValueError as error:
            raise EnvelopeError("malformed", f"not JSON: {error}") from None
        if not isinstance(document, dict):
            raise EnvelopeError("malformed", f"a {what} is a JSON object")
        if document.get("sig") is None or document.get("sig") == "":
            raise EnvelopeError("unsigned", f"the {what} carries no signature")
        return document

    def _signed(self, payload: bytes, what: str, schema: str) -> dict[str, Any]:
        """The document, of ``schema``'s shape, with a valid signature of a trusted key."""
        envelope = self.document(payload, what)
        problem = schemas.check(schema, envelope)
        if problem:
            raise EnvelopeError("malformed", f"envelope: {problem}")
        self.keys.verify(envelope)
        return envelope

    def command(self, payload: bytes, name: str, target: str) -> dict[str, Any]:
        """A command envelope for ``name`` on a topic of ``target``, or EnvelopeError."""
        envelope = self._signed(payload, "command", "envelope")
        try:
            if envelope["command"] != name:
                raise EnvelopeError("malformed", f"the envelope is for {envelope['command']!r}, "
                                    f"the topic for {name!r}")
            self._addressed(envelope, target)
            self.current(envelope, self.limits.max_ttl_s)
        except EnvelopeError as error:
            raise verified(error) from None
        return envelope

    def desired(self, payload: bytes, target: str) -> dict[str, Any]:
        """A desired-state envelope (or a signed clear) for ``target``, or EnvelopeError."""
        envelope = self._signed(payload, "desired state", "desired-envelope")
        try:
            if envelope["command"] != "desired":
                raise EnvelopeError("malformed", "not a desired-state envelope (command "
                                    f"{envelope['command']!r})")
            if envelope.get("clear"):
                if envelope["args"]:
                    raise EnvelopeError("malformed", "a clear carries no args")
            else:
                problem = schemas.check("desired", envelope["args"])
                if problem:
                    raise EnvelopeError("malformed", f"args: {problem}")
            self._addressed(envelope, target)
            self.current(envelope, self.limits.desired_max_ttl_s)
        except EnvelopeError as error:
            raise verified(error) from None
        return envelope

    def _addressed(self, envelope: Mapping[str, Any], target: str) -> None:
        if envelope["target"] != target:
            raise EnvelopeError("wrong_target", f"target {envelope['target']!r} does not "
                                f"match this topic's {target!r}")
        fleet = envelope.get("fleet")
        if fleet is None:
            if not self.limits.accept_unbound:
                raise EnvelopeError("unbound", "the envelope names no fleet (signed before "
                                    "fleets were signed; control.accept_unbound_envelopes)")
        elif fleet != self.fleet:
            raise EnvelopeError("wrong_fleet", f"signed for fleet {fleet!r}, this node is "
                                f"in {self.fleet!r}")

    def current(self, envelope: Mapping[str, Any], max_ttl_s: float) -> None:
        """In time: not expired, not issued beyond the skew, not valid for too long."""
        now_ms = int(self.clock() * 1000)
        if envelope["expires_at"] < now_ms:
            raise EnvelopeError("expired", f"expired {now_ms - envelope['expires_at']} ms ago")
        if envelope["issued_at"] > now_ms + self.limits.max_skew_s * 1000:
            raise EnvelopeError("not_yet_valid", "issued in the future (check the clocks)")
        if envelope["expires_at"] - envelope["issued_at"] > max_ttl_s * 1000:
            raise EnvelopeError("ttl_too_long", f"valid for more than {max_ttl_s:.0f} s")
