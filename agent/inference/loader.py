"""Loads models the same way for a whole run: one set of providers, threads and cache.

The CLI and the service both load a first model and later replacements (hot swap); a
replacement must be built exactly like the model it replaces.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from agent.inference.loop import LoadedModel
from agent.inference.session import BuiltSession, build_session


def model_cache_dir(state_dir: str) -> Path | None:
    """The optimised-model cache, or None where the state directory is not writable."""
    directory = Path(state_dir) / "model-cache"
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return directory if os.access(directory, os.W_OK) else None


@dataclass(frozen=True)
class ModelLoader:
    providers: list[str]
    threads: tuple[int, int]  # (intra_op, inter_op)
    cache_dir: Path | None
    allow_spinning: bool | None = None  # options.spinning_for(the loop's scheduling)

    def load(self, path: str, sha256: str | None = None) -> tuple[LoadedModel, BuiltSession]:
        built = build_session(Path(path), providers=self.providers, intra_op=self.threads[0],
                              inter_op=self.threads[1], cache_dir=self.cache_dir,
                              expected_sha256=sha256, allow_spinning=self.allow_spinning)
        model = LoadedModel(name=Path(path).name, session=built.session,
                            providers=built.providers, threads=self.threads,
                            worker_tids=built.worker_tids)
        return model, built
