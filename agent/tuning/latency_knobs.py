"""The latency knobs of the active profile: a ladder of CPU frequency floors, then tighter
CPU latency (PM QoS) holds, that the QoS controller climbs as its slowest lever.

Rung 0 is the profile as applied (least power).  Each further rung asks for more: first the
frequency floors of the inference cores' cpufreq policies in a few steps up to their current
maximum (the profile's ``max_khz``, a power mode's or site's cap, a thermal cap: the kernel
shows the lowest of them in ``scaling_max_freq``), then, with the floors at the top, a
/dev/cpu_dma_latency hold at each shallower idle state's exit latency in turn.  Nothing goes
past the profile: a policy whose governor it set to ``performance`` (already at its top),
``powersave`` (the profile chose least power; not the active-mode pstate drivers' dynamic
``powersave``) or ``userspace`` gets no floors, a profile that chose least power everywhere
(every chosen policy on such a ``powersave``) gets no PM QoS rungs either, and a hold is
only offered where it keeps out an idle state the profile's own bounds
(``cpuidle.dma_latency_us``, ``disable_deeper_than_us``) allow, never below the latency of
state 0 (on x86: C1; see ``cpuidle.latency_floor``).

Floors go through the tuning journal as a layer on the profile (``agent.tuning.layer``):
journaled before written, read back, restored by ``profile rollback`` and after a crash.
The hold is not journaled: the kernel drops it when its file closes, even on a crash.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.discovery.model import Cluster, IdleState, Topology
from agent.kernel.fsroot import Root
from agent.kernel.pm_qos import DMA_LATENCY, LatencyHold
from agent.tuning import layer
from agent.tuning.journal import Journal, JournalState
from agent.tuning.plan import read_normalised
from agent.tuning.tuners.cpuidle import RESUME_LATENCY, latency_floor
from agent.tuning.tuners.dvfs import POLICIES
from agent.tuning.tuners.pstate import EPP_DRIVERS

FLOOR_STEPS = 3  # floor rungs per policy: enough to find the knee, few enough to climb fast
KEY = "qos.cpu_floor_khz"
# governors under which a floor adds nothing the profile wants (see the module docstring)
# (None: no governor file, or powersave where it means the floor; see ``_governor``)
NO_FLOOR_GOVERNORS = (None, "performance", "userspace")


@dataclass(frozen=True)
class KnobStep:
    """One rung: per cpufreq policy the floor (kHz) or None for the profile's own floor;
    a /dev/cpu_dma_latency hold (us) or None for none beyond the profile's."""

    cpu_floor_khz: dict[str, int] | None
    pm_qos_us: int | None


@dataclass(frozen=True)
class PolicyRange:
    """One policy's floors: the profile's (under any layer) and the offered steps above it."""

    policy: str
    floor_khz: int
    steps_khz: list[int]


class KnobError(RuntimeError):
    """A rung could not be applied; the knobs are still at the rung they were at."""


def floor_steps(under: int, top: int, available: list[int] | None, hardware_min: int | None,
                hardware_max: int | None, steps: int = FLOOR_STEPS) -> list[int]:
    """Up to ``steps`` floors above ``under`` and up to ``top``, ending at the highest one:
    offered frequencies where the driver lists them, else even steps of the hardware range
    (pstate drivers list none)."""
    if available:
        offered = sorted(f for f in set(available) if under < f <= top)
    elif hardware_min is not None and hardware_max is not None:
        high = min(top, hardware_max)
        offered = sorted({under + (high - under) * k // steps for k in range(1, steps + 1)}
                         - {under}) if high > under else []
    else:
        return []
    if len(offered) <= steps:
        return offered
    return [offered[-(-len(offered) * k // steps) - 1] for k in range(1, steps + 1)]


def hold_steps(states: list[IdleState], bound: int | None) -> list[int]:
    """Holds that each keep the cores out of one more idle state, loosest first: the exit
    latency of each shallower state, tighter than ``bound`` (the profile's own), never below
    what state 0 (x86: C1) needs."""
    latencies = sorted({s.latency_us for s in states if s.latency_us is not None}, reverse=True)
    floor = latency_floor(states)
    if floor is None or len(latencies) < 2:
        return []
    # the deepest state the profile's bound still allows: a hold must keep out one more
    allowed = max((v for v in latencies if bound is None or v <= bound), default=-1)
    return [v for v in latencies[1:] if floor[0] <= v < allowed]


def build_ladder(ranges: list[PolicyRange], holds: list[int]) -> list[KnobStep]:
    """Rung 0, the floor rungs (each policy a step higher, one at its top staying there),
    then the holds with every floor at its top."""
    ranges = [r for r in ranges if r.steps_khz]
    ladder = [KnobStep(None, None)]
    for index in range(max((len(r.steps_khz) for r in ranges), default=0)):
        ladder.append(KnobStep({r.policy: r.steps_khz[min(index, len(r.steps_khz) - 1)]
                                for r in ranges}, None))
    top = ladder[-1].cpu_floor_khz
    ladder += [KnobStep(top, us) for us in holds]
    return ladder


class LatencyKnobs:
    """The ladder of the profile applied now (or the hardware's bounds when none is), and
    the rung the device is on.  Its journal updates hold the journal's lock
    (``Journal.updating``); its own state (rung, hold) is for one thread, the QoS
    controller's.  Built after the profile is applied: a profile switch or rollback
    takes the layer off (the engine plans against the journal's originals), so the
    caller restores the knobs first and builds them anew after."""

    def __init__(self, root: Root, topology: Topology, journal: Journal) -> None:
        self.root, self.topology, self.journal = root, topology, journal
        state = layer.live(root, journal)
        self._clusters = {c.policy: c for c in self._chosen(state)}
        self._ranges = [self._range(c, state) for c in self._clusters.values()]
        floors = [r for r in self._ranges if r.steps_khz]
        power_first = bool(self._clusters) and all(
            self._governor(c) is None for c in self._clusters.values())
        holds = [] if power_first or not root.exists(DMA_LATENCY) else \
            hold_steps(self._idle_states(), self._profile_bound(state))
        self._ladder = build_ladder(floors, holds)
        self._rung = 0
        self._hold: LatencyHold | None = None

    # -- what the profile and the board allow ----------------------------------------------

    def _chosen(self, state: JournalState | None) -> list[Cluster]:
        """The inference cores' online policies (the profile's ``rt.inference.cpus``), every
        online policy where the profile names none."""
        wanted = (state.runtime.get("inference") or {}).get("cpus") if state else None
        cpus = set(wanted) if wanted else set(self.topology.cpu.online)
        return [c for c in self.topology.cpu.clusters
                if c.policy and set(c.online_cpus) & cpus]

    def _governor(self, cluster: Cluster) -> str | None:
        """The policy's governor; None where there is none, or where it holds the floor by
        choice: a generic driver's ``powersave`` runs at the floor (the active-mode pstate
        drivers' ``powersave`` is their dynamic governor, EPP_DRIVERS)."""
        governor = read_normalised(self.root, f"{POLICIES}/{cluster.policy}/scaling_governor",
                                   "value")
        if governor == "powersave" and cluster.scaling_driver not in EPP_DRIVERS:
            return None
        return governor

    def _range(self, cluster: Cluster, state: JournalState | None) -> PolicyRange:
        directory = f"{POLICIES}/{cluster.policy}"
        under = self._under(f"{directory}/scaling_min_freq", state)
        top = self._read_khz(f"{directory}/scaling_max_freq")
        if under is None or top is None or self._governor(cluster) in NO_FLOOR_GOVERNORS:
            return PolicyRange(str(cluster.policy), under or 0, [])
        return PolicyRange(str(cluster.policy), under, floor_steps(
            under, top, cluster.available_khz, cluster.min_khz, cluster.max_khz))

    def _under(self, path: str, state: JournalState | None) -> int | None:
        """The floor the profile set (or the original one), beneath any layer now on it."""
        layered = layer.under(state)
        if path in layered and state is not None:
            entry = next(c for c in state.changes if c.path == path)
            below = layered[path] if layered[path] is not None else entry.current
            return int(below) if below is not None else None
        return self._read_khz(path)

    def _read_khz(self, path: str) -> int | None:
        value = read_normalised(self.root, path, "value")
        return int(value) if value is not None and value.isdigit() else None

    def _idle_states(self) -> list[IdleState]:
        states = [s for c in self._clusters.values() for s in c.idle_states]
        return states or self.topology.cpu.idle_states

    @staticmethod
    def _profile_bound(state: JournalState | None) -> int | None:
        """The tightest latency bound the profile holds already, if any."""
        if state is None:
            return None
        bounds = [int(c.desired) if c.desired.isdigit() else 0 for c in state.changes
                  if c.path.endswith(RESUME_LATENCY)]
        if state.runtime.get("dma_latency_us") is not None:
            bounds.append(int(state.runtime["dma_latency_us"]))
        return min(bounds) if bounds else None

    # -- the ladder ----------------------------------------------------------------------

    def ladder(self) -> list[KnobStep]:
        return list(self._ladder)

    @property
    def rung(self) -> int:
        return self._rung

    @property
    def hold_us(self) -> int | None:
        return self._hold.us if self._hold else None

    def apply(self, rung: int) -> None:
        """Move to ``rung``: the hold first (a new one before the old goes), then the
        floors as one journaled step.  Raises KnobError (the file and the kernel's errno)
        and stays on the rung it was on when a write is refused."""
        if not 0 <= rung < len(self._ladder):
            raise KnobError(f"rung {rung}: the ladder has rungs 0..{len(self._ladder) - 1}")
        step = self._ladder[rung]
        hold = self._new_hold(step.pm_qos_us)
        try:
            layer.set_layer(self.root, self.journal, self._targets(step))
        except OSError as error:
            if hold is not self._hold and hold is not None:
                hold.release()
            raise KnobError(f"rung {rung} not applied: {error}") from None
        if hold is not self._hold and self._hold is not None:
            self._hold.release()
        self._hold, self._rung = hold, rung

    def restore(self) -> None:
        """Back to rung 0: every layered floor off (also one a previous run left), no hold."""
        state = layer.live(self.root, self.journal)
        targets: dict[layer.Layered, str | None] = {
            layer.Layered(path, KEY): None for path in layer.under(state)}
        try:
            layer.set_layer(self.root, self.journal, targets)
        except OSError as error:
            raise KnobError(f"rung 0 not restored: {error}") from None
        if self._hold is not None:
            self._hold.release()
        self._hold, self._rung = None, 0

    def _new_hold(self, us: int | None) -> LatencyHold | None:
        if us is None:
            return None
        if self._hold is not None and self._hold.us == us:
            return self._hold
        try:
            return LatencyHold(self.root, us)
        except OSError as error:
            raise KnobError(f"{DMA_LATENCY}: cannot hold {us} us: "
                            f"{layer.kernel_error(error)}") from None

    def _targets(self, step: KnobStep) -> dict[layer.Layered, str | None]:
        """Each ladder policy's floor for ``step``, clipped to its maximum now (a thermal
        cap may have come since the ladder was built); None: the profile's own floor."""
        floors = step.cpu_floor_khz or {}
        targets: dict[str, tuple[layer.Layered, str | None]] = {}
        for item in self._ranges:
            path = f"{POLICIES}/{item.policy}/scaling_min_freq"
            wanted = floors.get(item.policy)
            top = self._read_khz(f"{POLICIES}/{item.policy}/scaling_max_freq")
            if wanted is not None and top is not None:
                wanted = min(wanted, top)
            targets[path] = (layer.Layered(path, KEY, restore=_at_hardware_min(
                self._clusters[item.policy])), str(wanted) if wanted is not None and
                wanted > item.floor_khz else None)
        # a floor an earlier run left on a policy this ladder does not raise comes off
        for path in layer.under(layer.live(self.root, self.journal)):
            targets.setdefault(path, (layer.Layered(path, KEY), None))
        return dict(targets.values())


def _at_hardware_min(cluster: Cluster) -> layer.Restore:
    """As dvfs's rollback: a floor at the hardware minimum is no floor, restored as 0 (the
    QoS request's default), never filed as a request (docs/kernel-facts/ineffective.md)."""
    lowest = min(cluster.available_khz) if cluster.available_khz else cluster.min_khz

    def restore(current: str) -> str | None:
        return "0" if lowest is not None and current.isdigit() and int(current) <= lowest \
            else None
    return restore


def profile_max_khz(root: Root, journal: Journal) -> dict[str, int]:
    """Policy -> the maximum the applied profile set (``max_khz``): a clip there is the
    profile's, not throttling (``agent.telemetry.device.DeviceWindow``'s expected max)."""
    state = layer.live(root, journal)
    prefix, suffix = f"{POLICIES}/", "/scaling_max_freq"
    return {c.path[len(prefix):-len(suffix)]: int(c.desired) for c in
            (state.changes if state else [])
            if c.path.startswith(prefix) and c.path.endswith(suffix) and c.desired.isdigit()}
