"""Signed command envelopes: canonical JSON, Ed25519 signatures, trusted keys, parsing.

The signature covers every field but ``sig`` (the fleet, command name, target, times and
args), so a signed envelope cannot be moved to another fleet, command, node or time.
Canonical JSON is UTF-8 with sorted keys and no whitespace: what the operator signed is byte
for byte what the node checks (README "Fleet control", with a test vector).

Everything that reads a payload from the network goes through ``parse``: NaN and Infinity
are not JSON, nesting is bounded, and a failure of any kind is a ValueError, so no payload can
raise anything else into the link thread.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

# What the signature covers; ``key_id`` too when present, ``clear`` only in desired state.
ENVELOPE_FIELDS = ("id", "fleet", "command", "issued_at", "expires_at", "target", "args")
MAX_DEPTH = 32  # nesting levels of a payload; no command or desired state needs more


class EnvelopeError(ValueError):
    """An envelope that cannot be trusted; ``code`` is the reply's reason code."""

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        self.verified = False  # raised after the signature checked out: always answered
        super().__init__(message)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse(payload: bytes) -> Any:
    """A payload from the network as JSON, or ValueError: not UTF-8, not JSON, NaN or
    Infinity (Python's json takes them by default, and reads 1e999 as one), or nested deeper
    than MAX_DEPTH (a deep
    document raises RecursionError inside json.loads, and would again in every walk after)."""
    try:
        document = json.loads(payload, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    if _depth_above(document, MAX_DEPTH):
        raise ValueError(f"nested deeper than {MAX_DEPTH} levels")
    if not finite(document):  # 1e999 is JSON, and Python reads it as infinity
        raise ValueError("a number beyond a float's range")
    return document


def _depth_above(document: Any, limit: int) -> bool:
    """Iterative, so checking a deep document cannot recurse."""
    stack = [(document, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict | list):
            if depth > limit:
                return True
            stack.extend((item, depth + 1) for item in (
                value.values() if isinstance(value, dict) else value))
    return False


def finite(value: Any) -> bool:
    """No NaN or infinity anywhere in ``value`` (a parsed document or a caller's args)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return False
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return True


def canonical(document: Mapping[str, Any]) -> bytes:
    """Sorted keys, separators "," and ":", non-ASCII as UTF-8 (ensure_ascii=False), no NaN.
    EnvelopeError ``malformed`` when the document has no such form: a lone surrogate in a
    string (no UTF-8 for it), a NaN or infinity, a value JSON has no word for."""
    try:
        return json.dumps(document, sort_keys=True, separators=(",", ":"),
                          ensure_ascii=False, allow_nan=False).encode()
    except UnicodeEncodeError:
        raise EnvelopeError("malformed", "a string holds a lone UTF-16 surrogate") from None
    except (ValueError, TypeError, RecursionError) as error:
        raise EnvelopeError("malformed", f"no canonical form: {error}") from None


def signed_part(envelope: Mapping[str, Any]) -> bytes:
    return canonical({k: v for k, v in envelope.items() if k != "sig"})


def public_key_text(key: Ed25519PublicKey) -> str:
    """The raw 32-byte key in base64: what goes into the config's ``trusted_keys``."""
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode()


def key_id(key: Ed25519PublicKey) -> str:
    """A short, stable name for a public key (first 16 hex digits of its SHA-256)."""
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def load_public_key(text: str) -> Ed25519PublicKey:
    try:
        raw = base64.b64decode(text, validate=True)
        return Ed25519PublicKey.from_public_bytes(raw)
    except ValueError as error:
        raise ValueError(f"not a base64 Ed25519 public key: {error}") from None


def load_private_key(pem: bytes) -> Ed25519PrivateKey:
    key = serialization.load_pem_private_key(pem, password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError("not an Ed25519 private key")
    return key


def private_key_pem(key: Ed25519PrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def sign(key: Ed25519PrivateKey, command: str, target: str, args: Mapping[str, Any], *,
         fleet: str, ttl_s: float = 60.0, now: float | None = None,
         command_id: str | None = None, clear: bool = False) -> dict[str, Any]:
    """A complete envelope for ``fleet``, valid from now for ``ttl_s`` seconds; ``clear``
    (desired state only) removes the scope's desired state."""
    issued = time.time() if now is None else now
    if not (math.isfinite(issued) and math.isfinite(ttl_s)):
        raise ValueError("the issue time and the lifetime must be finite numbers")
    envelope: dict[str, Any] = {
        "id": command_id or str(uuid.uuid4()), "fleet": fleet, "command": command,
        "issued_at": int(issued * 1000), "expires_at": int(issued * 1000) + int(ttl_s * 1000),
        "target": target, "args": dict(args), "key_id": key_id(key.public_key())}
    if clear:
        envelope["clear"] = True
    return signed(key, envelope)


def signed(key: Ed25519PrivateKey, envelope: Mapping[str, Any]) -> dict[str, Any]:
    """``envelope`` with ``sig`` over its other fields, as they stand (a migration tool or a
    test builds one field by field)."""
    unsigned = {k: v for k, v in envelope.items() if k != "sig"}
    return {**unsigned, "sig": base64.b64encode(key.sign(signed_part(unsigned))).decode()}


class KeyEntry(Protocol):
    """A trusted key as ``control.trusted_keys`` declares it (agent.config's TrustedKey)."""

    @property
    def id(self) -> str: ...

    @property
    def public_key(self) -> str: ...


@dataclass(frozen=True)
class TrustedKeys:
    """Public keys by id; several at once so keys can be rotated without downtime."""

    keys: Mapping[str, Ed25519PublicKey]

    @classmethod
    def from_config(cls, entries: Iterable[KeyEntry]) -> TrustedKeys:
        return cls({entry.id: load_public_key(entry.public_key) for entry in entries})

    def verify(self, envelope: Mapping[str, Any]) -> str:
        """The id of the key that signed ``envelope``; EnvelopeError when none did."""
        signature = envelope.get("sig")
        if not signature:
            raise EnvelopeError("unsigned", "the command carries no signature")
        try:
            raw = base64.b64decode(str(signature), validate=True)
            if len(raw) != 64:
                raise ValueError("an Ed25519 signature is 64 bytes")
        except ValueError:
            raise EnvelopeError("bad_signature", "the signature is not base64") from None
        named = envelope.get("key_id")
        if named is not None and (not isinstance(named, str) or named not in self.keys):
            raise EnvelopeError("unknown_key", f"key {named!r} is not trusted by this node")
        candidates = [named] if named is not None else list(self.keys)
        message = signed_part(envelope)
        for name in candidates:
            try:
                self.keys[name].verify(raw, message)
                return str(name)
            except InvalidSignature:
                continue
        raise EnvelopeError("bad_signature", "the signature does not match a trusted key")
