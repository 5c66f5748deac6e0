"""The service's tuning: the configured profile planned, applied, verified, switched.

Hot-plug retargets it from the main thread while fleet commands switch and roll it back from
the controller's worker: one reentrant lock makes each operation whole (a switch's rollback
and verify run inside it).

The service applies and rolls back runtime settings only: the unit's ProtectSystem=full makes
/etc and /boot read-only to it, so a profile's persistent settings (kernel arguments,
irqbalance's config, systemd drop-ins) are logged as pending, for ``sudo edge-agent profile
apply`` to write."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.discovery.model import Topology
from agent.kernel.fsroot import Root
from agent.kernel.pm_qos import DMA_LATENCY, LatencyHold
from agent.kernel.sched import ThreadSched
from agent.tuning.engine import ApplyResult, Engine, TuningError
from agent.tuning.errors import ProfileError
from agent.tuning.journal import Journal
from agent.tuning.latency_knobs import KnobError, LatencyKnobs
from agent.tuning.placement import Placement
from agent.tuning.profiles import ProfileStore
from agent.tuning.thp_dynamic import ThpDynamicController

if TYPE_CHECKING:
    from agent.service.parts import Ending

logger = logging.getLogger(__name__)


class Tuning:
    """The configured profile: planned always, applied and verified when the config says."""

    def __init__(self, root: Root, topology: Topology, state_dir: Path, profile: str | None,
                 apply: bool, on_event: Callable[..., None],
                 placement: Placement | None = None) -> None:
        self.engine = Engine(root, topology, Journal(state_dir), ProfileStore(root), placement)
        self.requested, self.apply_wanted, self.on_event = profile, apply, on_event
        self.profile: str | None = None
        self.applied = False
        self.error: str | None = None
        self.runtime: dict[str, Any] = {}
        self.changes = 0
        self.drift: int | None = None
        self.verified_at: float | None = None
        self._thp: ThpDynamicController | None = None
        self._thp_stop = threading.Event()
        self._hold: LatencyHold | None = None  # cpuidle.dma_latency_us, while applied
        self.hold_warning: str | None = None
        self.lock = threading.RLock()  # the QoS loop's ladder moves take it too
        self._knobs: LatencyKnobs | None = None  # the QoS ladder over the applied profile
        # told the inference threads' scheduling after each switch and rollback (the data
        # plane's supervisor), so no thread keeps an old profile's policy or CPUs
        self.on_sched: Callable[[ThreadSched | None], None] | None = None

    def start(self) -> None:
        with self.lock:
            self._start()

    def _start(self) -> None:
        if self.requested is None:
            return
        unknown = self.engine.store.not_here(self.requested)
        if unknown is not None:  # the same words as `edge-agent config check`
            self.error = f"tuning.profile: {unknown}"
            logger.error("tuning: %s", self.error)
            return
        try:
            plan = self.engine.plan(self.requested)
            for skipped in self.engine.store.skipped:  # auto passed over a broken profile
                logger.warning("tuning: %s", skipped)
            self.profile, self.changes, self.runtime = plan.profile, len(plan.changes), \
                plan.runtime
            if self.apply_wanted:
                self._pending(self.engine.apply(self.requested))
                self.applied = True
                self.on_event("tuning_applied", profile=plan.profile, changes=len(plan.changes))
                self._hold_latency()
                self.verify()
                self._start_thp_controller()
        except (ProfileError, TuningError, OSError) as error:
            self.error = str(error)
            logger.error("tuning: %s", error)

    def switch(self, name: str, force: bool = False) -> int:
        """Apply ``name`` now (a command or desired state); returns the number of changes.
        Raises ProfileError or TuningError; the engine leaves nothing half-applied."""
        with self.lock:
            self._stop_thp_controller()
            self._drop_knobs()
            plan = self.engine.plan(name, force=force)
            self._pending(self.engine.apply(name, force=force))
            self.profile, self.changes, self.runtime = plan.profile, len(plan.changes), \
                plan.runtime
            self.applied, self.error = True, None
            self._hold_latency()
            self._sched_changed()
            self.on_event("tuning_applied", profile=plan.profile, changes=len(plan.changes))
            self.verify()
            self._start_thp_controller()
            return len(plan.changes)

    def retarget(self, topology: Topology) -> None:
        """The device changed (hot-plug): plan the active profile again against it, and
        apply it again only when it is applied and the config applies profiles."""
        with self.lock:
            self.engine.topology = topology
            name = self.profile or self.requested
            if name is None:
                return
            try:
                if self.applied and self.apply_wanted:
                    self.switch(name)
                    return
                plan = self.engine.plan(name)
                self.profile, self.changes, self.runtime = plan.profile, len(plan.changes), \
                    plan.runtime
                self.error = None
            except (ProfileError, TuningError, OSError) as error:
                self.error = str(error)
                logger.error("tuning: after a device change: %s", error)

    def rollback(self) -> str | None:
        """Every original value back; returns the profile that was rolled back."""
        with self.lock:
            self._stop_thp_controller()
            self._drop_knobs()
            profile, notes = self.engine.rollback()
            for note in notes:
                logger.info("tuning: %s", note)
            self._release_latency()
            # nothing is applied or planned any more: telemetry and birth must not name it
            self.applied, self.drift, self.verified_at = False, None, None
            self.profile, self.changes, self.runtime = None, 0, {}
            self._sched_changed()
            self.on_event("tuning_rolled_back", profile=profile)
            return profile

    @staticmethod
    def _pending(result: ApplyResult) -> None:
        """Persistent settings the service does not write: said once per apply."""
        if result.pending:
            logger.warning("tuning: %d persistent setting(s) of %s pending (%s): the service "
                           "does not write /etc or /boot (ProtectSystem=full); run `sudo "
                           "edge-agent profile apply %s`", len(result.pending),
                           result.plan.profile, ", ".join(c.path for c in result.pending),
                           result.plan.profile)

    def _hold_latency(self) -> None:
        """Hold /dev/cpu_dma_latency for the applied profile's ``cpuidle.dma_latency_us``
        (a new hold before the old one goes, so a switch leaves no gap); none if it asks for
        none.  A missing or refused device is a warning: the rest of the profile stands."""
        wanted = self.runtime.get("dma_latency_us")
        old, self._hold, self.hold_warning = self._hold, None, None
        if wanted is not None:
            try:
                self._hold = LatencyHold(self.engine.root, int(wanted))
            except OSError as error:
                self.hold_warning = (f"cpuidle.dma_latency_us: {DMA_LATENCY} cannot be held "
                                     f"({error.strerror or error}); idle states are not "
                                     "bounded system-wide")
                logger.warning("tuning: %s", self.hold_warning)
        if old is not None:
            old.release()

    def _release_latency(self) -> None:
        if self._hold is not None:
            self._hold.release()
        self._hold, self.hold_warning = None, None

    def _sched_changed(self) -> None:
        if self.on_sched is not None:
            self.on_sched(self.inference_sched())

    def _stop_thp_controller(self) -> None:
        """The controller shares the journal: it stops before anything else writes it."""
        self._thp_stop.set()
        self._thp = None

    def _start_thp_controller(self) -> None:
        settings = self.runtime.get("thp_dynamic")
        if not settings:
            return
        self._thp_stop = threading.Event()
        self._thp = ThpDynamicController(
            self.engine.root, self.engine.journal, settings,
            lambda event: self.on_event(event.pop("type"), **event),
            cgroup_dir=self.engine.placement.limits_dir)  # the data plane's memory.events
        threading.Thread(target=self._thp.run, args=(self._thp_stop,), name="thp-dynamic",
                         daemon=True).start()

    def latency_knobs(self) -> LatencyKnobs | None:
        """The device's latency ladder over the profile this agent applied (the QoS loop's
        slowest lever; callers hold ``lock``); None while none is applied: the agent moves
        no floor on a device it was not asked to tune."""
        if self._knobs is None and self.applied:
            self._knobs = LatencyKnobs(self.engine.root, self.engine.topology,
                                       self.engine.journal)
        return self._knobs

    def _drop_knobs(self) -> None:
        """The ladder's floors and hold off before anything else writes the journal (a
        switch, a rollback, the end); the next ``latency_knobs`` is over the new profile."""
        if self._knobs is not None:
            try:
                self._knobs.restore()
            except (KnobError, OSError) as error:  # the journal's rollback restores them
                logger.warning("tuning: the QoS latency ladder: %s", error)
            self._knobs = None

    def inference_sched(self) -> ThreadSched | None:
        """The profile's scheduling for the inference thread, once it is applied."""
        wanted = self.runtime.get("inference") if self.applied else None
        if not wanted or "cpus" not in wanted:
            return None
        return ThreadSched(policy=wanted.get("policy", "other"),
                           priority=int(wanted.get("priority", 0)), cpus=list(wanted["cpus"]))

    def verify(self) -> None:
        with self.lock:
            if self.applied:
                self.drift = len(self.engine.verify())
                self.verified_at = time.time()

    def stop(self, ending: Ending) -> None:
        with self.lock:
            self._stop_thp_controller()
            self._drop_knobs()
            self._release_latency()  # the process ends: the kernel would drop it anyway
            if self.applied and ending.rollback:
                try:
                    self.rollback()
                except (TuningError, OSError) as error:
                    logger.error("tuning: rollback failed: %s", error)

    def problems(self) -> list[str]:
        return [f"tuning: {self.error}"] if self.error else []

    def metrics(self) -> dict[str, Any]:
        return {"profile": self.profile, "applied": self.applied, "planned_changes":
                self.changes, "drift": self.drift, "last_verify_ms": None if
                self.verified_at is None else int(self.verified_at * 1000),
                "error": self.error, "dma_latency_us": self._hold.us if self._hold else None}
