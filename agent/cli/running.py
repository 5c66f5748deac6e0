"""The data plane ``edge-agent run`` supervises for a config, as the model commands reach it:
``model build`` loads a new version into it, ``model tune`` reads the rate it recorded."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agent.config import Config
    from agent.serving.http_client import HttpClient


def running_data_plane(config: Config) -> tuple[HttpClient | None, str]:
    """A client of the data plane ``edge-agent run`` supervises for this config, through the
    ready file and control token it keeps in <state_dir>/serve, or None and why not."""
    from agent.service.dataplane import own_child_tls
    from agent.serving.http_client import HttpClient

    directory = Path(config.state_dir) / "serve"
    try:
        ready = json.loads((directory / "ready.json").read_text())
        token = (directory / "control-token").read_text().strip()
        os.kill(int(ready["pid"]), 0)
        address = str(ready["http"])
    except (OSError, ValueError, KeyError, TypeError):
        return None, f"no data plane is running for {config.source}"
    tls = config.serve.tls
    scheme = "https" if tls is not None else "http"
    context = own_child_tls(tls.cert, tls.key, tls.client_ca) if tls is not None else None
    return HttpClient(f"{scheme}://{address}", token=token, ssl_context=context), address
