"""The service's inference: the supervised data plane, what it serves, and the changes the
fleet makes to it (a new model version, a restart, a new profile's scheduling)."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.config import Config
from agent.discovery.model import Topology
from agent.kernel.sched import ThreadSched
from agent.service.dataplane import Supervisor
from agent.service.intervals import Intervals, key
from agent.service.serve import builtin_models, default_model
from agent.telemetry.backends import instance_backends

if TYPE_CHECKING:
    from agent.inference.stats import Window
    from agent.service.loaddriver import LoadDriver
    from agent.service.parts import Ending
    from agent.tuning.placement import Placement

logger = logging.getLogger(__name__)

LOAD_ALLOWANCE_S = 300.0  # building a new version's sessions, on top of its canary
MODEL_FILE = "model.onnx"
EXTRA_FILES = ("build.json", "model.rknn")  # what a version may hold beside its model.onnx
UNCOMMITTED = ".installing"  # in a version whose canary has not passed yet


class InstallFailed(Exception):
    """A model version that was not installed; ``code`` is the command's failure code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class Inference:
    """The data plane as a part of the agent; absent (and reported) when disabled."""

    def __init__(self, config: Config, topology: Topology, state_dir: Path,
                 sched: ThreadSched | None, on_event: Callable[..., None],
                 placement: Placement | None = None) -> None:
        self.config, self.topology = config, topology
        self.supervisor = Supervisor(config, state_dir, on_event, sched, placement=placement)
        self.default = default_model(config)
        self.model_path = config.inference.model  # what the default entry last got
        self.repository = Path(config.serve.repository or state_dir / "repository")
        self.error: str | None = None
        self.providers: list[str] = []
        self.available: list[str] = []  # onnxruntime.get_available_providers() of this install
        self.unused: list[Any] = []  # UnusedAccelerator: discovered, not reached by providers
        self.driver: LoadDriver | None = None
        self.intervals = Intervals()  # what the last telemetry sample reported

    @property
    def enabled(self) -> bool:
        return self.config.inference.enabled

    def launch(self) -> None:
        """The data plane spawned, not waited for (``wait_ready``): the agent goes on to the
        broker meanwhile, as a TensorRT build takes minutes."""
        if not self.enabled:
            return
        import onnxruntime as ort

        from agent.inference.accelerators import unused_accelerators
        from agent.inference.errors import SessionError
        from agent.inference.providers import choose_providers

        available = self.available = list(ort.get_available_providers())
        try:  # what the data plane will choose, named here for birth and selftest
            self.providers = choose_providers(available, self.topology,
                                              self.config.inference.providers)
        except SessionError as error:
            self.error = f"inference.providers: {error}"
        self.unused = unused_accelerators(available, self.topology, self.providers)
        for accelerator in self.unused:
            logger.warning("%s is not used: %s", accelerator.device, accelerator.reason)
        self.sweep()
        self.supervisor.launch()

    def wait_ready(self) -> None:
        """The data plane's first ready (or its failure), then the load driver, if any."""
        if not self.enabled:
            return
        self.supervisor.wait_ready()
        source = self.config.inference.source
        if source != "none":
            from agent.service.loaddriver import LoadDriver

            self.driver = LoadDriver(self.supervisor.client, self.default, source,
                                     self.config.inference.dims, self.config.inference.rate_hz)
            self.driver.start()

    def stop(self, ending: Ending) -> None:
        if self.driver is not None:
            self.driver.stop()
        self.supervisor.stop(ending)

    def problems(self) -> list[str]:
        return ([self.error] if self.error else []) + (
            self.supervisor.problems() if self.enabled else [])

    def restart(self) -> None:
        self.supervisor.restart()

    def resched(self, sched: ThreadSched | None) -> None:
        if self.enabled:  # disabled: no data plane, no directory for its file
            self.supervisor.resched(sched)

    # -- figures -----------------------------------------------------------------------------

    def metrics(self) -> dict[str, Any] | None:
        """``metrics.inference``: the default model as before, every model and version under
        ``models``, and the data plane's own state.  Counts and latencies are the interval's
        since the previous sample (``count_total``/``errors_total``: since start), so this is
        to be called once per telemetry sample."""
        if not self.enabled:
            return None
        plane = self.supervisor.status()
        stats = self.supervisor.stats  # one read: the supervisor replaces the list
        figures = self.intervals.advance(plane["pid"], stats)
        models = [{"name": s["name"], "version": s["version"],
                   "backends": instance_backends(s), **figures.get(key(s), {})}
                  for s in stats]
        entry = max((s for s in stats if s.get("name") == self.default),
                    key=lambda s: int(s.get("version") or 0), default=None)
        if entry is None:
            return {"model": self.default, "error": "; ".join(self.problems()) or
                    "not served", "models": models, "data_plane": plane}
        ours = entry.get("edge_agent") or {}
        return {"model": self.default, "version": entry["version"],
                "providers": ours.get("providers", self.providers),
                "stuck": bool(ours.get("stuck")),
                **figures.get(key(entry), {}),
                "models": models, "data_plane": plane}

    def window(self) -> tuple[int, Window] | None:
        """The default model's window now, read afresh, with the restart count (a window
        of another process's statistics cannot be compared)."""
        from agent.inference.stats import Window
        from agent.serving.errors import ServeError

        if not self.supervisor.ready:
            return None
        try:
            stats = self.supervisor.client().statistics(self.default)
        except ServeError:
            return None
        served = max(stats, key=lambda s: int(s.get("version") or 0), default=None)
        raw = (served or {}).get("edge_agent", {}).get("window")
        return None if raw is None else (self.supervisor.restarts, Window.from_dict(raw))

    def served_models(self) -> list[dict[str, Any]]:
        """Birth's list: each model with the versions that serve."""
        found: dict[str, list[str]] = {}
        for entry in self.supervisor.index:
            if entry.state == "READY":
                found.setdefault(entry.name, []).append(entry.version)
        return [{"name": name, "versions": versions} for name, versions in sorted(found.items())]

    # -- a new version -------------------------------------------------------------------------

    def install(self, source: Path, sha256: str | None, name: str | None,
                canary: dict[str, Any], extras: Mapping[str, Path] | None = None,
                temporary: bool = False) -> dict[str, Any]:
        """Copy a verified file in as the next version of ``name``, with ``extras`` beside it
        (a name in EXTRA_FILES -> where it is: a build's ``build.json``, its ``model.rknn``),
        and load it through the data plane's canary; a version that fails is removed again
        and the old one serves.  The files go into a staging directory renamed into place,
        marked until the canary passed (a start removes a version still marked: the agent
        stopped or died during its canary).  ``temporary``: the source goes away after (a
        build's work directory), so the default entry's path names the installed copy."""
        from agent.modelbuild.install import stage
        from agent.serving.errors import ServeError

        name = name or self.default
        files = {MODEL_FILE: self._read(source)}
        for file, path in (extras or {}).items():
            if file not in EXTRA_FILES:
                raise ValueError(f"{file!r} is not a file a version holds")
            files[file] = self._read(path)
        digest = hashlib.sha256(files[MODEL_FILE]).hexdigest()
        if sha256 is not None and digest != sha256.lower():
            raise InstallFailed("model_rejected", f"{source}: has sha256 {digest}, expected "
                                f"{sha256}; not installed")
        version = self._next_version(name)
        target = stage(self.repository / name, version, files, UNCOMMITTED)
        try:
            self.supervisor.client().load(name, {"canary": json.dumps(canary)},
                                          timeout_s=LOAD_ALLOWANCE_S + canary["canary_s"])
        except ServeError as error:
            shutil.rmtree(target, ignore_errors=True)
            code = "canary_failed" if error.code == "FAILED_PRECONDITION" else "model_rejected"
            raise InstallFailed(code, f"{name} version {version}: {error.message}") from None
        (target / UNCOMMITTED).unlink(missing_ok=True)
        path = target / MODEL_FILE if temporary else source
        if name == self.default:
            self.model_path = str(path)
        return {"model": name, "version": version, "sha256": digest, "path": str(path),
                **({"files": sorted(files)} if extras else {})}

    def withdraw(self, installed: Mapping[str, Any], path: str) -> None:
        """Take back a version ``install`` put in (a desired state that failed after it):
        its directory removed and the model loaded again, so the version before it serves,
        and the default entry's path ``path`` again.  OSError or ServeError when it cannot."""
        name = installed["model"]
        shutil.rmtree(self.repository / name / str(installed["version"]))
        if name == self.default:
            self.model_path = path
        self.supervisor.client().load(name, timeout_s=LOAD_ALLOWANCE_S)

    @staticmethod
    def _read(path: Path) -> bytes:
        try:
            return path.read_bytes()
        except OSError as error:
            raise InstallFailed("model_rejected", f"{path}: {error.strerror or error}") \
                from None

    def sweep(self) -> list[Path]:
        """Remove what an install left when the agent stopped or died in it: a staging
        directory, a version whose canary never passed.  Before the data plane starts."""
        removed = [*self.repository.glob("*/.*.partial"),
                   *(marker.parent for marker in self.repository.glob(f"*/*/{UNCOMMITTED}"))]
        for directory in removed:
            logger.warning("%s: left by an install that did not finish; removed", directory)
            shutil.rmtree(directory, ignore_errors=True)
        return removed

    def _next_version(self, name: str) -> int:
        from agent.modelbuild.install import next_version

        return next_version(self.repository / name, name in builtin_models(self.config))
