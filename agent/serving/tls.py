"""The front ends' TLS (``serve.tls``), loaded the same way by the data plane and by
``config check``, so a certificate the check passes is one the server can load."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any


def server_tls(cert: str, key: str, client_ca: str | None) -> ssl.SSLContext:
    """The HTTP front end's context; with ``client_ca`` clients must show a cert it signed."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    if client_ca:
        context.load_verify_locations(client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def grpc_credentials(cert: str, key: str, client_ca: str | None) -> Any:
    """The gRPC front end's server credentials from the same files."""
    import grpc

    pair = (Path(key).read_bytes(), Path(cert).read_bytes())
    ca = Path(client_ca).read_bytes() if client_ca else None
    return grpc.ssl_server_credentials([pair], root_certificates=ca,
                                       require_client_auth=ca is not None)
