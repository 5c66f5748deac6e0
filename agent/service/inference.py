"""The service's inference: the configured model in the loop, swapped and restarted on
command."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.config import Config
from agent.discovery.model import Topology
from agent.kernel.sched import ThreadSched

if TYPE_CHECKING:
    from agent.service.parts import Ending

logger = logging.getLogger(__name__)


class Inference:
    """The configured model in the inference loop; absent (and reported) when it fails."""

    def __init__(self, config: Config, topology: Topology, state_dir: Path,
                 sched: ThreadSched | None, on_event: Callable[..., None]) -> None:
        self.config, self.topology, self.state_dir = config.inference, topology, state_dir
        self.sched, self.on_event = sched, on_event
        self.loop: Any = None  # InferenceLoop once started
        self.loader: Any = None  # ModelLoader: replacements are built like the first model
        self.error: str | None = None
        self.providers: list[str] = []
        self.unused: list[Any] = []  # UnusedAccelerator: discovered, not reached by providers
        self.model_path = self.config.model

    def start(self) -> None:
        if not self.config.enabled:
            return
        import onnxruntime as ort

        from agent.inference.accelerators import unused_accelerators
        from agent.inference.errors import SessionError
        from agent.inference.io import NpyDirectorySource, SourceError, SyntheticSource
        from agent.inference.loader import ModelLoader, model_cache_dir
        from agent.inference.loop import InferenceLoop
        from agent.inference.options import thread_plan
        from agent.inference.providers import choose_providers

        ort.set_default_logger_severity(3)
        available = ort.get_available_providers()
        try:
            providers = choose_providers(available, self.topology, self.config.providers)
            self.unused = unused_accelerators(available, self.topology, providers)
            self.loader = ModelLoader(providers, thread_plan(
                self.topology, self.sched.cpus if self.sched else None),
                model_cache_dir(str(self.state_dir)))
            model, built = self.loader.load(self.model_path, self.config.sha256)
            inputs = built.session.get_inputs()
            source: Any = (SyntheticSource(inputs, self.config.dims)
                           if self.config.source == "synthetic" else
                           NpyDirectorySource(self.config.source.removeprefix("npy:"),
                                              inputs[0].name))
        except (SessionError, SourceError, OSError, ValueError) as error:
            named = isinstance(error, SessionError) and error.model is not None
            self.error = (f"inference.model {error}" if named  # it begins with the file
                          else f"inference.model {self.model_path}: {error}")
            logger.error("%s", self.error)
            return
        self.providers = built.providers
        # What ORT registered, which is less than asked where an EP failed to start.
        self.unused = unused_accelerators(available, self.topology, built.providers)
        for accelerator in self.unused:
            logger.warning("%s is not used: %s", accelerator.device, accelerator.reason)
        self.loop = InferenceLoop(model, source, rate_hz=self.config.rate_hz,
                                  thread_sched=self.sched,
                                  on_event=lambda e: self.on_event(e.pop("type"), **e))
        self.loop.start()

    def metrics(self) -> dict[str, Any] | None:
        if self.loop is None:
            return None if self.error is None else {"error": self.error}
        model = self.loop.active
        return {"model": model.name, "providers": self.providers,
                "stuck": model.stats.stuck(time.perf_counter_ns()), **model.stats.snapshot()}

    def swap(self, path: str, sha256: str | None, canary_s: float, max_error_rate: float,
             max_p99_ratio: float, max_p99_ms: float | None) -> Any:
        """Load ``path`` beside the running model and hot-swap to it (loop.swap checks,
        watches the canary window and switches back by itself); returns the SwapResult."""
        if self.loop is None or self.loader is None:
            raise RuntimeError(self.error or "inference is not running")
        model, _built = self.loader.load(path, sha256)
        result = self.loop.swap(model, canary_s=canary_s, max_error_rate=max_error_rate,
                                max_p99_ratio=max_p99_ratio, max_p99_ms=max_p99_ms)
        if not result.rolled_back:
            self.model_path = path
        return result

    def restart(self) -> None:
        """A fresh loop on the current model (after a stuck call, say)."""
        self._stop_loop()
        self.loop, self.error = None, None
        self.start()

    def _stop_loop(self) -> None:
        if self.loop is not None:
            self.loop.stop()

    def stop(self, ending: Ending) -> None:
        self._stop_loop()

    def problems(self) -> list[str]:
        return [self.error] if self.error else []
