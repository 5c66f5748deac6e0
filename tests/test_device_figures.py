"""The device's figures for the QoS controller (agent.telemetry.device): utilisation over the
window, each policy's frequency, throttling (a passed trip point, a clipped maximum), the
hottest zone, as the fixture trees hold them."""

from __future__ import annotations

from pathlib import Path

from tuning_helpers import FIXTURES, copy_board

from agent.discovery import discover
from agent.kernel.fsroot import Root
from agent.kernel.reader import SysReader
from agent.telemetry.device import DeviceWindow, read_trips

RK = "rk3588-vendor"
ZONE0 = "sys/devices/virtual/thermal/thermal_zone0"
STAT = ("cpu  1794328 11232 585596 30964300 10932 0 20076 0 0 0\n"  # +100 user +300 idle
        "intr 0\n")


def window(tree: Path, **kwargs: dict[str, int]) -> DeviceWindow:
    root = Root(tree)
    return DeviceWindow(SysReader(root), discover(root), **kwargs)


def test_figures_of_the_rk3588_fixture(tmp_path: Path) -> None:
    tree = copy_board(RK, tmp_path)
    device = window(tree)
    first = device.figures()
    assert first.util_pct is None  # no window yet
    assert first.cur_khz == {"policy0": 408000, "policy4": 1800000, "policy6": 408000}
    assert first.hottest_c == 42.153  # bigcore0-thermal
    assert (first.max_clipped_khz, first.trips_passed, first.throttled) == ({}, [], False)
    (tree / "proc/stat").write_text(STAT)
    assert device.figures().util_pct == 25.0


def test_a_passed_trip_point_is_throttling(tmp_path: Path) -> None:
    tree = copy_board(RK, tmp_path)
    (tree / ZONE0 / "trip_point_0_type").write_text("passive\n")
    (tree / ZONE0 / "trip_point_0_temp").write_text("40000\n")
    (tree / ZONE0 / "trip_point_1_type").write_text("active\n")  # a fan, not a clock cap
    (tree / ZONE0 / "trip_point_1_temp").write_text("30000\n")
    (tree / ZONE0 / "trip_point_2_type").write_text("critical\n")
    (tree / ZONE0 / "trip_point_2_temp").write_text("115000\n")
    figures = window(tree).figures()
    assert figures.trips_passed == ["gpu-thermal trip 0 (passive, 40 °C) at 40.615 °C"]
    assert figures.throttled


def test_a_maximum_below_the_expected_one_is_throttling(tmp_path: Path) -> None:
    tree = copy_board(RK, tmp_path)
    Root(tree).write_text("/sys/devices/system/cpu/cpufreq/policy4/scaling_max_freq",
                          "1800000")
    assert window(tree).figures().max_clipped_khz == {"policy4": 1800000}
    expected = window(tree, expected_max_khz={"policy4": 1800000}).figures()
    assert (expected.max_clipped_khz, expected.throttled) == ({}, False)  # the profile's


def test_unset_trip_points_at_0_are_not_passed() -> None:
    root = Root(FIXTURES / "x86-server-nvidia")
    reader = SysReader(root)
    topology = discover(root)
    assert [(t.zone, t.type, t.temp_c) for z in topology.thermal
            for t in read_trips(reader, z.zone)] == [("thermal_zone1", "critical", 105.0)]
    assert DeviceWindow(reader, topology).figures().trips_passed == []
