"""How far a table may go below the SoC's stock voltages, and per-bin voltages kept apart.

A rail's absolute window (550 mV..1 V on RK3588) says nothing about what a frequency needs:
2.4 GHz at 600 mV is inside it and crashes the A76.  So every point is also measured from
the stock table of its SoC, kernel flavour and target (``socs``), and any voltage below it
is refused unless an undervolt is allowed explicitly, with its amount: ``allow_undervolt_mv:``
in a YAML table, the root property ``edge-agent,allow-undervolt-microvolt`` in overlay
source (the shipped overlays say 12.5 mV), or ``--allow-undervolt MV`` on the command line,
which wins over both; a frequency above the stock maximum needs ``--allow-overclock``,
a separate flag because it is a separate risk (a raised undervolt limit should not also
unlock frequencies the chip was never characterised at).
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.overlays.errors import OverlayError
from agent.overlays.socs import MHZ, OppTarget, StockPoint

DEFAULT_MARGIN_UV = 0  # no undervolt unless one is allowed with its amount
PROPERTY = "edge-agent,allow-undervolt-microvolt"  # the allowance in overlay source (root)
FLAG = "--allow-undervolt"
ASK = (f"an undervolt needs its amount allowed: allow_undervolt_mv: in the table, {PROPERTY} "
       f"in the overlay's root node, or {FLAG} MV")
Triple = tuple[int, int, int]


@dataclass(frozen=True)
class Limits:
    """What a check allows below stock and above the maximum; ``explicit`` when an allowance
    with its amount set it, ``source`` says which."""

    margin_uv: int = DEFAULT_MARGIN_UV
    allow_overclock: bool = False
    explicit: bool = False
    source: str = ""

    @classmethod
    def from_flags(cls, allow_undervolt_mv: float | None, allow_overclock: bool) -> Limits:
        if allow_undervolt_mv is None:
            return cls(allow_overclock=allow_overclock)
        return cls(round(allow_undervolt_mv * 1000), allow_overclock, True, FLAG)

    def declared(self, microvolt: int, source: str) -> Limits:
        """The allowance a table or overlay states, unless the command line set one."""
        return self if self.explicit else Limits(microvolt, self.allow_overclock, True, source)

    def describe(self) -> str:
        """The limits in force, as the result reports them."""
        margin = (f"up to {self.margin_uv / 1000:g} mV below stock ({self.source})"
                  if self.explicit else "no voltage below stock (the default)")
        return margin + (", above the stock maximum (--allow-overclock)"
                         if self.allow_overclock else "")

    def as_json(self) -> dict[str, object]:
        return {"undervolt_margin_uv": self.margin_uv, "explicit": self.explicit,
                "allow_overclock": self.allow_overclock}


DEFAULT_LIMITS = Limits()


def reference(target: OppTarget, flavour: str, hz: int) -> StockPoint | None:
    """The stock point a frequency is measured from: the next-higher stock point.

    Not the interpolation between neighbours: the vendor characterised the chip at its
    stock points only, and V(f) is not linear there (the A76 climbs 87.5 mV from 1608 to
    1800 MHz, then 12.5 mV from 2208 to 2400), so a chord can ask for less than the silicon
    needs; the next-higher point's voltage is known to carry the lower frequency.  Below
    the lowest point that is the lowest point; above the highest (an overclock) the highest.
    """
    table = target.stock.get(flavour, ())
    if not table:
        return None
    return next((point for point in table if point.hz >= hz), table[-1])


def stock_voltage(target: OppTarget, flavour: str, point: StockPoint, bin_: str | None) -> int:
    """The stock voltage of a bin (its own where recorded, else the nominal) or the nominal."""
    if bin_ is not None and flavour in target.stock_bins:
        return point.bins.get(bin_, point.microvolt)
    return point.microvolt


def check_floor(file: str, key: str, hz: int, microvolt: int, target: OppTarget,
                flavour: str, limits: Limits, bin_: str | None = None) -> str | None:
    """Refuse a voltage more than the margin below stock; a warning when only a flag allows it."""
    point = reference(target, flavour, hz)
    if point is None:
        return None
    stock = stock_voltage(target, flavour, point, bin_)
    below = stock - microvolt
    where = (f"the {flavour} {target.name} stock {stock} µV"
             + (f" of bin {bin_}" if bin_ is not None and flavour in target.stock_bins else "")
             + f" at {point.hz // MHZ} MHz")
    if below > limits.margin_uv:
        allowed = (f"more than the {limits.margin_uv} µV allowed by {limits.source}"
                   if limits.explicit else "and no undervolt is allowed")
        raise OverlayError(file, key, f"{microvolt} µV at {hz} Hz ({hz / MHZ:g} MHz) is not "
                           f"allowed: {below} µV below {where}, {allowed}; {ASK}")
    if below > 0:
        return (f"{key}: {microvolt} µV at {hz / MHZ:g} MHz is {below} µV below {where}: an "
                f"undervolt, allowed by {limits.source}")
    return None


def rescaled_bins(target: OppTarget, flavour: str, hz: int, triple: Triple,
                  bins: tuple[str, ...]) -> dict[str, Triple]:
    """Each bin's triple for a point set to ``triple``: the stock bin moved by as much as the
    nominal moved, so every bin keeps its stock spread instead of all getting one value (a
    leaky chip's bin runs lower than the nominal: one value would overvolt it).  Where the
    stock bins are not recorded, every bin gets the point's triple (the bin must be set, or
    the stock bin would win over the overlay)."""
    point = reference(target, flavour, hz)
    if point is None or flavour not in target.stock_bins:
        return {bin_: triple for bin_ in bins}
    shift_target, shift_min = triple[0] - point.microvolt, triple[1] - point.microvolt
    result: dict[str, Triple] = {}
    for bin_ in bins:
        stock = point.bins.get(bin_, point.microvolt)
        low = max(stock + shift_min, target.min_uv)
        result[bin_] = (min(max(stock + shift_target, low), triple[2]), min(low, triple[2]),
                        triple[2])
    return result
