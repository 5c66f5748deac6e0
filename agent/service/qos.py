"""The QoS controller while serving (``qos.mode`` advise or control): every ``window_s`` it
reads the data plane's statistics, turns them into each model's window (qos_inputs), lets
the decision core (agent.control.qos) decide, and in ``control`` mode applies each action
through the data plane's token-guarded levers route (threads: the data plane rebuilds
the model's sessions and swaps them in), and the device's latency ladder through
the tuning engine (``ladder``; restored to the profile's rung when the loop stops).  The
control plane decides; the data plane and the engine only execute.

Every action is a ``qos_action`` event (model, the objective it serves, the window figures,
lever, before -> after, why, and in control mode the milliseconds from the decision to the
data plane's answer that it applied); a model that cannot meet its objective with every
lever at its limit is a ``qos_unmet`` event once, a line in status's warnings and
``qos_unmet`` in telemetry's ``qos`` group for as long as it lasts.  ``advise`` moves nothing:
it walks the same steps on the levers it would have set, so its events read as the sequence
``control`` would apply.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Protocol

from agent.control.qos import (
    REBUILT,
    RUNG,
    Action,
    Decision,
    Device,
    Levers,
    Objective,
    QosController,
    Unmet,
)
from agent.service.qos_foreign import ForeignLoad
from agent.service.qos_inputs import Served, Windows, lever_request

if TYPE_CHECKING:
    from agent.config.sections import QosConfig
    from agent.service.parts import Ending
    from agent.serving.http_client import HttpClient

logger = logging.getLogger(__name__)

ObjectiveLookup = Callable[[Iterable[str]], dict[str, Objective]]


class DataPlane(Protocol):
    """What the loop needs of the supervisor (dataplane.Supervisor)."""

    @property
    def ready(self) -> bool: ...

    def client(self, timeout_s: float = 5.0) -> HttpClient: ...

    def base_url(self) -> str: ...

    def status(self) -> dict[str, Any]: ...


class Ladder(Protocol):
    """The device's latency ladder (agent.tuning.latency_knobs.LatencyKnobs): rung 0 is
    the profile as applied; ``apply`` moves through the tuning engine's journal."""

    @property
    def rung(self) -> int: ...

    def ladder(self) -> Sequence[object]: ...

    def apply(self, rung: int) -> None: ...

    def restore(self) -> None: ...


DeviceReader = Callable[[], Mapping[str, Any]]  # utilisation, frequency, throttled, temperature


class QosLoop:
    """One thread, one decision per window; nothing it meets ends it."""

    def __init__(self, config: QosConfig, supervisor: DataPlane,
                 objectives: ObjectiveLookup, on_event: Callable[..., None],
                 controller: QosController | None = None, ladder: Ladder | None = None,
                 device: DeviceReader | None = None,
                 foreign: Callable[[int], float | None] | None = None) -> None:
        self.config, self.supervisor = config, supervisor
        self.objectives, self.on_event = objectives, on_event
        self.controller = controller or QosController(advising=config.mode == "advise")
        self.ladder, self.device = ladder, device
        self.device_figures: dict[str, Any] = {}
        self.foreign = foreign or ForeignLoad()
        self.foreign_cpus: float | None = None  # the last window's (qos_foreign)
        self._advised_rung: int | None = None  # advise: the rung it would have moved to
        self._rebuilding: dict[str, Action] = {}  # threads asked for, not yet swapped
        self.windows = Windows()
        self.actions = 0
        self.last_action: dict[str, Any] | None = None
        self.unmet: dict[str, Unmet] = {}
        self.served: dict[str, Served] = {}
        self._objectives: dict[str, Objective] = {}
        self._advised: dict[str, Levers] = {}  # advise: the levers it would have set
        self._client: HttpClient | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="qos", daemon=True)
        self._thread.start()

    def stop(self, ending: Ending | None = None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._client is not None:
            self._client.close()
        if self.ladder is not None and self.config.mode == "control":
            try:  # the profile's own floor again: what the ladder raised was for serving
                self.ladder.restore()
            except Exception as error:  # the journal's rollback still restores it
                logger.warning("qos: restoring the device's latency ladder failed: %s",
                               error)

    def problems(self) -> list[str]:
        return []  # an unmet objective is a warning: the device, not a fault, falls short

    def _run(self) -> None:
        while not self._stop.wait(self.config.window_s):
            try:
                self.step()
            except Exception:  # the next window tries again
                logger.exception("qos: a window failed")
                self._client = None

    def step(self) -> Decision | None:
        """One window: read, decide, apply; None when the data plane is not ready."""
        from agent.serving.errors import ServeError

        if not self.supervisor.ready:
            return None
        if self._client is None or self._client.base_url != self.supervisor.base_url():
            self._client = self.supervisor.client(timeout_s=2.0)
        client = self._client
        try:
            stats = client.statistics()
        except ServeError as error:
            logger.debug("qos: no statistics: %s", error)
            return None
        pid = self.supervisor.status()["pid"]
        self.served = served = self.windows.advance(pid, stats)
        self.foreign_cpus = self.foreign(pid) if isinstance(pid, int) else None
        for model, asked in list(self._rebuilding.items()):
            if model not in served or served[model].rebuild_failed:  # logged by the plane
                self.controller.refused(asked)
            if model not in served or not served[model].levers.rebuilding:
                del self._rebuilding[model]
        self._objectives = objectives = self.objectives(list(served))
        levers = {m: self._advised.get(m, s.levers) for m, s in served.items()}
        decision = self.controller.decide({m: s.figures for m, s in served.items()},
                                          objectives, levers,
                                          {m: s.configured for m, s in served.items()},
                                          self._device(), self._cpus(), self.foreign_cpus)
        decided = time.perf_counter()
        for action in decision.actions:
            self._act(client, action, served, decided)
        self._report_unmet(decision.unmet)
        return decision

    def _cpus(self) -> int:
        """The CPUs the data plane may run on: what a model may be confined within."""
        try:
            return len(os.sched_getaffinity(int(self.supervisor.status()["pid"])))
        except (OSError, KeyError, TypeError, ValueError):
            return 0  # no placement this window

    def _device(self) -> Device | None:
        """The ladder's place and whether the device throttles (its figures kept for the
        events and telemetry); None without a ladder to move."""
        if self.device is not None:
            self.device_figures = dict(self.device())
        if self.ladder is None:
            return None
        rungs = len(self.ladder.ladder())
        rung = self._advised_rung if self._advised_rung is not None else self.ladder.rung
        return Device(rung, rungs, bool(self.device_figures.get("throttled", False)))

    def _act(self, client: HttpClient, action: Action, served: Mapping[str, Served],
             decided: float) -> None:
        from agent.serving.errors import ServeError

        applied: dict[str, Any] = {}
        if action.lever == RUNG:
            applied = self._climb(action, decided)
        elif self.config.mode == "control":
            try:
                client.set_levers(action.model, lever_request(served[action.model],
                                                              action.lever, action.after))
                applied = {"applied": True,
                           "applied_ms": round((time.perf_counter() - decided) * 1000, 3)}
                if action.lever in REBUILT:  # applied once swapped in: its statistics say
                    self._rebuilding[action.model] = action
                    applied["rebuilding"] = True
            except ServeError as error:  # unloaded meanwhile, or a lever it does not have
                applied = {"applied": False, "error": error.message}
                self.controller.refused(action)
        else:
            current = self._advised.get(action.model, served[action.model].levers)
            self._advised[action.model] = current.set(action.lever, action.after)
            applied = {"applied": False}
        self.actions += 1
        figures: dict[str, Any] = {m: asdict(served[m].figures)
                                   for m in {action.model, action.serves} if m in served}
        if self.device_figures:
            figures["device"] = self.device_figures
        if self.foreign_cpus is not None:
            figures["foreign_cpus"] = round(self.foreign_cpus, 2)
        self.last_action = {"model": action.model, "serves": action.serves,
                            "lever": action.lever, "before": action.before,
                            "after": action.after, "tighten": action.tighten,
                            "why": action.why,
                            "mode": self.config.mode, **applied}
        self.on_event("qos_action", **self.last_action, figures=figures)

    def _climb(self, action: Action, decided: float) -> dict[str, Any]:
        """The device's ladder to ``action.after``: through the tuning engine in control,
        only remembered in advise."""
        assert self.ladder is not None and isinstance(action.after, int)
        if self.config.mode != "control":
            self._advised_rung = action.after
            return {"applied": False}
        try:
            self.ladder.apply(action.after)
        except Exception as error:  # a write the kernel refused: nothing half-applied
            self.controller.refused(action)
            return {"applied": False, "error": str(error)}
        return {"applied": True, "applied_ms": round((time.perf_counter() - decided) * 1000,
                                                     3)}

    def _report_unmet(self, unmet: Mapping[str, Unmet]) -> None:
        for model, now in unmet.items():
            if model not in self.unmet:
                self.on_event("qos_unmet", model=model, p99_ms=now.p99_ms,
                              best_p99_ms=now.best_p99_ms, mode=self.config.mode)
        self.unmet = dict(unmet)

    # -- what the rest of the agent reads -------------------------------------------------------

    def warnings(self) -> list[str]:
        if self.config.mode == "advise":  # nothing was moved: no lever was seen to fail
            return [f"qos: model {m} misses its p99 objective of {u.p99_ms:g} ms (best "
                    f"{u.best_p99_ms:.3g} ms); advise: the moves it advised have every lever "
                    "at its limit, and none was made" for m, u in sorted(self.unmet.items())]
        return [f"qos: model {m} misses its p99 objective of {u.p99_ms:g} ms with every "
                f"lever at its limit or of no help (best {u.best_p99_ms:.3g} ms)"
                for m, u in sorted(self.unmet.items())]

    def metrics(self) -> dict[str, Any]:
        """Telemetry's ``qos`` group: each model with an objective, its window, its levers
        and ``qos_unmet`` while it lasts."""
        models = {}
        for model, objective in sorted(self._objectives.items()):
            served = self.served.get(model)
            entry: dict[str, Any] = {"class": objective.service_class,
                                     "p99_ms": objective.p99_ms, "min_rps": objective.min_rps}
            if served is not None:
                entry.update(window=asdict(served.figures), levers=asdict(
                    self._advised.get(model, served.levers)))
            if model in self.unmet:
                entry["qos_unmet"] = {"best_p99_ms": self.unmet[model].best_p99_ms}
            models[model] = entry
        device: dict[str, Any] = {}
        if self.ladder is not None:
            device["rung"] = (self._advised_rung if self._advised_rung is not None
                              else self.ladder.rung)
            device["rungs"] = len(self.ladder.ladder())
        if self.foreign_cpus is not None:
            device["foreign_cpus"] = round(self.foreign_cpus, 2)
        return {"mode": self.config.mode, "window_s": self.config.window_s,
                "windows": self.controller.window, "actions": self.actions,
                "last_action": self.last_action, "models": models,
                "device": device | self.device_figures}

