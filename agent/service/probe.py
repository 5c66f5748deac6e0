"""``edge-agent selftest``'s probe: a second agent started beside any running one, checked,
stopped.  It builds a whole agent, so it sits beside the composition root, not in it."""

from __future__ import annotations

import dataclasses
import tempfile
import threading
import time
from typing import Any

from agent.config import Config
from agent.service.node import Service
from agent.service.selftest import run_checks
from agent.serving.local_listener import MAX_PATH


def _any_port(address: str) -> str:
    return f"{address.rpartition(':')[0]}:0"


def _probe_config(config: Config, scratch: str) -> Config:
    """The config of the probe: its own node id, state and ports, nothing applied.  The data
    plane reads the config as written (``raw``), so its addresses change there too: free
    ports of its own, no metrics endpoint, its local socket and Frigate's endpoint in its
    scratch directory (the running agent holds the configured ones); neither where the
    scratch path is too long for a socket (a long TMPDIR): the checks call over HTTP."""
    fits = len(f"{scratch}/infer.sock".encode()) <= MAX_PATH
    local = frigate = None
    if config.serve.local is not None and fits:
        local = dataclasses.replace(config.serve.local, socket=f"{scratch}/infer.sock")
    if config.serve.frigate is not None and fits:
        frigate = dataclasses.replace(config.serve.frigate, endpoint=f"ipc://{scratch}/frigate")
    serve = dataclasses.replace(config.serve, http=_any_port(config.serve.http),
                                grpc=_any_port(config.serve.grpc), metrics=None,
                                local=local, frigate=frigate)
    raw_serve = {**config.raw.get("serve", {}), "http": serve.http, "grpc": serve.grpc,
                 "metrics": None}
    raw_serve["local"] = False if local is None else dataclasses.asdict(local)
    raw_serve["frigate"] = None if frigate is None else dataclasses.asdict(frigate)
    raw = {**config.raw, "state_dir": scratch, "serve": raw_serve}
    return dataclasses.replace(
        config, node_id=f"{config.node_id}-selftest"[:64], state_dir=scratch,
        tuning=dataclasses.replace(config.tuning, apply=False),
        control=dataclasses.replace(config.control, enabled=False),
        prometheus=dataclasses.replace(config.prometheus, listen=None),
        home_assistant=dataclasses.replace(config.home_assistant, enabled=False),
        serve=serve, inference=dataclasses.replace(config.inference, source="none"), raw=raw)


def run_selftest(config: Config, seconds: float = 3.0,
                 stop: threading.Event | None = None) -> dict[str, Any] | None:
    """Start the agent beside any running one (its own state directory, ports and MQTT
    client id, nothing applied, nothing retained on the broker), let it work for
    ``seconds``, check it, stop it.  None when ``stop`` is set first: the probe is stopped
    (its threads joined) and there is no verdict."""
    with tempfile.TemporaryDirectory(prefix="edge-agent-selftest-") as scratch:
        probe = _probe_config(config, scratch)
        stop = stop or threading.Event()
        service = Service(probe, retain=False)
        try:
            service.start()
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline and not (
                    service.link is not None and service.link.status.state == "connected"
                    and service.inference is not None and (
                        service.inference.supervisor.ready or not config.inference.enabled)):
                if stop.wait(0.1):
                    return None
            return None if stop.is_set() else run_checks(service.subject())
        finally:
            service.stop(flush_s=0, rollback=False)
