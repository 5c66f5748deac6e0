"""The QoS controller's vocabulary: objectives, one window's figures, the levers as served,
the device's latency ladder, and the actions and verdicts a decision returns.  Plain values
so the decision core stays pure and the service layer maps them to the data plane's and the
tuning engine's terms."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

CLASSES = ("latency_critical", "throughput", "best_effort")  # most protected first
DELAY = "max_queue_delay_us"
PREFERRED = "preferred_batch_size"
ADMIT = "admit_rps"
THREADS = "threads"
CPUS = "cpus"
REALTIME = "realtime"  # a latency-critical model's threads at SCHED_FIFO
RUNG = "device_rung"  # the device's latency ladder: CPU frequency floor and PM QoS
INSTANT = (DELAY, PREFERRED, ADMIT, CPUS, REALTIME)  # the data plane changes these in place
REBUILT = (THREADS,)  # the data plane rebuilds the model's sessions for these
ADMIT_STEP = 0.7  # each admission step keeps this share of the rate admitted before
ADMIT_FLOOR_RPS = 1.0  # a model without min_rps is never held below this
MIN_DELAY_US = 100  # a queue delay below this is no delay: the step goes to 0

Value = float | tuple[int, ...] | None


@dataclass(frozen=True)
class Objective:
    """A model's ``qos`` in config.yaml."""

    service_class: str
    p99_ms: float | None = None
    min_rps: float | None = None

    @property
    def rank(self) -> int:
        return CLASSES.index(self.service_class)


@dataclass(frozen=True)
class Figures:
    """One model's window: p99 of its calls, queue wait (p99), calls per second, and
    requests refused (queue full, shed, expired, not admitted)."""

    p99_ms: float
    queue_ms: float = 0.0
    rate_rps: float = 0.0
    rejections: int = 0
    count: int = 0


@dataclass(frozen=True)
class Levers:
    """A model's levers as served: queue delay, largest preferred batch (0: the model does
    not batch), the admission cap (None: every request admitted), intra-op threads per
    session (0: not a lever here), the CPUs its sessions run on (None: any), whether its
    threads are lifted to real time (None: not a lever here), and whether a rebuild for
    its threads is still under way."""

    max_queue_delay_us: int
    preferred_batch_size: int
    admit_rps: float | None = None
    threads: int = 0
    cpus: tuple[int, ...] | None = None
    rebuilding: bool = False
    realtime: bool | None = None

    def get(self, lever: str) -> Value:
        return {DELAY: self.max_queue_delay_us, PREFERRED: self.preferred_batch_size,
                ADMIT: self.admit_rps, THREADS: self.threads, CPUS: self.cpus,
                REALTIME: self.realtime}[lever]

    def set(self, lever: str, value: Value) -> Levers:
        if lever == ADMIT:
            assert not isinstance(value, tuple)
            return replace(self, admit_rps=value)
        if lever == CPUS:
            assert value is None or isinstance(value, tuple)
            return replace(self, cpus=value)
        if lever == REALTIME:
            return replace(self, realtime=bool(value))
        assert isinstance(value, int | float)
        return replace(self, **{lever: int(value)})  # type: ignore[arg-type]


@dataclass(frozen=True)
class Device:
    """The device's latency ladder (rung 0: the profile as applied; each rung up a higher
    CPU frequency floor or a tighter PM QoS, all within the profile's bounds) and whether it
    throttles now (a higher floor would then fight the thermal cap: never past it)."""

    rung: int
    rungs: int
    throttled: bool = False


@dataclass(frozen=True)
class Action:
    """One lever moved: on ``model`` (the served model for the device's ladder), for the
    objective of ``serves``."""

    model: str
    lever: str
    before: Value
    after: Value
    why: str
    serves: str
    tighten: bool


@dataclass(frozen=True)
class Unmet:
    """A model whose objective cannot be met with every lever at its limit."""

    model: str
    p99_ms: float  # the objective
    best_p99_ms: float  # the best window seen since the levers ran out


@dataclass(frozen=True)
class Hysteresis:
    violate_windows: int = 2  # violating windows among the last violate_span that act
    violate_span: int = 4
    relax_windows: int = 5
    hold_windows: int = 3
    max_relax_windows: int = 300
    margin: float = 0.7  # "holds with margin": p99 at most this share of the objective
    # objectives that hold without that margin for this many times the relax wait still
    # relax one step (a probe, undone at once if it violates): without it a model held near
    # its objective by something else would keep the others held back for good; after a
    # probe that held, the next waits only the relax wait, so a cap left from a cause that
    # has gone climbs back in a few probes rather than one every ten waits
    probe_factor: int = 10
    # a step on another model (or the device) that left the p99 level of the model it was
    # taken for above this share of what it was is given back: it did not help
    helped: float = 0.9
    trial_windows: int = 4  # judged windows after such a step that decide whether it helped
    futile_windows: int = 30  # a lever that did not help is passed over this long at first
    # a p99 level this many times what it was when a lever did not help (or when the model
    # became unmet) is a new cause: the levers are tried again
    risen: float = 1.5
    refused_windows: int = 30  # a lever refused is not asked for again for this long
    min_count: int = 1  # a window with fewer calls says nothing about latency
    # windows not judged after a move: the one the move fell in mixes both settings (with
    # twenty calls a window, one request that waited under the old delay is the p99)
    settle_windows: int = 1
    # the cores busy outside the agent falling this many below their level at the last
    # tightening: the load the steps met has gone, so probing starts again at the relax wait
    foreign_drop: float = 0.2


@dataclass
class Decision:
    actions: list[Action] = field(default_factory=list)
    unmet: dict[str, Unmet] = field(default_factory=dict)  # every model unmet now
