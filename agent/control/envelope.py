"""Signed command envelopes: canonical JSON, Ed25519 signatures, trusted keys.

The signature covers every field but ``sig`` (the command name, target, times and args), so
a signed envelope cannot be moved to another command, node or time.  Canonical JSON is UTF-8
with sorted keys and no whitespace: what the operator signed is byte for byte what the
node checks.
"""

from __future__ import annotations

import base64
import hashlib
import json
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

ENVELOPE_FIELDS = ("id", "command", "issued_at", "expires_at", "target", "args")


class EnvelopeError(ValueError):
    """An envelope that cannot be trusted; ``code`` is the reply's reason code."""

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        super().__init__(message)


def canonical(document: Mapping[str, Any]) -> bytes:
    return json.dumps(document, sort_keys=True, separators=(",", ":"),
                      ensure_ascii=False).encode()


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


def sign(key: Ed25519PrivateKey, command: str, target: str, args: Mapping[str, Any],
         ttl_s: float = 60.0, now: float | None = None,
         command_id: str | None = None) -> dict[str, Any]:
    """A complete envelope, valid from now for ``ttl_s`` seconds."""
    issued = time.time() if now is None else now
    envelope: dict[str, Any] = {
        "id": command_id or str(uuid.uuid4()), "command": command,
        "issued_at": int(issued * 1000), "expires_at": int((issued + ttl_s) * 1000),
        "target": target, "args": dict(args), "key_id": key_id(key.public_key())}
    envelope["sig"] = base64.b64encode(key.sign(signed_part(envelope))).decode()
    return envelope


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
        except ValueError:
            raise EnvelopeError("bad_signature", "the signature is not base64") from None
        named = envelope.get("key_id")
        if named is not None and named not in self.keys:
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
