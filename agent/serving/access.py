"""Who may call what: the bearer token of ``serve.token_file``.

The data plane runs as root, so a local user must not swap its models: repository load and
unload need the token even on loopback, and on any other address every call needs it (and
TLS, which the config check insists on).  The file is read at each check, so a rotated
token works at once; a missing file admits nobody to what needs it.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from agent.serving.errors import ServeError

MAX_TOKEN_BYTES = 4096


def is_loopback(host: str) -> bool:
    """Whether a listen address only takes local connections (``localhost`` counts)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bearer(header: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` value."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


@dataclass(frozen=True)
class Access:
    """``token_files``: the configured file and any the supervisor adds for itself."""

    token_files: Sequence[Path]
    everything: bool  # a non-loopback listener: the token for every call

    def _tokens(self) -> list[bytes]:
        tokens = []
        for path in self.token_files:
            try:
                with path.open("rb") as handle:
                    token = handle.read(MAX_TOKEN_BYTES + 1).strip()
            except OSError:
                continue
            if token and len(token) <= MAX_TOKEN_BYTES:
                tokens.append(token)
        return tokens

    def check(self, presented: str | None, control: bool) -> None:
        """Raise UNAUTHENTICATED unless the call may go ahead (``control``: load/unload)."""
        if not (control or self.everything):
            return
        if presented is None:
            where = self.token_files[0] if self.token_files else "none configured"
            raise ServeError("UNAUTHENTICATED", "this call needs the bearer token of "
                             f"serve.token_file ({where})")
        given = presented.encode("utf-8", "surrogateescape")
        if not any(hmac.compare_digest(given, token) for token in self._tokens()):
            raise ServeError("UNAUTHENTICATED", "the bearer token is not the one in "
                             "serve.token_file")
