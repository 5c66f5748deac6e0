"""``edge-agent serve``: the data plane's settings from the agent's config, then the server.

What the repository serves besides its own directories: the bundled demo model as ``demo``
and ``inference.model`` (when it is another file) as the default entry named after its file,
both version 1 served in place.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

from agent.config import Config
from agent.inference.demo_model import DEMO_MODEL_PATH

DEMO = "demo"


def default_model(config: Config) -> str:
    """The entry ``metrics.inference`` reports and ``set-model`` changes by default."""
    path = Path(config.inference.model)
    if path.resolve() == DEMO_MODEL_PATH.resolve():
        return DEMO
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", path.stem).lstrip(".")[:64]
    return name or "model"


def builtin_models(config: Config) -> dict[str, Path]:
    entries = {DEMO: DEMO_MODEL_PATH}
    entries[default_model(config)] = Path(config.inference.model)
    return entries


def serve(config: Config, state_dir: Path, *, ready_file: Path | None = None,
          sched_file: Path | None = None, token_files: tuple[Path, ...] = (),
          http: str | None = None, grpc: str | None = None) -> int:
    """Discover, choose providers and threads as ``run`` does, then serve until SIGTERM."""
    import onnxruntime as ort

    from agent.discovery import discover
    from agent.inference.loader import model_cache_dir
    from agent.inference.options import thread_plan
    from agent.inference.provider_options import runtime_versions
    from agent.inference.providers import choose_providers
    from agent.kernel.fsroot import Root
    from agent.serving.building import BUILDING_FILE, write_building
    from agent.serving.frigate_protocol import FrigateSettings
    from agent.serving.local_listener import LocalSettings, default_socket
    from agent.serving.server import ServerSettings
    from agent.serving.server import serve as run_server
    from agent.serving.threads import read_sched_file

    ort.set_default_logger_severity(3)
    topology = discover(Root(config.root))
    providers = choose_providers(ort.get_available_providers(), topology,
                                 config.inference.providers)
    sched = read_sched_file(sched_file)
    s = config.serve
    frigate = None if s.frigate is None else FrigateSettings(
        s.frigate.endpoint, s.frigate.model, s.frigate.model_type, s.frigate.input_dtype,
        s.frigate.request_timeout_ms)
    settings = ServerSettings(
        http=http or s.http, grpc=grpc or s.grpc,
        repository=Path(s.repository or state_dir / "repository"),
        builtins=builtin_models(config),
        pins={default_model(config): config.inference.sha256} if config.inference.sha256
        else {},
        token_files=(Path(s.token_file), *token_files),
        max_request_bytes=s.max_request_bytes, max_inflight_bytes=s.max_inflight_bytes,
        privileged_priority=s.privileged_priority, http_max_connections=s.http_max_connections,
        http_header_timeout_s=s.http_header_timeout_s,
        http_idle_timeout_s=s.http_idle_timeout_s, providers=providers,
        local=None if s.local is None else LocalSettings(
            Path(s.local.socket) if s.local.socket else default_socket(state_dir),
            s.local.group, s.local.max_sessions, int(s.local.max_region_mb * (1 << 20))),
        threads=thread_plan(topology, sched.cpus if sched else None),
        cache_dir=model_cache_dir(str(state_dir)),
        tls_cert=s.tls.cert if s.tls else None, tls_key=s.tls.key if s.tls else None,
        tls_client_ca=s.tls.client_ca if s.tls else None,
        sched_file=sched_file, ready_file=ready_file, metrics=s.metrics, frigate=frigate,
        shm_prefix=s.shm_prefix, topology=topology, state_dir=state_dir, freeze_heap=True,
        available=ort.get_available_providers(),
        versions=runtime_versions(ort.__version__, topology.runtimes),
        building=functools.partial(write_building, ready_file.with_name(BUILDING_FILE))
        if ready_file is not None else None)
    return run_server(settings)
