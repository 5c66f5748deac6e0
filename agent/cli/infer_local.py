"""``edge-agent infer --url unix:///run/edge-agent/infer.sock``: the local path, through the
``edge_agent_client`` package, behind the interface ``infer_remote`` drives (as its HTTP
and gRPC clients): inputs are copied into the client's shared region, outputs read in place.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from agent.cli.common import UsageError
from agent.serving.core import ModelMetadata, TensorSpec
from agent.serving.errors import HTTP_STATUS, ServeError

MISSING = ("--url unix://...: the local path needs the edge-agent-client package (pip install "
           "clients/python of the edge-agent checkout; install.sh installs it)")


class LocalClient:
    """One session on the data plane's local socket (one per calling thread, as every
    client ``infer_remote`` makes)."""

    def __init__(self, path: str, token: str | None, timeout_s: float) -> None:
        try:
            import edge_agent_client
        except ImportError:
            raise UsageError(MISSING) from None
        self._errors: Any = edge_agent_client.ServerError
        self._client: Any = edge_agent_client.Client(path, timeout_s=timeout_s, token=token)

    def _serve_error(self, error: Any) -> ServeError:
        code = error.code if error.code in HTTP_STATUS else "INTERNAL"
        return ServeError(code, error.message)

    def model_metadata(self, model: str) -> ModelMetadata:
        try:
            meta = self._client.metadata(model)
        except self._errors as error:
            raise self._serve_error(error) from None

        def specs(items: list[dict[str, Any]]) -> tuple[TensorSpec, ...]:
            return tuple(TensorSpec(t["name"], t["datatype"], tuple(t["shape"])) for t in items)

        return ModelMetadata(meta["name"], tuple(meta["versions"]), specs(meta["inputs"]),
                             specs(meta["outputs"]))

    def infer(self, model: str, feeds: Mapping[str, np.ndarray], regions: Any = None,
              parameters: Mapping[str, Any] | None = None) -> dict[str, np.ndarray]:
        priority = int((parameters or {}).get("priority", 0))
        try:
            result: dict[str, np.ndarray] = self._client.infer(model, feeds, priority=priority,
                                                               copy=False)
        except self._errors as error:
            raise self._serve_error(error) from None
        return result

    def close(self) -> None:
        self._client.close()
