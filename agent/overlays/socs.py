"""SoC facts the overlay generator and checks rely on: OPP tables, their labels and limits.

One place for every number, so a table is judged by the same facts whether it comes from a
YAML file or from a compiled overlay.  Sources: the RK3588 device trees of the vendor BSP
(5.10/6.1) and of mainline (``arch/arm64/boot/dts/rockchip/rk3588*.dtsi``): OPP tables, max
cells, clock latency, vendor triples and bins, labels and node paths as each spells them.

Stock tables (the voltage each frequency ships with, the floor an undervolt is measured
from): mainline CPU clusters from ``rk3588-opp.dtsi``; the GPU, the NPU, the vendor
nominal values (``opp-microvolt``) and the vendor per-bin CPU values (``opp-microvolt-L<n>``,
RK3588 parts, not J/M) as the vendor BSP's ``rk3588s.dtsi`` declares them.  The vendor
GPU/NPU per-bin values are not recorded here, so those bins are measured from the nominal.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

FLAVOURS = ("vendor", "mainline")
MHZ = 1_000_000

# The lowest voltage RK3588 board device trees allow on the CPU/GPU/NPU rails
# (regulator-min-microvolt of the RK806/RK8602 rails).  Unconfirmed on hardware:
# check on a board with /sys/class/regulator/*/min_microvolts.
RK3588_RAIL_MIN_UV = 550_000


@dataclass(frozen=True)
class StockPoint:
    """One stock operating point: its target voltage and, on vendor kernels, per-bin ones."""

    hz: int
    microvolt: int                                   # the target cell of opp-microvolt
    bins: Mapping[str, int] = field(default_factory=dict)  # a bin not listed runs microvolt


def _p(mhz: int, microvolt: int, first_bin: int = 0, bins: tuple[int, ...] = ()) -> StockPoint:
    """A stock point; ``bins`` are the targets of L<first_bin>, L<first_bin + 1>, ..."""
    return StockPoint(mhz * MHZ, microvolt,
                      {f"L{first_bin + i}": uv for i, uv in enumerate(bins)})


def _flat(mhzs: tuple[int, ...], microvolt: int) -> tuple[StockPoint, ...]:
    return tuple(_p(mhz, microvolt) for mhz in mhzs)


# RK3588 stock tables by target, then flavour (µV targets; bins: vendor RK3588 parts).
_A55_VENDOR = (*_flat((408, 600, 816, 1008), 675_000),
               _p(1200, 712_500, 1, (700_000, 700_000, 687_500, 675_000, 675_000, 675_000)),
               _p(1416, 762_500, 1, (750_000, 737_500, 725_000, 725_000, 712_500, 712_500)),
               _p(1608, 850_000, 1, (837_500, 825_000, 812_500, 800_000, 800_000, 787_500)),
               _p(1800, 950_000, 1, (937_500, 925_000, 912_500, 900_000, 887_500, 875_000)))
_A55_MAINLINE = (_p(1008, 675_000), _p(1200, 712_500), _p(1416, 762_500), _p(1608, 850_000),
                 _p(1800, 950_000))
_A76_MID = (_p(1416, 725_000, 2, (712_500, 700_000, 700_000, 687_500, 675_000, 675_000)),
            _p(1608, 762_500, 2, (750_000, 737_500, 725_000, 712_500, 700_000, 700_000)),
            _p(1800, 850_000, 1, (837_500, 825_000, 812_500, 800_000, 787_500, 775_000,
                                  762_500)),
            _p(2016, 925_000, 1, (912_500, 900_000, 887_500, 875_000, 862_500, 850_000,
                                  837_500)))
_A76_TOP = _flat((2256, 2304, 2352, 2400), 1_000_000)
_A76_VENDOR = {
    1: (*_flat((408, 600, 816, 1008, 1200), 675_000), *_A76_MID,
        _p(2208, 987_500, 1, (975_000, 962_500, 950_000, 962_500, 950_000, 925_000, 912_500)),
        *_A76_TOP),
    2: (*_flat((408, 600, 816, 1008, 1200), 675_000), *_A76_MID,
        _p(2208, 987_500, 3, (975_000, 962_500, 950_000, 925_000, 912_500)), *_A76_TOP)}
_A76_MAINLINE = (_p(1200, 675_000), _p(1416, 725_000), _p(1608, 762_500), _p(1800, 850_000),
                 _p(2016, 925_000), _p(2208, 987_500), _p(2400, 1_000_000))
_GPU = (*_flat((300, 400, 500, 600), 675_000), _p(700, 700_000), _p(800, 750_000),
        _p(900, 800_000), _p(1000, 850_000))
_NPU = (*_flat((300, 400, 500, 600, 700), 700_000), _p(800, 750_000), _p(900, 800_000),
        _p(1000, 850_000))


@dataclass(frozen=True)
class OppTarget:
    """One OPP table an overlay may change, and the limits a table for it must keep."""

    name: str
    label: str                  # the DT label an overlay fragment targets (&label)
    paths: Mapping[str, str]    # flavour -> node path; a missing flavour has no such table
    min_hz: int
    max_hz: int
    min_uv: int
    max_uv: int                 # the highest cell the SoC's own tables use
    clock_latency_ns: int | None = None
    # flavour -> frequency above which the stock table gates OPPs by opp-supported-hw
    gated_above_hz: Mapping[str, int] = field(default_factory=dict)
    # flavour -> the stock table by rising frequency: undervolts are measured from it
    stock: Mapping[str, tuple[StockPoint, ...]] = field(default_factory=dict)
    stock_bins: tuple[str, ...] = ()  # flavours whose stock points carry their per-bin values


@dataclass(frozen=True)
class Soc:
    name: str
    compatibles: tuple[str, ...]   # the first is written into generated overlays
    targets: Mapping[str, OppTarget]
    supplies: Mapping[str, int] = field(default_factory=dict)  # µV triples per OPP, by flavour
    # flavour -> per-bin property suffixes (opp-microvolt-<bin>) the kernel prefers when
    # present; an overlay that sets a voltage must set these too or a bin wins over it
    voltage_bins: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    note: str = ""                 # why a SoC offers no OPP targets


def _cpu(name: str, cluster: int, max_hz: int, max_uv: int,
         stock: Mapping[str, tuple[StockPoint, ...]],
         gated: Mapping[str, int] | None = None) -> OppTarget:
    return OppTarget(name=name, label=f"cluster{cluster}_opp_table",
                     paths={"vendor": f"/cluster{cluster}-opp-table",
                            "mainline": f"/opp-table-cluster{cluster}"},
                     min_hz=408 * MHZ, max_hz=max_hz, min_uv=RK3588_RAIL_MIN_UV, max_uv=max_uv,
                     clock_latency_ns=40_000, gated_above_hz=gated or {}, stock=stock,
                     stock_bins=("vendor",))


RK3588 = Soc(
    name="rk3588",
    compatibles=("rockchip,rk3588", "rockchip,rk3588s"),
    targets={
        "cpu-little": _cpu("cpu-little", 0, 1800 * MHZ, 950_000,
                           {"vendor": _A55_VENDOR, "mainline": _A55_MAINLINE}),
        "cpu-big0": _cpu("cpu-big0", 1, 2400 * MHZ, 1_000_000,
                         {"vendor": _A76_VENDOR[1], "mainline": _A76_MAINLINE},
                         {"vendor": 2208 * MHZ}),
        "cpu-big1": _cpu("cpu-big1", 2, 2400 * MHZ, 1_000_000,
                         {"vendor": _A76_VENDOR[2], "mainline": _A76_MAINLINE},
                         {"vendor": 2208 * MHZ}),
        "gpu": OppTarget(name="gpu", label="gpu_opp_table",
                         paths={"vendor": "/gpu-opp-table",
                                "mainline": "/gpu@fb000000/opp-table"},
                         min_hz=300 * MHZ, max_hz=1000 * MHZ, min_uv=RK3588_RAIL_MIN_UV,
                         max_uv=850_000, stock={"vendor": _GPU, "mainline": _GPU}),
        # mainline device trees have no NPU OPP table: vendor only
        "npu": OppTarget(name="npu", label="npu_opp_table", paths={"vendor": "/npu-opp-table"},
                         min_hz=300 * MHZ, max_hz=1000 * MHZ, min_uv=RK3588_RAIL_MIN_UV,
                         max_uv=850_000, stock={"vendor": _NPU}),
    },
    # vendor OPPs carry two triples (the rail, then its SRAM rail) and per-bin voltages
    supplies={"vendor": 2, "mainline": 1},
    voltage_bins={"vendor": tuple(f"L{n}" for n in range(8))},
)

TEGRA234 = Soc(
    name="tegra234",
    compatibles=("nvidia,tegra234",),
    targets={},
    note="Jetson CPU operating points come from BPMP firmware, not from device-tree OPP "
         "tables, so there is no OPP table to overlay; cap them at "
         "runtime (profile dvfs, nvpmodel). dts-overlays/jetson-orin-cpu-alert.dts shows what "
         "an overlay can change there: a thermal trip point",
)

SOCS: dict[str, Soc] = {soc.name: soc for soc in (RK3588, TEGRA234)}


def soc_for_compatible(compatibles: list[str]) -> Soc | None:
    """The SoC whose compatible string appears in a device tree's (or overlay's) list."""
    for soc in SOCS.values():
        if any(c in soc.compatibles for c in compatibles):
            return soc
    return None
