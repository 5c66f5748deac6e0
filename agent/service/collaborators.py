"""What the fleet commands act on: one running agent's parts, as the handlers see them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from agent.service.builds import Builder, core_builder

if TYPE_CHECKING:
    from agent.discovery.model import Topology
    from agent.service.inference import Inference
    from agent.service.tuning import Tuning
    from agent.telemetry.sampler import Sampler


class Session(Protocol):
    @property
    def session(self) -> int: ...


class Announcer(Protocol):
    """The MQTT link as commands use it: announce again, publish a retained report."""

    @property
    def status(self) -> Session: ...

    def rebirth(self) -> None: ...

    def publish_now(self, suffix: str, payload: dict[str, Any],
                    retain: bool = False) -> None: ...


@dataclass(frozen=True)
class Collaborators:
    """What the handlers act on.  Getters where the root replaces or builds a thing after
    the controller: the topology (hot-plug), the link (it needs the controller first)."""

    tuning: Tuning
    inference: Inference
    sampler: Sampler
    link: Callable[[], Announcer]
    topology: Callable[[], Topology]
    status: Callable[[], dict[str, Any]]
    selftest: Callable[[], dict[str, Any]]
    guard_defaults: dict[str, Any]
    model_dirs: list[Path]  # where set-model may load from
    state_dir: Path  # build-model's work directories go under it
    builder: Builder = core_builder  # build-model's build (tests give their own)
    rknn_python: str | None = None  # model_build.rknn_python: the .rknn converter

    def model_allowed(self, path: str | Path) -> bool:
        """Models load only from the configured directories (and the bundled demo), so a
        command cannot make the agent parse an arbitrary file."""
        resolved = Path(path).resolve()
        return any(resolved.is_relative_to(d.resolve()) for d in self.model_dirs)
