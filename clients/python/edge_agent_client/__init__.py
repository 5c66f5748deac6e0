"""edge-agent's local inference client: ``Client(path).infer(model, {name: array})``.

Tensors travel in shared memory handed to the data plane once per session; each call is a
small message on a Unix socket.  numpy only, pure Python, Python 3.9+.
"""

from __future__ import annotations

from edge_agent_client.client import Client, default_path
from edge_agent_client.errors import (
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    ServerError,
    ServerGone,
    Unavailable,
)

__all__ = ["Client", "DeadlineExceeded", "InvalidArgument", "NotFound", "PermissionDenied",
           "ResourceExhausted", "ServerError", "ServerGone", "Unavailable", "default_path"]
__version__ = "0.1.0"
