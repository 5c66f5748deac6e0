"""One model instance's backend as this board runs it: the provider plan for its device and
precision, and the RKNN backend for a Rockchip NPU's cores (the data plane's factory)."""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from agent.discovery.model import Topology
from agent.inference.devices import parse_device
from agent.inference.model_files import model_sha256
from agent.inference.provider_options import ProviderPlan, RuntimeVersions, plan_instance
from agent.serving.repository import RKNN_FILE

if TYPE_CHECKING:
    from agent.inference.backends.rknn import RknnBackend


def _digest(path: Path) -> str:
    """The model's digest (model_files: external data included), hashed once for all the
    instances of a version: cached while no file of its directory changes."""
    files = sorted((entry.name, entry.stat().st_mtime_ns, entry.stat().st_size)
                   for entry in os.scandir(path.parent) if entry.is_file())
    return _digest_of(path, tuple(files))


@functools.lru_cache(maxsize=64)
def _digest_of(path: Path, files: tuple[tuple[str, int, int], ...]) -> str:
    return model_sha256(path)


@dataclass(frozen=True)
class Board:
    """What the factory knows of the board: discovery, ORT's providers, the runtimes."""

    topology: Topology
    available: Sequence[str]  # empty: onnxruntime.get_available_providers()
    versions: RuntimeVersions | None
    state_dir: Path | None
    providers: Sequence[str]  # the server's (discovered or configured) order

    def runtime_versions(self) -> RuntimeVersions:
        if self.versions is not None:
            return self.versions
        import onnxruntime as ort

        return RuntimeVersions(onnxruntime=ort.__version__)

    def plan(self, path: Path, sha256: str | None, providers: Sequence[str] | None,
             device: str, precision: str) -> ProviderPlan:
        """The plan of one instance of ``path``; the model's digest keys its engine cache."""
        available = list(self.available)
        if not available:
            import onnxruntime as ort

            available = ort.get_available_providers()
        plan = plan_instance(parse_device(device), precision, self.topology, available,
                             self.runtime_versions(), model_sha256=sha256 or _digest(path),
                             state_dir=self.state_dir or Path("."),
                             override=providers or self.providers)
        if path.name == RKNN_FILE and plan.backend != "rknn":
            raise ValueError(f"{path} runs on the NPU only (instances[].device: npu:N), and "
                             f"this instance is on {device}: add the model.onnx it was "
                             "converted from for the others")
        return plan

    def rknn(self, path: Path, device: str, precision: str) -> RknnBackend:
        """The .rknn beside (or at) ``path`` on the NPU cores ``device`` names."""
        from agent.inference.backends import rknn

        return rknn.load(path.with_name(RKNN_FILE), parse_device(device), precision,
                         runtime_version=self.runtime_versions().librknnrt)
