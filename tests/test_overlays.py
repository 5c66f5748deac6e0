"""Device-tree overlays: shipped sources, the generator, validation and the boot installer.

Real ``dtc`` and ``fdtoverlay`` (Debian's device-tree-compiler, installed by
``install.sh --dev``) compile, decompile and apply every overlay onto small base trees that
carry the real RK3588/Jetson node paths and labels; boot layouts are built in tmp_path.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from agent_process import modules_loaded_by

from agent.cli import main
from agent.kernel.fsroot import Root
from agent.overlays import build, installer
from agent.overlays.check import inspect
from agent.overlays.dtc import DtcMissing
from agent.overlays.errors import InstallRefused, OverlayError
from agent.overlays.stock import Limits
from agent.overlays.table import load_table

REPO = Path(__file__).resolve().parents[1]
OVERLAYS = REPO / "dts-overlays"
MHZ = 1_000_000


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} not found: install Debian's device-tree-compiler "
                    "(./install.sh --dev installs it; CI does)")
    return path


def compile_dts(source: str, tmp: Path, name: str = "x") -> Path:
    (tmp / f"{name}.dts").write_text(source)
    out = tmp / f"{name}.dtb"
    subprocess.run([tool("dtc"), "-@", "-I", "dts", "-O", "dtb", "-o", str(out),
                    str(tmp / f"{name}.dts")], check=True, capture_output=True)
    return out


def decompile(blob: Path) -> dict[str, dict[str, str]]:
    """node path -> {property: raw value} from ``dtc -I dtb -O dts`` output."""
    text = subprocess.run([tool("dtc"), "-I", "dtb", "-O", "dts", str(blob)], check=True,
                          capture_output=True, text=True).stdout
    nodes: dict[str, dict[str, str]] = {}
    stack: list[str] = []
    for raw in text.splitlines():
        line = raw.strip()
        if line.endswith("{"):
            name = line[:-1].strip()
            stack.append("" if name == "/" else name)
            nodes["/" + "/".join(stack[1:])] = {}
        elif line == "};":
            stack.pop()
        elif line.endswith(";") and stack:
            key, _, value = line[:-1].partition(" = ")
            nodes["/" + "/".join(stack[1:])][key] = value
    return nodes


def cells(value: str) -> list[int]:
    return [int(v, 16) for v in re.findall(r"0x[0-9a-f]+", value)]


def points(nodes: dict[str, dict[str, str]], table: str) -> dict[int, dict[str, object]]:
    """hz -> {microvolt cells, disabled, flags} for the OPP nodes directly below ``table``."""
    found: dict[int, dict[str, object]] = {}
    for path, props in nodes.items():
        if path.rsplit("/", 1)[0] != table or "opp-hz" not in props:
            continue
        high, low = cells(props["opp-hz"])
        found[high << 32 | low] = {
            "microvolt": cells(props.get("opp-microvolt", "")),
            "disabled": props.get("status") == '"disabled"',
            "suspend": "opp-suspend" in props, "turbo": "turbo-mode" in props,
            "bins": {k: cells(v) for k, v in props.items() if k.startswith("opp-microvolt-")}}
    return found


def apply(base: Path, overlay: Path, tmp: Path) -> dict[str, dict[str, str]]:
    merged = tmp / "merged.dtb"
    subprocess.run([tool("fdtoverlay"), "-i", str(base), "-o", str(merged), str(overlay)],
                   check=True, capture_output=True)
    return decompile(merged)


def opp(hz: int, uv: int, extra: str = "") -> str:
    return (f"opp-{hz} {{ opp-hz = /bits/ 64 <{hz}>; opp-microvolt = <{uv} {uv} 1000000>; "
            f"clock-latency-ns = <40000>; {extra}}};")


def vendor_opp(hz: int, uv: int) -> str:
    return (f"opp-{hz} {{ opp-hz = /bits/ 64 <{hz}>; opp-microvolt = <{uv} {uv} 1000000>, "
            f"<{uv} {uv} 1000000>; opp-microvolt-L2 = <{uv - 25000} {uv - 25000} 1000000>, "
            f"<{uv - 25000} {uv - 25000} 1000000>; }};")


# Small base trees with the real node paths and labels of each kernel flavour.
MAINLINE_BASE = f"""/dts-v1/;
/ {{
    compatible = "radxa,rock-5b", "rockchip,rk3588";
    cluster0_opp_table: opp-table-cluster0 {{ compatible = "operating-points-v2"; opp-shared;
        {opp(1608 * MHZ, 850000)} {opp(1800 * MHZ, 950000)} }};
    cluster1_opp_table: opp-table-cluster1 {{ compatible = "operating-points-v2"; opp-shared;
        {opp(408 * MHZ, 675000, "opp-suspend; ")} {opp(2208 * MHZ, 987500)}
        {opp(2400 * MHZ, 1000000)} }};
    cluster2_opp_table: opp-table-cluster2 {{ compatible = "operating-points-v2"; opp-shared;
        {opp(2208 * MHZ, 987500)} {opp(2400 * MHZ, 1000000)} }};
    gpu: gpu@fb000000 {{
        compatible = "rockchip,rk3588-mali", "arm,mali-valhall-csf";
        operating-points-v2 = <&gpu_opp_table>;
        gpu_opp_table: opp-table {{ compatible = "operating-points-v2";
            {opp(900 * MHZ, 800000)} {opp(1000 * MHZ, 850000)} }};
    }};
}};
"""
VENDOR_BASE = f"""/dts-v1/;
/ {{
    compatible = "radxa,rock-5b", "rockchip,rk3588";
    cluster1_opp_table: cluster1-opp-table {{ compatible = "operating-points-v2";
        {vendor_opp(2208 * MHZ, 987500)} }};
    gpu_opp_table: gpu-opp-table {{ compatible = "operating-points-v2";
        {vendor_opp(900 * MHZ, 800000)} }};
    npu_opp_table: npu-opp-table {{ compatible = "operating-points-v2";
        {vendor_opp(800 * MHZ, 750000)} {vendor_opp(900 * MHZ, 800000)}
        {vendor_opp(1000 * MHZ, 850000)} }};
}};
"""
JETSON_BASE = """/dts-v1/;
/ {
    compatible = "nvidia,p3768-0000+p3767-0005", "nvidia,tegra234";
    thermal-zones { cpu-thermal { polling-delay = <0>; trips {
        cpu-hot { temperature = <99000>; hysteresis = <0>; type = "hot"; }; }; }; };
};
"""

TABLE = """\
allow_undervolt_mv: 25
opps:
  - {hz: 408000000, microvolt: 675000, opp-suspend: true}
  - {hz: 1800000000, microvolt: [837500, 825000, 1000000]}
  - {hz: 2208000000, microvolt: [975000, 962500, 1000000], turbo-mode: true}
  - {hz: 2400000000, disabled: true}
"""


def expected_points(supplies: int) -> dict[int, dict[str, object]]:
    """What TABLE asks for, as decompiled: one triple per supply, disabled points bare."""
    def point(microvolt: list[int], disabled: bool = False, suspend: bool = False,
              turbo: bool = False) -> dict[str, object]:
        return {"microvolt": microvolt * supplies, "disabled": disabled, "suspend": suspend,
                "turbo": turbo}
    return {408 * MHZ: point([675000] * 3, suspend=True),
            1800 * MHZ: point([837500, 825000, 1000000]),
            2208 * MHZ: point([975000, 962500, 1000000], turbo=True),
            2400 * MHZ: point([], disabled=True)}


def without_bins(found: dict[int, dict[str, object]]) -> dict[int, dict[str, object]]:
    return {hz: {k: v for k, v in p.items() if k != "bins"} for hz, p in found.items()}


# -- shipped sources ----------------------------------------------------------------------

SHIPPED = sorted(OVERLAYS.glob("*.dts"))


def test_dts_overlays_holds_sources_only() -> None:
    assert {p.name for p in OVERLAYS.iterdir()} - {p.name for p in SHIPPED} == {"README.md"}


@pytest.mark.parametrize("source", SHIPPED, ids=lambda p: p.stem)
def test_every_shipped_overlay_compiles(source: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.dtbo"
    result = subprocess.run([tool("dtc"), "-@", "-I", "dts", "-O", "dtb", "-o", str(out),
                             str(source)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert out.read_bytes()[:4] == bytes.fromhex("d00dfeed")


def test_shipped_overlays_cover_every_rk3588_table_and_jetson() -> None:
    covered = {(t.flavour, t.target.name) for p in SHIPPED
               for t in build.from_entry(p.stem).overlay.tables}
    assert covered == {("mainline", "cpu-little"), ("mainline", "cpu-big0"),
                       ("mainline", "cpu-big1"), ("mainline", "gpu"), ("vendor", "npu")}
    jetson = build.from_entry("jetson-orin-cpu-alert").overlay
    assert jetson.compatibles == ["nvidia,tegra234"]
    assert [f.path for f in jetson.fragments] == ["/thermal-zones/cpu-thermal"]


@pytest.mark.parametrize(("name", "base", "table", "expected"), [
    ("rk3588-mainline-cpu-big0-capped", MAINLINE_BASE, "/opp-table-cluster1",
     {2208 * MHZ: [975000, 975000, 1000000], 2400 * MHZ: []}),
    ("rk3588-mainline-cpu-big1-capped", MAINLINE_BASE, "/opp-table-cluster2",
     {2208 * MHZ: [975000, 975000, 1000000], 2400 * MHZ: []}),
    ("rk3588-mainline-cpu-little-capped", MAINLINE_BASE, "/opp-table-cluster0",
     {1608 * MHZ: [837500, 837500, 950000], 1800 * MHZ: []}),
    ("rk3588-mainline-gpu-capped", MAINLINE_BASE, "/gpu@fb000000/opp-table",
     {900 * MHZ: [787500, 787500, 850000], 1000 * MHZ: []}),
    ("rk3588-vendor-npu-capped", VENDOR_BASE, "/npu-opp-table",
     {800 * MHZ: [737500, 737500, 850000] * 2, 900 * MHZ: [787500, 787500, 850000] * 2,
      1000 * MHZ: []}),
])
def test_shipped_rk3588_overlay_applies_onto_its_flavour(
        name: str, base: str, table: str, expected: dict[int, list[int]],
        tmp_path: Path) -> None:
    overlay = tmp_path / f"{name}.dtbo"
    overlay.write_bytes(build.from_entry(name).dtbo)
    merged = points(apply(compile_dts(base, tmp_path), overlay, tmp_path), table)
    for hz, microvolt in expected.items():
        assert merged[hz]["microvolt"] == (microvolt or merged[hz]["microvolt"])
        assert merged[hz]["disabled"] is (not microvolt)
    if "vendor" in name:  # the stock per-bin voltage no longer undercuts the overlay's
        assert merged[900 * MHZ]["bins"]["opp-microvolt-L2"] == [787500, 787500, 850000] * 2


def test_jetson_overlay_adds_a_trip_point(tmp_path: Path) -> None:
    overlay = tmp_path / "alert.dtbo"
    overlay.write_bytes(build.from_entry("jetson-orin-cpu-alert").dtbo)
    merged = apply(compile_dts(JETSON_BASE, tmp_path), overlay, tmp_path)
    trip = merged["/thermal-zones/cpu-thermal/trips/edge-agent-alert"]
    assert cells(trip["temperature"]) == [85000]
    assert trip["type"] == '"passive"'
    assert cells(merged["/thermal-zones/cpu-thermal/trips/cpu-hot"]["temperature"]) == [99000]


# -- the generator ------------------------------------------------------------------------

@pytest.mark.parametrize("flavour", ["mainline", "vendor"])
def test_generated_overlay_decompiles_to_exactly_the_requested_points(
        flavour: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "big0.yaml").write_text(TABLE)
    out = tmp_path / "big0.dtbo"
    assert main(["overlay", "build", "--soc", "rk3588", "--flavour", flavour, "--target",
                 "cpu-big0", "--table", str(tmp_path / "big0.yaml"), "--out", str(out)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"wrote {out}"
    nodes = decompile(out)
    assert nodes["/"]["compatible"] == '"rockchip,rk3588"'
    assert nodes["/__fixups__"] == {"cluster1_opp_table": '"/fragment@0:target:0"'}
    found = points(nodes, "/fragment@0/__overlay__")
    assert without_bins(found) == expected_points(2 if flavour == "vendor" else 1)
    if flavour == "mainline":
        assert all(point["bins"] == {} for point in found.values())
        return
    # each bin moved from its own stock value by as much as the nominal moved (target -12.5
    # mV, min -25 mV at 1800 MHz from the stock 850 mV), not every bin flattened to one value
    assert found[1800 * MHZ]["bins"] == {
        f"opp-microvolt-L{n}": [stock - 12500, stock - 25000, 1000000] * 2
        for n, stock in enumerate([850000, 837500, 825000, 812500, 800000, 787500, 775000,
                                   762500])}
    assert found[2208 * MHZ]["bins"]["opp-microvolt-L7"] == [900000, 887500, 1000000] * 2
    assert found[408 * MHZ]["bins"] == {f"opp-microvolt-L{n}": [675000] * 6 for n in range(8)}
    assert found[2400 * MHZ]["bins"] == {}


@pytest.mark.parametrize(("flavour", "base", "table"), [
    ("mainline", MAINLINE_BASE, "/opp-table-cluster1"),
    ("vendor", VENDOR_BASE, "/cluster1-opp-table")])
def test_fdtoverlay_applies_a_generated_overlay(flavour: str, base: str, table: str,
                                                tmp_path: Path) -> None:
    (tmp_path / "t.yaml").write_text(TABLE)
    built = build.from_table(load_table(tmp_path / "t.yaml", "rk3588", flavour, "cpu-big0"),
                             "t")
    (tmp_path / "t.dtbo").write_bytes(built.dtbo)
    merged = points(apply(compile_dts(base, tmp_path), tmp_path / "t.dtbo", tmp_path), table)
    supplies = 2 if flavour == "vendor" else 1
    assert merged[2208 * MHZ]["microvolt"] == [975000, 962500, 1000000] * supplies
    assert merged[2208 * MHZ]["turbo"] is True
    assert merged[1800 * MHZ]["microvolt"] == [837500, 825000, 1000000] * supplies  # added
    if flavour == "mainline":
        assert merged[2400 * MHZ]["disabled"] is True
        assert merged[2400 * MHZ]["microvolt"] == [1000000] * 3  # stock values stay below it
    else:
        # the stock L2 of 2208 MHz is 962500: it moves with the nominal (-12.5 mV, -25 mV)
        assert merged[2208 * MHZ]["bins"]["opp-microvolt-L2"] == [950000, 937500, 1000000] * 2


def test_generated_source_is_what_gets_compiled(tmp_path: Path) -> None:
    (tmp_path / "t.yaml").write_text("soc: rk3588\nflavour: mainline\ntarget: gpu\n"
                                     "allow_undervolt_mv: 12.5\nopps:\n"
                                     "  - {hz: 800000000, microvolt: 737500}\n")
    built = build.from_table(load_table(tmp_path / "t.yaml"), "t")
    assert built.source is not None
    assert "&gpu_opp_table {" in built.source
    assert "\t\topp-microvolt = <737500 737500 737500>;" in built.source
    assert "clock-latency-ns" not in built.source  # CPU tables only
    # the allowance travels with the overlay: its .dtbo installs later without a flag
    assert "\tedge-agent,allow-undervolt-microvolt = <12500>;" in built.source
    (tmp_path / "t.dtbo").write_bytes(built.dtbo)
    assert build.from_file(tmp_path / "t.dtbo").limits.margin_uv == 12500


# -- validation ---------------------------------------------------------------------------

BAD_TABLES = {
    "duplicate frequency": (
        "opps:\n  - {hz: 1800000000, microvolt: 850000}\n  - {hz: 1800000000, microvolt: "
        "850000}\n",
        "opps[1].hz: 1800000000 is not allowed: opps[0] has the same frequency (each "
        "frequency once)"),
    "frequency above the SoC's range": (
        "opps:\n  - {hz: 2600000000, microvolt: 1000000}\n",
        "opps[0].hz: 2600000000 is not allowed: expected a frequency 408000000..2400000000 Hz "
        "for rk3588 cpu-big0 (above it needs --allow-overclock)"),
    "frequency below the SoC's range": (
        "opps:\n  - {hz: 96000000, microvolt: 675000}\n",
        "opps[0].hz: 96000000 is not allowed: expected a frequency 408000000..2400000000 Hz "
        "for rk3588 cpu-big0"),
    "voltage above the regulator's range": (
        "opps:\n  - {hz: 2400000000, microvolt: [1000000, 1000000, 1100000]}\n",
        "opps[0].microvolt[2]: 1100000 is not allowed: expected µV 550000..1000000 (the rk3588 "
        "cpu-big0 rail)"),
    "voltage below the regulator's range": (
        "opps:\n  - {hz: 408000000, microvolt: 500000}\n",
        "opps[0].microvolt: 500000 is not allowed: expected µV 550000..1000000 (the rk3588 "
        "cpu-big0 rail)"),
    "voltage falling as frequency rises": (
        "opps:\n  - {hz: 2208000000, microvolt: 950000}\n  - {hz: 1800000000, microvolt: "
        "975000}\n",
        "opps[0].microvolt: 950000 is not allowed: below the 975000 µV of opps[1] at "
        "1800000000 Hz (1800 MHz) (voltage must not fall as frequency rises)"),
    "triple out of order": (
        "opps:\n  - {hz: 1800000000, microvolt: [850000, 900000, 1000000]}\n",
        "opps[0].microvolt: [850000, 900000, 1000000] is not allowed: expected [target, min, "
        "max] with min <= target <= max"),
    "entry not a mapping": (
        "opps:\n  - 1800000000\n",
        "opps[0]: expected a mapping with keys hz, microvolt, opp-suspend, turbo-mode, "
        "disabled, bins"),
    "unknown field": (
        "opps:\n  - {freq: 1800000000, microvolt: 850000}\n",
        "opps[0].freq: unknown key (allowed: hz, microvolt, opp-suspend, turbo-mode, "
        "disabled, bins)"),
    "malformed voltage": (
        "opps:\n  - {hz: 1800000000, microvolt: [850000, 900000]}\n",
        "opps[0].microvolt: [850000, 900000] is not allowed: expected a voltage in µV, or a "
        "[target, min, max] triple in µV"),
    "missing voltage": (
        "opps:\n  - {hz: 1800000000}\n",
        "opps[0]: missing microvolt (µV, or a [target, min, max] triple)"),
    "missing frequency": (
        "opps:\n  - {microvolt: 850000}\n", "opps[0]: missing hz (the frequency in Hz)"),
    "disabled point with a voltage": (
        "opps:\n  - {hz: 2400000000, disabled: true, microvolt: 1000000}\n",
        "opps[0].microvolt: a disabled operating point takes only hz"),
    "two suspend points": (
        "opps:\n  - {hz: 408000000, microvolt: 675000, opp-suspend: true}\n"
        "  - {hz: 600000000, microvolt: 675000, opp-suspend: true}\n",
        "opps[1].opp-suspend: opps[0] is already the suspend point (one per table)"),
    "no points": ("opps: []\n", "opps: no operating points: list at least one"),
}


@pytest.mark.parametrize("case", BAD_TABLES, ids=str)
def test_validation_names_the_bad_entry(case: str, tmp_path: Path) -> None:
    text, message = BAD_TABLES[case]
    (tmp_path / "bad.yaml").write_text(text)
    with pytest.raises(OverlayError) as caught:
        load_table(tmp_path / "bad.yaml", "rk3588", "mainline", "cpu-big0")
    assert str(caught.value) == f"{tmp_path / 'bad.yaml'}: {message}"


@pytest.mark.parametrize(("soc", "flavour", "target", "key", "message"), [
    ("rk3588", "mainline", "npu", "target", "'npu' is not allowed: rk3588 mainline kernels "
     "have no npu OPP table (it exists on: vendor)"),
    ("rk3588", "vendor", "cpu-mid", "target", "'cpu-mid' is not allowed: expected one of "
     "cpu-little, cpu-big0, cpu-big1, gpu, npu for rk3588"),
    ("rk3588", "bsp", "gpu", "flavour", "'bsp' is not allowed: expected one of vendor, "
     "mainline (the vendor BSP kernel or mainline)"),
    ("rk3399", "mainline", "gpu", "soc", "'rk3399' is not allowed: expected one of rk3588, "
     "tegra234"),
])
def test_unknown_target_for_the_soc_or_flavour_is_refused(
        soc: str, flavour: str, target: str, key: str, message: str, tmp_path: Path) -> None:
    (tmp_path / "t.yaml").write_text("opps:\n  - {hz: 800000000, microvolt: 750000}\n")
    with pytest.raises(OverlayError) as caught:
        load_table(tmp_path / "t.yaml", soc, flavour, target)
    assert (caught.value.key, caught.value.message) == (key, message)


def test_jetson_has_no_opp_tables_and_says_why(tmp_path: Path) -> None:
    (tmp_path / "t.yaml").write_text("opps:\n  - {hz: 800000000, microvolt: 750000}\n")
    with pytest.raises(OverlayError) as caught:
        load_table(tmp_path / "t.yaml", "tegra234", "mainline", "cpu-big0")
    assert caught.value.key == "soc"
    assert "BPMP firmware" in caught.value.message


def test_table_and_flags_must_agree(tmp_path: Path) -> None:
    (tmp_path / "t.yaml").write_text("target: gpu\nopps:\n  - {hz: 800000000, microvolt: "
                                     "750000}\n")
    with pytest.raises(OverlayError) as caught:
        load_table(tmp_path / "t.yaml", "rk3588", "mainline", "npu")
    assert str(caught.value) == (f"{tmp_path / 't.yaml'}: target: the table says 'gpu' but "
                                 "--target says 'npu'")


def test_vendor_points_above_the_bin_gate_are_warned_about(tmp_path: Path) -> None:
    (tmp_path / "t.yaml").write_text("opps:\n  - {hz: 2400000000, microvolt: 1000000}\n")
    vendor = load_table(tmp_path / "t.yaml", "rk3588", "vendor", "cpu-big1")
    mainline = load_table(tmp_path / "t.yaml", "rk3588", "mainline", "cpu-big1")
    assert vendor.warnings == ("opps[0]: 2400000000 Hz (2400 MHz) is bin-gated by "
                               "opp-supported-hw in the vendor rk3588 cpu-big1 table: on a chip "
                               "outside the bin it silently does not appear; check "
                               "scaling_available_frequencies after the reboot",)
    assert mainline.warnings == ()


def test_a_hand_written_overlay_is_held_to_the_same_limits(tmp_path: Path) -> None:
    source = ('/dts-v1/;\n/plugin/;\n/ { compatible = "rockchip,rk3588"; };\n'
              "&cluster1_opp_table {\n"
              "  opp-1800000000 { opp-hz = /bits/ 64 <1800000000>; "
              "opp-microvolt = <900000 900000 1000000>; };\n"
              "  opp-2208000000 { opp-hz = /bits/ 64 <2208000000>; "
              "opp-microvolt = <850000 850000 1000000>; };\n};\n")
    with pytest.raises(OverlayError) as caught:
        inspect(compile_dts(source, tmp_path).read_bytes(), "hand.dts")
    assert str(caught.value) == (
        "hand.dts: &cluster1_opp_table/opp-2208000000.microvolt: 850000 is not allowed: below "
        "the 900000 µV of &cluster1_opp_table/opp-1800000000 at 1800000000 Hz (1800 MHz) "
        "(voltage must not fall as frequency rises)")


def test_cli_validate_reports_the_entry_and_exits_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "t.yaml").write_text("opps:\n  - {hz: 3000000000, microvolt: 900000}\n")
    assert main(["overlay", "validate", "--table", str(tmp_path / "t.yaml"), "--soc", "rk3588",
                 "--flavour", "mainline", "--target", "cpu-little"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"edge-agent overlay validate: {tmp_path / 't.yaml'}: opps[0].hz: 3000000000 is not "
        "allowed: expected a frequency 408000000..1800000000 Hz for rk3588 cpu-little (above "
        "it needs --allow-overclock)")


# -- the stock table: undervolt margin, overclock, per-bin voltages ---------------------

def overlay_source(label: str, *nodes: str) -> str:
    return ('/dts-v1/;\n/plugin/;\n/ { compatible = "rockchip,rk3588"; };\n'
            f"&{label} {{\n" + "\n".join(nodes) + "\n};\n")


def point(hz: int, uv: int, ceiling: int, extra: str = "") -> str:
    return (f"opp-{hz} {{ opp-hz = /bits/ 64 <{hz}>; "
            f"opp-microvolt = <{uv} {uv} {ceiling}>; {extra}}};")


ASK = ("an undervolt needs its amount allowed: allow_undervolt_mv: in the table, "
       "edge-agent,allow-undervolt-microvolt in the overlay's root node, or --allow-undervolt MV")
HOSTILE = {
    "A76 2.4 GHz at 600 mV": (
        overlay_source("cluster1_opp_table", point(2400 * MHZ, 600000, 1000000)),
        "&cluster1_opp_table/opp-2400000000.microvolt: 600000 µV at 2400000000 Hz (2400 MHz) "
        "is not allowed: 400000 µV below the mainline cpu-big0 stock 1000000 µV at 2400 MHz, "
        "and no undervolt is allowed; " + ASK),
    "GPU 1 GHz at 550 mV": (
        overlay_source("gpu_opp_table", point(1000 * MHZ, 550000, 850000)),
        "&gpu_opp_table/opp-1000000000.microvolt: 550000 µV at 1000000000 Hz (1000 MHz) is "
        "not allowed: 300000 µV below the mainline gpu stock 850000 µV at 1000 MHz, and no "
        "undervolt is allowed; " + ASK),
    "A55 above its maximum": (
        overlay_source("cluster0_opp_table", point(2016 * MHZ, 950000, 950000)),
        "&cluster0_opp_table/opp-2016000000.hz: 2016000000 is not allowed: expected a "
        "frequency 408000000..1800000000 Hz for rk3588 cpu-little (above it needs "
        "--allow-overclock)"),
    "vendor bin far below its own stock": (
        overlay_source("cluster1_opp_table",
                       f"opp-{1800 * MHZ} {{ opp-hz = /bits/ 64 <{1800 * MHZ}>; "
                       "opp-microvolt = <850000 850000 1000000>, <850000 850000 1000000>; "
                       "opp-microvolt-L3 = <700000 700000 1000000>, "
                       "<700000 700000 1000000>; };"),
        "&cluster1_opp_table/opp-1800000000.bins.L3: 700000 µV at 1800000000 Hz (1800 MHz) is "
        "not allowed: 112500 µV below the vendor cpu-big0 stock 812500 µV of bin L3 at 1800 "
        "MHz, and no undervolt is allowed; " + ASK),
}


@pytest.mark.parametrize("case", HOSTILE, ids=str)
def test_a_severe_undervolt_or_overclock_is_refused_naming_node_and_stock(
        case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source, message = HOSTILE[case]
    (tmp_path / "hostile.dts").write_text(source)
    assert main(["overlay", "validate", str(tmp_path / "hostile.dts")]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == (f"edge-agent overlay validate: {tmp_path / 'hostile.dts'}: "
                                    f"{message}")
    assert "Traceback" not in captured.err and captured.out == ""


def test_allow_undervolt_raises_the_margin_and_the_result_says_so(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "uv.dts").write_text(HOSTILE["A76 2.4 GHz at 600 mV"][0])
    assert main(["overlay", "validate", str(tmp_path / "uv.dts"), "--allow-undervolt", "350"]
                ) == 2  # 400 mV below stock: still more than the 350 mV allowed
    assert "more than the 350000 µV allowed by --allow-undervolt" in capsys.readouterr().err
    assert main(["overlay", "validate", str(tmp_path / "uv.dts"), "--allow-undervolt", "400",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["limits"] == {"undervolt_margin_uv": 400000, "explicit": True,
                                "allow_overclock": False}
    assert report["warnings"] == [
        "&cluster1_opp_table/opp-2400000000.microvolt: 600000 µV at 2400 MHz is 400000 µV "
        "below the mainline cpu-big0 stock 1000000 µV at 2400 MHz: an undervolt, allowed by "
        "--allow-undervolt"]
    assert main(["overlay", "validate", str(tmp_path / "uv.dts"), "--allow-undervolt", "400"]
                ) == 0
    assert ("checked against the stock table: up to 400 mV below stock (--allow-undervolt)"
            in capsys.readouterr().out)


@pytest.mark.parametrize(("target", "flavour", "hz", "asked", "stock"), [
    ("cpu-big0", "mainline", 2400 * MHZ, 950000, 1000000),  # the A76 at 2.4 GHz, 50 mV under
    ("npu", "vendor", 1000 * MHZ, 800000, 850000)])         # the NPU at 1 GHz, 50 mV under
def test_any_undervolt_needs_its_amount_allowed(target: str, flavour: str, hz: int, asked: int,
                                                stock: int, tmp_path: Path) -> None:
    """Once built silently (a 50 mV default margin): now refused naming the point, the stock
    and the asked voltage, and built only with ``allow_undervolt_mv:`` saying the amount."""
    opps = f"opps:\n  - {{hz: {hz}, microvolt: {asked}}}\n"
    (tmp_path / "t.yaml").write_text(opps)
    with pytest.raises(OverlayError) as caught:
        load_table(tmp_path / "t.yaml", "rk3588", flavour, target)
    assert (caught.value.key, caught.value.message) == ("opps[0].microvolt", (
        f"{asked} µV at {hz} Hz ({hz // MHZ} MHz) is not allowed: {stock - asked} µV below the "
        f"{flavour} {target} stock {stock} µV at {hz // MHZ} MHz, and no undervolt is allowed; "
        + ASK))
    (tmp_path / "t.yaml").write_text("allow_undervolt_mv: 25\n" + opps)  # not enough
    with pytest.raises(OverlayError, match=r"more than the 25000 µV allowed by "
                       r"allow_undervolt_mv: 25 in "):
        load_table(tmp_path / "t.yaml", "rk3588", flavour, target)
    (tmp_path / "t.yaml").write_text("allow_undervolt_mv: 50\n" + opps)
    table = load_table(tmp_path / "t.yaml", "rk3588", flavour, target)
    assert table.limits == Limits(50000, False, True, f"allow_undervolt_mv: 50 in "
                                                      f"{tmp_path / 't.yaml'}")
    assert table.warnings[0] == (
        f"opps[0].microvolt: {asked} µV at {hz // MHZ} MHz is {stock - asked} µV below the "
        f"{flavour} {target} stock {stock} µV at {hz // MHZ} MHz: an undervolt, allowed by "
        f"allow_undervolt_mv: 50 in {tmp_path / 't.yaml'}")
    assert all("an undervolt, allowed by" in w for w in table.warnings)  # vendor: each bin


def test_an_overclock_needs_its_own_flag(tmp_path: Path) -> None:
    (tmp_path / "oc.yaml").write_text("opps:\n  - {hz: 2496000000, microvolt: 1000000}\n")
    for limits in (Limits(), Limits(margin_uv=400000, explicit=True)):  # undervolt: not enough
        with pytest.raises(OverlayError, match="above it needs --allow-overclock"):
            load_table(tmp_path / "oc.yaml", "rk3588", "mainline", "cpu-big0", limits)
    table = load_table(tmp_path / "oc.yaml", "rk3588", "mainline", "cpu-big0",
                       Limits(allow_overclock=True))
    assert [o.hz for o in table.opps] == [2496 * MHZ]
    assert table.warnings == (
        "opps[0]: 2496000000 Hz (2496 MHz) is above the rk3588 cpu-big0 maximum 2400000000 Hz "
        "(2400 MHz): an overclock, allowed by --allow-overclock; its voltage is measured from "
        "the top stock point",)
    (tmp_path / "oc-low.yaml").write_text("opps:\n  - {hz: 2496000000, microvolt: 900000}\n")
    with pytest.raises(OverlayError, match="100000 µV below the mainline cpu-big0 stock "
                                           "1000000 µV at 2400 MHz"):
        load_table(tmp_path / "oc-low.yaml", "rk3588", "mainline", "cpu-big0",
                   Limits(allow_overclock=True))


def test_a_frequency_between_stock_points_is_measured_from_the_next_higher_one(
        tmp_path: Path) -> None:
    # 1700 MHz lies between the A76's 1608 (762.5 mV) and 1800 (850 mV): interpolation would
    # allow 756.25 mV; the next-higher point allows 800 mV and no less
    (tmp_path / "ok.yaml").write_text("allow_undervolt_mv: 50\n"
                                      "opps:\n  - {hz: 1700000000, microvolt: 800000}\n")
    assert load_table(tmp_path / "ok.yaml", "rk3588", "mainline", "cpu-big1").opps[0].hz \
        == 1700 * MHZ
    (tmp_path / "low.yaml").write_text("allow_undervolt_mv: 50\n"
                                       "opps:\n  - {hz: 1700000000, microvolt: 787500}\n")
    with pytest.raises(OverlayError) as caught:
        load_table(tmp_path / "low.yaml", "rk3588", "mainline", "cpu-big1")
    assert caught.value.message == (
        "787500 µV at 1700000000 Hz (1700 MHz) is not allowed: 62500 µV below the mainline "
        "cpu-big1 stock 850000 µV at 1800 MHz, more than the 50000 µV allowed by "
        f"allow_undervolt_mv: 50 in {tmp_path / 'low.yaml'}; " + ASK)


def test_the_min_cell_is_what_is_held_to_the_margin(tmp_path: Path) -> None:
    """The regulator may go down to the min cell, so a safe target over a low min is refused."""
    (tmp_path / "t.yaml").write_text(
        "opps:\n  - {hz: 2208000000, microvolt: [987500, 900000, 1000000]}\n")
    with pytest.raises(OverlayError) as caught:
        load_table(tmp_path / "t.yaml", "rk3588", "mainline", "cpu-big0")
    assert caught.value.key == "opps[0].microvolt"
    assert caught.value.message.startswith("900000 µV at 2208000000 Hz")


@pytest.mark.parametrize("source", [p for p in SHIPPED if "rk3588" in p.name], ids=str)
def test_shipped_overlays_are_12_5_mv_below_stock_at_most(source: Path) -> None:
    """Each says its 12.5 mV undervolt itself; a tighter flag wins over it."""
    built = build.from_entry(source.stem)
    assert built.limits.margin_uv == 12500 and built.limits.source.startswith(
        "edge-agent,allow-undervolt-microvolt = <12500> in ")
    assert built.warnings and all("an undervolt, allowed by" in w for w in built.warnings)
    with pytest.raises(OverlayError, match="more than the 12000 µV allowed by "
                       "--allow-undervolt"):
        build.from_entry(source.stem, Limits.from_flags(12, False))


def test_vendor_bins_keep_their_own_stock_spread(tmp_path: Path) -> None:
    """A copy of the stock vendor 1800 MHz point passes although L7 is 87.5 mV below the
    nominal: each bin is measured from its own stock value."""
    bins = " ".join(f"opp-microvolt-L{n} = <{uv} {uv} 1000000>, <{uv} {uv} 1000000>;"
                    for n, uv in enumerate([850000, 837500, 825000, 812500, 800000, 787500,
                                            775000, 762500]))
    source = overlay_source("cluster1_opp_table",
                            f"opp-{1800 * MHZ} {{ opp-hz = /bits/ 64 <{1800 * MHZ}>; "
                            "opp-microvolt = <850000 850000 1000000>, "
                            f"<850000 850000 1000000>; {bins} }};")
    table = inspect(compile_dts(source, tmp_path).read_bytes(), "stock.dts").tables[0]
    assert table.flavour == "vendor"
    assert dict(table.opps[0].bins)["L7"] == (762500, 762500, 1000000)


def test_a_bin_given_in_the_table_is_kept_and_the_others_follow_the_stock_spread(
        tmp_path: Path) -> None:
    (tmp_path / "t.yaml").write_text(
        "allow_undervolt_mv: 25\n"
        "opps:\n  - {hz: 2016000000, microvolt: 912500, bins: {L6: [862500, 850000, "
        "1000000]}}\n")
    built = build.from_table(load_table(tmp_path / "t.yaml", "rk3588", "vendor", "cpu-big1"),
                             "t")
    (tmp_path / "t.dtbo").write_bytes(built.dtbo)
    found = points(decompile(tmp_path / "t.dtbo"), "/fragment@0/__overlay__")[2016 * MHZ]
    bins = found["bins"]
    assert isinstance(bins, dict)
    assert bins["opp-microvolt-L6"] == [862500, 850000, 1000000] * 2       # as given
    # one value is target = min = max, so the bins share the 912500 ceiling
    assert bins["opp-microvolt-L7"] == [825000, 825000, 912500] * 2        # 837500 - 12500
    assert bins["opp-microvolt-L0"] == [912500] * 6                        # no stock L0
    assert found["microvolt"] == [912500] * 6


@pytest.mark.parametrize(("entry", "flavour", "message"), [
    ("{hz: 1800000000, microvolt: 850000, bins: {L9: 850000}}", "vendor",
     "opps[0].bins.L9: is not allowed: expected one of L0, L1, L2, L3, L4, L5, L6, L7"),
    ("{hz: 1800000000, microvolt: 850000, bins: {L1: 850000}}", "mainline",
     "opps[0].bins.L1: is not allowed: mainline kernels have no per-bin voltages"),
    ("{hz: 1800000000, microvolt: 850000, bins: {L1: 700000}}", "vendor",
     "opps[0].bins.L1: 700000 µV at 1800000000 Hz (1800 MHz) is not allowed: 137500 µV below "
     "the vendor cpu-big0 stock 837500 µV of bin L1 at 1800 MHz, and no undervolt is "
     "allowed; an undervolt needs its amount allowed: allow_undervolt_mv: in the table, "
     "edge-agent,allow-undervolt-microvolt in the overlay's root node, or --allow-undervolt "
     "MV"),
])
def test_bad_per_bin_voltages_name_the_bin(entry: str, flavour: str, message: str,
                                           tmp_path: Path) -> None:
    (tmp_path / "t.yaml").write_text(f"opps:\n  - {entry}\n")
    with pytest.raises(OverlayError) as caught:
        load_table(tmp_path / "t.yaml", "rk3588", flavour, "cpu-big0")
    assert str(caught.value) == f"{tmp_path / 't.yaml'}: {message}"


def test_missing_dtc_is_named_with_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(DtcMissing, match="device-tree-compiler"):
        build.from_entry("rk3588-mainline-gpu-capped")


def test_discover_does_not_load_the_overlay_tools() -> None:
    assert modules_loaded_by("from agent.cli import main; main(['discover', '--json'])",
                             "agent.overlay") == []


# -- the installer ------------------------------------------------------------------------

ARMBIAN_ENV = """\
verbosity=1
bootlogo=false
console=both
overlay_prefix=rockchip-rk3588
fdtfile=rockchip/rk3588-rock-5b.dtb
rootdev=UUID=0b7cc0ef-5d6e-4e5b-9c7a-1e2f3a4b5c6d
rootfstype=ext4
overlays=panthor-gpu
usbstoragequirks=0x2537:0x1066:u,0x2537:0x1068:u
"""
RADXA_EXTLINUX = """\
## /boot/extlinux/extlinux.conf
##
## IMPORTANT WARNING
##
## The configuration of this file is generated automatically.
## Do not edit this file manually, use: u-boot-update

default l0
menu title U-Boot menu
prompt 1
timeout 10


label l0
\tmenu label Debian GNU/Linux 12 (bookworm) 6.1.84-1-rk2410
\tlinux /boot/vmlinuz-6.1.84-1-rk2410
\tinitrd /boot/initrd.img-6.1.84-1-rk2410
\tfdtdir /usr/lib/linux-image-6.1.84-1-rk2410/
\tfdtoverlays  /boot/dtbo/rk3588-uart7-m2.dtbo
\t
\tappend root=UUID=2f1e3d4c rw console=ttyFIQ0,1500000n8 quiet splash

label l0r
\tmenu label Debian GNU/Linux 12 (bookworm) 6.1.84-1-rk2410 (rescue target)
\tlinux /boot/vmlinuz-6.1.84-1-rk2410
\tinitrd /boot/initrd.img-6.1.84-1-rk2410
\tfdtdir /usr/lib/linux-image-6.1.84-1-rk2410/
\t
\tappend root=UUID=2f1e3d4c rw console=ttyFIQ0,1500000n8 single
"""
JETSON_EXTLINUX = """\
TIMEOUT 30
DEFAULT primary

MENU TITLE L4T boot options

LABEL primary
      MENU LABEL primary kernel
      LINUX /boot/Image
      FDT /boot/dtb/kernel_tegra234-p3768-0000+p3767-0005-nv.dtb
      INITRD /boot/initrd
      APPEND ${cbootargs} root=PARTUUID=1b2c3d4e rw rootwait rootfstype=ext4

# When testing a custom kernel, it is recommended that you create a backup of
# the original kernel and add a new entry to this file so that the device can
# fallback to the original kernel.
"""
JETSON_RELEASE = "# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic, EABI: aarch64\n"

RK3588 = "radxa,rock-5b\0rockchip,rk3588\0"
TEGRA = "nvidia,p3768-0000+p3767-0005\0nvidia,p3767-0005\0nvidia,tegra234\0"
MAINLINE_SYMBOLS = {"cluster1_opp_table": "/opp-table-cluster1",
                    "gpu_opp_table": "/gpu@fb000000/opp-table"}
VENDOR_SYMBOLS = {"cluster1_opp_table": "/cluster1-opp-table", "npu_opp_table": "/npu-opp-table"}


def board(root: Path, files: dict[str, str], compatible: str,
          symbols: dict[str, str] | None = None, nodes: tuple[str, ...] = ()) -> Path:
    """A fake root: boot files, and a running device tree with compatible and __symbols__."""
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    dt = root / "proc/device-tree"
    dt.mkdir(parents=True)
    (dt / "compatible").write_text(compatible)
    if symbols is not None:
        (dt / "__symbols__").mkdir()
        for label, path in symbols.items():
            (dt / "__symbols__" / label).write_text(path + "\0")
    for node in nodes:
        (dt / node.lstrip("/")).mkdir(parents=True)
    return root


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file below /boot and /etc, byte for byte (temp files included, were any left)."""
    return {str(p.relative_to(root)): p.read_bytes() for top in ("boot", "etc")
            for p in sorted((root / top).rglob("*")) if p.is_file()}


def armbian(root: Path) -> Path:
    return board(root, {"boot/armbianEnv.txt": ARMBIAN_ENV}, RK3588, MAINLINE_SYMBOLS)


def radxa(root: Path) -> Path:
    return board(root, {"boot/extlinux/extlinux.conf": RADXA_EXTLINUX,
                        "boot/dtbo/rk3588-uart7-m2.dtbo": "stock overlay",
                        "etc/default/u-boot": 'U_BOOT_FDT_OVERLAYS_DIR="/boot/dtbo/"\n'},
                 RK3588, VENDOR_SYMBOLS)


def jetson(root: Path, extlinux: str = JETSON_EXTLINUX, release: str = JETSON_RELEASE) -> Path:
    return board(root, {"boot/extlinux/extlinux.conf": extlinux,
                        "etc/nv_tegra_release": release}, TEGRA, {},
                 ("/thermal-zones/cpu-thermal",))


ARMBIAN_AFTER = ARMBIAN_ENV + "user_overlays=rk3588-mainline-cpu-big0-capped\n"
RADXA_AFTER = RADXA_EXTLINUX.replace("default l0\n", "default edge-agent\n").replace(
    "\nlabel l0\n", """
# edge-agent overlays: a copy of LABEL l0; removing the last one restores DEFAULT l0
label edge-agent
\tmenu label Debian GNU/Linux 12 (bookworm) 6.1.84-1-rk2410 + edge-agent overlays
\tlinux /boot/vmlinuz-6.1.84-1-rk2410
\tinitrd /boot/initrd.img-6.1.84-1-rk2410
\tfdtdir /usr/lib/linux-image-6.1.84-1-rk2410/
\tfdtoverlays  /boot/dtbo/rk3588-uart7-m2.dtbo /boot/dtbo/rk3588-vendor-npu-capped.dtbo
\t
\tappend root=UUID=2f1e3d4c rw console=ttyFIQ0,1500000n8 quiet splash

label l0
""")
JETSON_AFTER = JETSON_EXTLINUX.replace("DEFAULT primary", "DEFAULT edge-agent").replace(
    "\nLABEL primary\n", """
# edge-agent overlays: a copy of LABEL primary; removing the last one restores DEFAULT primary
LABEL edge-agent
      MENU LABEL primary kernel + edge-agent overlays
      LINUX /boot/Image
      FDT /boot/dtb/kernel_tegra234-p3768-0000+p3767-0005-nv.dtb
      OVERLAYS /boot/jetson-orin-cpu-alert.dtbo
      INITRD /boot/initrd
      APPEND ${cbootargs} root=PARTUUID=1b2c3d4e rw rootwait rootfstype=ext4

LABEL primary
""")

LAYOUTS = {
    "armbian": (armbian, "rk3588-mainline-cpu-big0-capped", "boot/armbianEnv.txt",
                ARMBIAN_AFTER, "boot/overlay-user/rk3588-mainline-cpu-big0-capped.dtbo"),
    "radxa-extlinux": (radxa, "rk3588-vendor-npu-capped", "boot/extlinux/extlinux.conf",
                       RADXA_AFTER, "boot/dtbo/rk3588-vendor-npu-capped.dtbo"),
    "jetson-extlinux": (jetson, "jetson-orin-cpu-alert", "boot/extlinux/extlinux.conf",
                        JETSON_AFTER, "boot/jetson-orin-cpu-alert.dtbo"),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_install_is_idempotent_and_remove_restores_byte_for_byte(
        layout: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make, name, config, after, dtbo = LAYOUTS[layout]
    root = make(tmp_path)
    before = snapshot(root)

    assert main(["overlay", "install", name, "--root", str(root), "--no-fallback"]) == 0
    out = capsys.readouterr().out
    assert "reboot to apply it: edge-agent never reboots the board" in out
    assert (root / config).read_text() == after
    assert (root / dtbo).read_bytes() == build.from_entry(name).dtbo
    assert (root / f"{config}.edge-agent-{name}.bak").read_bytes() == before[config]
    installed = snapshot(root)
    assert set(installed) - set(before) == {dtbo, f"{config}.edge-agent-{name}.bak"}

    assert main(["overlay", "install", name, "--root", str(root), "--no-fallback"]) == 0
    assert f"{name} is already installed: nothing changed" in capsys.readouterr().out
    assert snapshot(root) == installed

    assert main(["overlay", "list", "--root", str(root)]) == 0
    listing = capsys.readouterr().out
    assert re.search(rf"^  \* {re.escape(name)} +/{re.escape(dtbo)}$", listing, re.MULTILINE)

    assert main(["overlay", "remove", name, "--root", str(root)]) == 0
    assert "reboot to apply it" in capsys.readouterr().out
    assert snapshot(root) == before


@pytest.mark.parametrize("layout", ["radxa-extlinux", "jetson-extlinux", "armbian"])
def test_two_overlays_removed_out_of_order_restore_the_original(
        layout: str, tmp_path: Path) -> None:
    make, name, config, _, _ = LAYOUTS[layout]
    root = Root(make(tmp_path))
    before = snapshot(tmp_path)
    first = build.from_entry(name)
    second = build.Built("extra", first.source, first.dtbo, first.overlay, [])
    installer.install(root, first, fallback=False)
    installer.install(root, second, fallback=False)
    text = (tmp_path / config).read_text()
    assert text.count("extra") == 1 and text.count(name) == 1
    installer.remove(root, name)
    assert name not in (tmp_path / config).read_text()
    installer.remove(root, "extra")
    assert snapshot(tmp_path) == before


def test_armbian_appends_to_an_existing_user_overlays_line(tmp_path: Path) -> None:
    env = ARMBIAN_ENV + "user_overlays=fan-control\n"
    root = Root(board(tmp_path, {"boot/armbianEnv.txt": env}, RK3588, MAINLINE_SYMBOLS))
    installer.install(root, build.from_entry("rk3588-mainline-gpu-capped"), fallback=False)
    assert (tmp_path / "boot/armbianEnv.txt").read_text().endswith(
        "user_overlays=fan-control rk3588-mainline-gpu-capped\n")
    layout, items = installer.listed(root)
    assert layout.kind == "armbian"
    assert [(i["name"], i["edge_agent"], i["present"]) for i in items] == [
        ("fan-control", False, False), ("rk3588-mainline-gpu-capped", True, True),
        ("panthor-gpu", False, False)]
    assert items[2]["path"] == "/boot/dtb/rockchip/overlay/rockchip-rk3588-panthor-gpu.dtbo"


def test_jetson_entry_without_fdt_gets_the_one_dtb_in_the_copy(tmp_path: Path) -> None:
    fdt = "      FDT /boot/dtb/kernel_tegra234-p3768-0000+p3767-0005-nv.dtb\n"
    stock = JETSON_EXTLINUX.replace(fdt, "")
    root = jetson(tmp_path, stock)
    with pytest.raises(InstallRefused, match="LABEL primary has no FDT line"):
        installer.install(Root(root), build.from_entry("jetson-orin-cpu-alert"))
    assert (root / "boot/extlinux/extlinux.conf").read_text() == stock
    (root / "boot/dtb").mkdir()
    (root / "boot/dtb/kernel_tegra234-p3768-0000+p3767-0005-nv.dtb").write_text("dtb")
    installer.install(Root(root), build.from_entry("jetson-orin-cpu-alert"))
    # the copy names the DTB; the original entry stays as it was
    assert (root / "boot/extlinux/extlinux.conf").read_text() == JETSON_AFTER.replace(
        fdt + "      INITRD", "      INITRD")


def test_jetpack_5_is_refused(tmp_path: Path) -> None:
    root = jetson(tmp_path, release="# R35 (release), REVISION: 5.0, GCID: 1, BOARD: t186ref\n")
    with pytest.raises(InstallRefused, match=r"L4T R35\.5\.0: extlinux OVERLAYS arrived with "
                       r"R36\.2"):
        installer.install(Root(root), build.from_entry("jetson-orin-cpu-alert"))


def test_unknown_boot_layout_is_refused_with_a_clear_message(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = board(tmp_path, {"boot/boot.scr": "script"}, RK3588, MAINLINE_SYMBOLS)
    before = snapshot(root)
    assert main(["overlay", "install", "rk3588-mainline-gpu-capped", "--root", str(root),
                 "--no-fallback"]) == 1
    assert capsys.readouterr().err.strip() == (
        f"edge-agent overlay install: unrecognised boot layout below {root}: expected "
        "/boot/armbianEnv.txt (Armbian) or /boot/extlinux/extlinux.conf (U-Boot extlinux, or "
        "Jetson JetPack 6+); nothing was changed")
    assert snapshot(root) == before


def test_both_layouts_at_once_are_refused(tmp_path: Path) -> None:
    root = board(tmp_path, {"boot/armbianEnv.txt": ARMBIAN_ENV,
                            "boot/extlinux/extlinux.conf": RADXA_EXTLINUX}, RK3588,
                 MAINLINE_SYMBOLS)
    with pytest.raises(InstallRefused, match="which one the boot loader reads is unknown"):
        installer.install(Root(root), build.from_entry("rk3588-mainline-gpu-capped"),
                          fallback=False)


@pytest.mark.parametrize(("compatible", "symbols", "message"), [
    (TEGRA, MAINLINE_SYMBOLS, "rk3588-mainline-gpu-capped is for rockchip,rk3588, "
     "rockchip,rk3588s; this board is nvidia,p3768-0000+p3767-0005, nvidia,p3767-0005, "
     "nvidia,tegra234"),
    (RK3588, None, "rk3588-mainline-gpu-capped targets labels (gpu_opp_table) but the running "
     "device tree has no __symbols__: the base DTB was not built with dtc -@, so they cannot "
     "resolve"),
    (RK3588, {"cluster1_opp_table": "/opp-table-cluster1"}, "rk3588-mainline-gpu-capped "
     "targets gpu_opp_table, which the running device tree does not have"),
    (RK3588, {"gpu_opp_table": "/gpu-opp-table"}, "rk3588-mainline-gpu-capped is for "
     "mainline kernels, but &gpu_opp_table is /gpu-opp-table here: a vendor kernel"),
])
def test_the_running_device_tree_must_take_the_overlay(
        compatible: str, symbols: dict[str, str] | None, message: str, tmp_path: Path) -> None:
    root = board(tmp_path, {"boot/armbianEnv.txt": ARMBIAN_ENV}, compatible, symbols)
    before = snapshot(root)
    with pytest.raises(InstallRefused) as caught:
        installer.install(Root(root), build.from_entry("rk3588-mainline-gpu-capped"),
                          fallback=False)
    assert str(caught.value).startswith(message)
    assert snapshot(root) == before


def test_a_boot_config_linked_out_of_boot_is_refused(tmp_path: Path) -> None:
    root = board(tmp_path, {"etc/armbianEnv.txt": ARMBIAN_ENV}, RK3588, MAINLINE_SYMBOLS)
    (root / "boot").mkdir()
    (root / "boot/armbianEnv.txt").symlink_to("/etc/armbianEnv.txt")
    with pytest.raises(OSError, match=r"boot/armbianEnv\.txt: a link to "
                       r"/etc/armbianEnv\.txt, which leaves /boot"):
        installer.install(Root(root), build.from_entry("rk3588-mainline-gpu-capped"),
                          fallback=False)
    assert (root / "etc/armbianEnv.txt").read_text() == ARMBIAN_ENV
    assert not (root / "boot/overlay-user").exists()


def test_a_foreign_dtbo_of_the_same_name_is_not_overwritten(tmp_path: Path) -> None:
    root = armbian(tmp_path)
    (root / "boot/overlay-user").mkdir()
    (root / "boot/overlay-user/rk3588-mainline-gpu-capped.dtbo").write_text("someone else's")
    with pytest.raises(InstallRefused, match="was not installed by edge-agent"):
        installer.install(Root(root), build.from_entry("rk3588-mainline-gpu-capped"),
                          fallback=False)
    assert (root / "boot/armbianEnv.txt").read_text() == ARMBIAN_ENV


def test_remove_refuses_what_edge_agent_did_not_install(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = radxa(tmp_path)
    assert main(["overlay", "remove", "rk3588-uart7-m2", "--root", str(root)]) == 1
    assert "rk3588-uart7-m2 was not installed by edge-agent" in capsys.readouterr().err
    assert (root / "boot/extlinux/extlinux.conf").read_text() == RADXA_EXTLINUX


def test_remove_after_u_boot_update_rewrote_the_config(tmp_path: Path) -> None:
    """Radxa regenerates extlinux.conf from the overlay directory: the copy is gone."""
    root = radxa(tmp_path)
    installer.install(Root(root), build.from_entry("rk3588-vendor-npu-capped"),
                      fallback=False)
    regenerated = RADXA_EXTLINUX.replace(
        "rk3588-uart7-m2.dtbo\n", "rk3588-uart7-m2.dtbo /boot/dtbo/rk3588-vendor-npu-capped.dtbo\n")
    (root / "boot/extlinux/extlinux.conf").write_text(regenerated)
    installer.remove(Root(root), "rk3588-vendor-npu-capped")
    assert (root / "boot/extlinux/extlinux.conf").read_text() == RADXA_EXTLINUX
    assert not (root / "boot/dtbo/rk3588-vendor-npu-capped.dtbo").exists()


def test_install_the_overlay_a_profile_names(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = armbian(tmp_path)
    (root / "etc/edge-agent/profiles").mkdir(parents=True)
    (root / "etc/edge-agent/profiles/site-gpu.yaml").write_text(
        "match: {soc: rk3588}\noverlay: {dvfs: rk3588-mainline-gpu-capped}\n")
    assert main(["overlay", "install", "--profile", "site-gpu", "--root", str(root),
                 "--no-fallback"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        "rk3588-mainline-gpu-capped: /boot/overlay-user/rk3588-mainline-gpu-capped.dtbo, "
        "registered in /boot/armbianEnv.txt (armbian)")
    assert (root / "boot/armbianEnv.txt").read_text() == (
        ARMBIAN_ENV + "user_overlays=rk3588-mainline-gpu-capped\n")


def test_remove_restores_the_backup_where_undoing_the_edit_would_differ(tmp_path: Path) -> None:
    """An empty user_overlays= line: taking the name out again would drop the whole line."""
    env = ARMBIAN_ENV + "user_overlays=\n"
    root = Root(board(tmp_path, {"boot/armbianEnv.txt": env}, RK3588, MAINLINE_SYMBOLS))
    installer.install(root, build.from_entry("rk3588-mainline-gpu-capped"), fallback=False)
    assert (tmp_path / "boot/armbianEnv.txt").read_text() == (
        ARMBIAN_ENV + "user_overlays=rk3588-mainline-gpu-capped\n")
    installer.remove(root, "rk3588-mainline-gpu-capped")
    assert (tmp_path / "boot/armbianEnv.txt").read_text() == env


def test_cli_install_and_remove_json_name_every_file_they_changed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    name = "rk3588-mainline-cpu-big0-capped"
    root = armbian(tmp_path)
    before = snapshot(root)
    dtbo, config = f"/boot/overlay-user/{name}.dtbo", "/boot/armbianEnv.txt"
    backup = f"{config}.edge-agent-{name}.bak"
    common = {"name": name, "layout": "armbian", "config": config, "dtbo": dtbo,
              "backup": backup, "warnings": []}
    undervolts = build.from_entry(name).warnings  # the shipped 12.5 mV, said, not silent
    assert len(undervolts) == 5
    undervolts.append(f"{name} undervolts (" + ", ".join(
        f"&cluster1_opp_table {mhz} MHz" for mhz in (1416, 1608, 1800, 2016, 2208))
        + ") and is installed without a try-once boot (--no-fallback): a board that does not "
        "boot needs the previous entry chosen at the console")

    assert main(["overlay", "install", name, "--root", str(root), "--no-fallback",
                 "--json"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert json.loads(out) == {**common, "warnings": undervolts, "reboot_needed": True,
                               "result": installer.REBOOT,
                               "changed": [{"path": dtbo, "action": "created"},
                                           {"path": config, "action": "updated"},
                                           {"path": backup, "action": "created"}]}
    assert main(["overlay", "install", name, "--root", str(root), "--no-fallback",
                 "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert (again["changed"], again["reboot_needed"]) == ([], False)

    assert main(["overlay", "remove", name, "--root", str(root), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {
        **common, "reboot_needed": True, "result": installer.REBOOT,
        "changed": [{"path": dtbo, "action": "removed"}, {"path": config, "action": "updated"},
                    {"path": backup, "action": "removed"}]}
    assert snapshot(root) == before


def test_cli_build_json_reports_the_file_it_wrote(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "gpu.dtbo"
    assert main(["overlay", "build", "rk3588-mainline-gpu-capped", "--out", str(out),
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["out"] == str(out) and report["format"] == "dtbo"
    assert report["bytes"] == out.stat().st_size > 0
    assert out.read_bytes() == build.from_entry("rk3588-mainline-gpu-capped").dtbo
    assert [(t["soc"], t["target"], t["label"]) for t in report["tables"]] == [
        ("rk3588", "gpu", "gpu_opp_table")]
    assert report["warnings"] == build.from_entry("rk3588-mainline-gpu-capped").warnings
    assert "source" not in report

    assert main(["overlay", "build", "rk3588-mainline-gpu-capped", "--dts", "--json"]) == 0
    source = json.loads(capsys.readouterr().out)
    assert source["out"] is None and source["format"] == "dts"
    assert source["source"] == build.from_entry("rk3588-mainline-gpu-capped").source
    assert source["bytes"] == len(source["source"].encode())
