"""Telemetry collectors on the board fixture trees: exact numbers from the files, rates from
two samples over an injected clock, None for absent or garbage sources, and a sanity check
on this machine's real root.

Rate tests copy a board to tmp_path and rewrite its counter files between two samples; the
committed trees are never written.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from functools import cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from tuning_helpers import copy_board

from agent.discovery import Topology, discover
from agent.kernel import counters as p
from agent.kernel.fsroot import Root
from agent.kernel.parsers import parse_psi
from agent.kernel.reader import SysReader
from agent.telemetry.backends import instance_backends
from agent.telemetry.collectors import (
    NvmlGpuSample,
    PynvmlTelemetry,
    build_collectors,
)
from agent.telemetry.collectors.block import BlockCollector
from agent.telemetry.collectors.cgroup import CgroupCollector
from agent.telemetry.collectors.cpu import CpuCollector
from agent.telemetry.collectors.fans import FanCollector
from agent.telemetry.collectors.gpu import GpuCollector, parse_permille_load
from agent.telemetry.collectors.load import LoadCollector
from agent.telemetry.collectors.memory import MemoryCollector, SwapCollector
from agent.telemetry.collectors.net import NetCollector
from agent.telemetry.collectors.npu import NpuCollector
from agent.telemetry.collectors.nvml import decode_clock_reasons
from agent.telemetry.collectors.power import PowerCollector
from agent.telemetry.collectors.psi import PsiCollector
from agent.telemetry.collectors.thermal import ThermalCollector
from agent.telemetry.collectors.thp import ThpCollector

FIXTURES = Path(__file__).resolve().parent / "fixtures"
BOARDS = sorted(d.name for d in FIXTURES.iterdir() if d.is_dir() and d.name[0] not in "_.")
AGX, NANO, VENDOR, MAINLINE = ("jetson-agx-orin-jp6", "jetson-orin-nano-jp6", "rk3588-vendor",
                               "rk3588-mainline")
SERVER, EDGE, VM = "x86-server-nvidia", "x86-edge-npu", "bare-vm"
KEYS = ["cpu", "load", "memory", "swap", "psi", "cgroup", "thermal", "power", "fans", "gpus",
        "npus", "block", "net", "thp"]


@cache
def topology(board: str) -> Topology:
    return discover(Root(FIXTURES / board))


def reader(board: str) -> SysReader:
    return SysReader(Root(FIXTURES / board))


def write(tree: Path, path: str, text: str) -> None:
    (tree / path.lstrip("/")).write_text(text)


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# -- parsers -------------------------------------------------------------------------------

def test_proc_stat_counts_iowait_as_idle_and_steal_as_busy() -> None:
    stat = p.parse_proc_stat(
        "cpu  300 0 100 550 50 0 0 0 40 0\n"
        "cpu0 200 0 50 200 50 0 0 0 40 0\n"  # guest 40 is already inside user
        "cpu3 100 0 50 350 0 0 0 25\n"
        "intr 12 0 3\nctxt 99\n")
    assert stat.total == p.CpuTicks(busy=400, total=1000)
    assert stat.cores == {0: p.CpuTicks(250, 500), 3: p.CpuTicks(175, 525)}


def test_proc_stat_old_four_column_kernel_line() -> None:
    assert p.parse_proc_stat("cpu 10 0 5 85\n").total == p.CpuTicks(15, 100)


@pytest.mark.parametrize("garbage", ["", "intr 1 2\n", "cpu  1 2\n", "cpu  a b c d\n",
                                     "cpu  1 2 3 4\ncpuX 1 2 3 4\n"])
def test_proc_stat_garbage(garbage: str) -> None:
    with pytest.raises(ValueError):
        p.parse_proc_stat(garbage)


def test_loadavg() -> None:
    assert p.parse_loadavg("0.52 0.58 0.59 2/1017 12345\n") == (0.52, 0.58, 0.59, 2, 1017)
    for garbage in ("0.52 0.58 0.59\n", "a b c 1/2 3\n", "0.1 0.2 0.3 12 4\n"):
        with pytest.raises(ValueError):
            p.parse_loadavg(garbage)


def test_psi_some_and_full_lines() -> None:
    psi = parse_psi("some avg10=1.25 avg60=0.50 avg300=0.10 total=123456\n"
                      "full avg10=0.75 avg60=0.25 avg300=0.05 total=654\n")
    assert psi["some"] == {"avg10": 1.25, "avg60": 0.5, "avg300": 0.1, "total": 123456.0}
    assert psi["full"]["avg10"] == 0.75
    assert parse_psi("full avg10=0.00 avg60=0.00 avg300=0.00 total=48213\n") == {
        "full": {"avg10": 0.0, "avg60": 0.0, "avg300": 0.0, "total": 48213.0}}  # irq file
    for garbage in ("", "some avg10\n", "some avg10=x\n", "half avg10=1.0\n", "\n"):
        with pytest.raises(ValueError):
            parse_psi(garbage)


def test_cgroup_path_is_the_v2_line() -> None:
    assert p.parse_cgroup_path("0::/system.slice/edge-agent.service\n") == \
        "/system.slice/edge-agent.service"
    hybrid = "3:memory:/system.slice/a.service\n1:name=systemd:/x\n0::/user.slice\n"
    assert p.parse_cgroup_path(hybrid) == "/user.slice"
    for v1_only in ("4:memory:/process_api/ff5b\n1:cpu:/\n", "", "garbage"):
        with pytest.raises(ValueError, match="no cgroup v2"):
            p.parse_cgroup_path(v1_only)


def test_cgroup_limit() -> None:
    assert p.parse_cgroup_limit("max\n") is None
    assert p.parse_cgroup_limit("3221225472\n") == 3221225472
    with pytest.raises(ValueError):
        p.parse_cgroup_limit("3G\n")


def test_diskstats_17_and_11_counter_lines() -> None:
    disks = p.parse_diskstats(
        " 259       0 nvme0n1 182311 20256 24193880 45577 93127 31042 18203320 46563 0 "
        "301122 92140 1862 0 14896 186 4656 931\n"
        "   8       0 sda 10 0 80 5 20 0 160 9 0 14 14\n")
    assert disks == {"nvme0n1": p.DiskCounters(24193880, 18203320, 301122),
                     "sda": p.DiskCounters(80, 160, 14)}
    for garbage in ("   8 0 sda 1 2 3\n", "   8 0 sda a b c d e f g h i j k\n"):
        with pytest.raises(ValueError):
            p.parse_diskstats(garbage)


NET_HEADER = (
    "Inter-|   Receive                                                |  Transmit\n"
    " face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets "
    "errs drop fifo colls carrier compressed\n")


def test_net_dev_with_a_name_wider_than_the_column() -> None:
    text = NET_HEADER + (
        "    lo:    6438      59    0    0    0     0          0         0     6438      59"
        "    0    0    0     0       0          0\n"
        "enp49s0f0np0: 98712330441 81223304   12  211    0     0          0     90233 "
        "61200223410 52112330    1    0    0     0       0          0\n")
    assert p.parse_net_dev(text) == {"lo": p.NetCounters(6438, 6438, 0, 0),
                                     "enp49s0f0np0": p.NetCounters(98712330441, 61200223410,
                                                                   12, 1)}
    for garbage in (NET_HEADER + "eth0 1 2 3\n", NET_HEADER + "eth0: 1 2 3\n"):
        with pytest.raises(ValueError):
            p.parse_net_dev(garbage)


def test_thp_counters_are_the_thp_lines_only() -> None:
    text = "nr_free_pages 12\nthp_fault_alloc 133\nthp_split_pud 0\npgfault 9\nthp_bad x\n"
    assert p.parse_thp_counters(text) == {"thp_fault_alloc": 133, "thp_split_pud": 0}
    assert p.parse_thp_counters("") == {}


def test_jetson_permille_load() -> None:
    assert parse_permille_load("125\n") == (12.5, None)
    with pytest.raises(ValueError):
        parse_permille_load("12%\n")


def test_clock_event_reasons_decoded_to_names() -> None:
    assert decode_clock_reasons(0) == []
    assert decode_clock_reasons(0x24) == ["sw_power_cap", "sw_thermal_slowdown"]
    assert decode_clock_reasons(0x1 | 0x400) == ["gpu_idle", "0x400"]


# -- every board ---------------------------------------------------------------------------

@pytest.mark.parametrize("board", BOARDS)
def test_every_collector_on_every_board_is_json(board: str) -> None:
    collectors = build_collectors(Root(FIXTURES / board), topology(board))
    assert [c.key for c in collectors] == KEYS
    for _ in range(2):
        metrics = {c.key: c.collect() for c in collectors}
    assert json.loads(json.dumps(metrics)) == metrics


@pytest.mark.parametrize("board", [AGX, VENDOR, SERVER])
def test_garbage_and_missing_files_give_none_not_exceptions(board: str,
                                                            tmp_path: Path) -> None:
    tree = copy_board(board, tmp_path)
    collectors = build_collectors(Root(tree), topology(board))
    for directory in ("proc", "sys"):
        for dirpath, _, filenames in os.walk(tree / directory):
            for name in filenames:
                path = Path(dirpath) / name
                if not path.is_symlink():
                    path.write_text("garbage\n")
    garbage = {c.key: c.collect() for c in collectors}
    shutil.rmtree(tree / "proc")
    shutil.rmtree(tree / "sys")
    missing = {c.key: c.collect() for c in collectors}
    for metrics in (garbage, missing):
        assert metrics["cpu"] == {"util_pct": None, "cores": []}
        assert set(metrics["load"].values()) == {None}
        assert metrics["memory"] == {"total_bytes": None, "available_bytes": None,
                                     "used_pct": None}
        assert {z["temp_c"] for z in metrics["thermal"]} == {None}
        assert all(set(r.values()) - {r["name"]} <= {None} for r in metrics["power"])
        assert all(g["util_pct"] is None and g["freq_hz"] is None for g in metrics["gpus"])
        assert all(d["read_bytes_per_s"] is None for d in metrics["block"])
        assert metrics["net"] == []
        assert metrics["thp"] == {"enabled": None, "defrag": None, "counters": {}}


# -- cpu -----------------------------------------------------------------------------------

def test_cpu_first_sample_has_frequencies_and_omits_offline_cores() -> None:
    cpu = CpuCollector(reader(AGX), topology(AGX)).collect()
    assert cpu["util_pct"] is None
    # MODE_30W: cpu8-11 are offline, so /proc/stat and the sample leave them out
    assert [(c["cpu"], c["util_pct"], c["freq_khz"]) for c in cpu["cores"]] == \
        [(n, None, 1190400) for n in range(4)] + [(n, None, 729600) for n in range(4, 8)]


def test_cpu_frequency_per_cpu_policy_and_without_cpufreq() -> None:
    server = CpuCollector(reader(SERVER), topology(SERVER)).collect()["cores"]
    assert [c["freq_khz"] for c in server] == [2800000] * 3 + [3299907] + [2800000] * 12
    vm = CpuCollector(reader(VM), topology(VM)).collect()["cores"]
    assert [(c["cpu"], c["freq_khz"]) for c in vm] == [(0, None), (1, None)]


def test_cpu_utilisation_from_two_snapshots(tmp_path: Path) -> None:
    tree = copy_board(NANO, tmp_path)
    collector = CpuCollector(SysReader(Root(tree)), topology(NANO))
    collector.collect()  # the fixture's own /proc/stat
    write(tree, "/proc/stat",
          "cpu  1290704 6552 422946 23529257 7987 0 14511 50 0 0\n"
          "cpu0 192233 312 63726 4049025 1237 0 2191 0 0 0\n"  # +60 user +15 sys +25 idle
          "cpu1 201346 624 66422 3998100 1274 0 2282 0 0 0\n"  # +100 idle
          "cpu2 210529 936 69133 3947080 1321 0 2373 0 0 0\n"  # +10 user +80 idle +10 iowait
          "cpu3 219693 1248 71844 3896002 1348 0 2464 0 0 0\n"  # +1 user +2 idle
          "cpu4 228865 1560 74555 3845000 1385 0 2555 0 0 0\n"  # no tick at all
          "cpu5 238038 1872 77266 3794050 1422 0 2646 50 0 0\n"  # +50 steal +50 idle
          "intr 0\n")
    cpu = collector.collect()
    assert [c["util_pct"] for c in cpu["cores"]] == [75.0, 0.0, 10.0, 33.333, None, 50.0]
    assert cpu["util_pct"] == 33.747  # busy 75+10+1+50 = 136 of 403 ticks
    assert [c["freq_khz"] for c in cpu["cores"]] == [1344000] * 4 + [729600] * 2


# -- load, memory, swap, psi ---------------------------------------------------------------

def test_load() -> None:
    assert LoadCollector(reader(AGX)).collect() == {
        "avg1": 1.24, "avg5": 0.98, "avg15": 0.87, "running": 3, "total": 1432}
    assert LoadCollector(reader(VM)).collect() == {
        "avg1": 0.08, "avg5": 0.03, "avg15": 0.01, "running": 1, "total": 131}


def test_load_garbage_is_none(tmp_path: Path) -> None:
    tree = copy_board(VM, tmp_path)
    write(tree, "/proc/loadavg", "0.08 0.03\n")
    assert LoadCollector(SysReader(Root(tree))).collect() == dict.fromkeys(
        ["avg1", "avg5", "avg15", "running", "total"])


@pytest.mark.parametrize(("board", "total_kb", "available_kb", "used_pct"), [
    (AGX, 64335836, 60110232, 6.568),  # (64335836 - 60110232) / 64335836
    (VENDOR, 16088356, 15012948, 6.684),
    (SERVER, 131334136, 118602384, 9.694)])
def test_memory(board: str, total_kb: int, available_kb: int, used_pct: float) -> None:
    assert MemoryCollector(reader(board)).collect() == {
        "total_bytes": total_kb * 1024, "available_bytes": available_kb * 1024,
        "used_pct": used_pct}


@pytest.mark.parametrize(("board", "total_kb", "used_kb"), [
    (AGX, 32167904, 12288), (NANO, 3901136, 250904), (VENDOR, 8044176, 0),
    (SERVER, 8388604, 262144), (MAINLINE, 0, 0)])
def test_swap(board: str, total_kb: int, used_kb: int) -> None:
    assert SwapCollector(reader(board)).collect() == {
        "total_bytes": total_kb * 1024, "used_bytes": used_kb * 1024}


def test_psi_values_and_none_without_psi() -> None:
    assert PsiCollector(reader(AGX)).collect() == {
        "cpu_some_avg10": 0.12, "memory_some_avg10": 0.0, "memory_full_avg10": 0.0,
        "io_some_avg10": 0.31, "io_full_avg10": 0.0}
    # the RK3588 vendor kernel is built without PSI
    assert PsiCollector(reader(VENDOR)).collect() == dict.fromkeys(
        ["cpu_some_avg10", "memory_some_avg10", "memory_full_avg10", "io_some_avg10",
         "io_full_avg10"])


def test_psi_rereads_each_sample(tmp_path: Path) -> None:
    tree = copy_board(MAINLINE, tmp_path)
    collector = PsiCollector(SysReader(Root(tree)))
    write(tree, "/proc/pressure/memory", "some avg10=34.20 avg60=10.00 avg300=2.00 total=9\n"
                                         "full avg10=12.50 avg60=3.00 avg300=1.00 total=4\n")
    values = collector.collect()
    assert (values["memory_some_avg10"], values["memory_full_avg10"]) == (34.2, 12.5)


# -- cgroup --------------------------------------------------------------------------------

NO_EVENTS = dict.fromkeys(["low", "high", "max", "oom", "oom_kill"])


def test_cgroup_of_the_agent_unit() -> None:
    assert CgroupCollector(reader(AGX), topology(AGX)).collect() == {
        "path": "/system.slice/edge-agent.service", "memory_current_bytes": 52428800,
        "memory_max_bytes": None, "memory_high_bytes": None,  # both "max": no limit
        "events": {"low": 0, "high": 0, "max": 0, "oom": 0, "oom_kill": 0}}


def test_cgroup_limits_and_events_are_reread(tmp_path: Path) -> None:
    tree = copy_board(EDGE, tmp_path)
    collector = CgroupCollector(SysReader(Root(tree)), topology(EDGE))
    unit = "/sys/fs/cgroup/system.slice/edge-agent.service"
    write(tree, f"{unit}/memory.max", "3221225472\n")
    write(tree, f"{unit}/memory.high", "2899102924\n")
    write(tree, f"{unit}/memory.current", "2900000768\n")
    write(tree, f"{unit}/memory.events",
          "low 0\nhigh 17\nmax 4\noom 2\noom_kill 1\noom_group_kill 0\n")
    assert collector.collect() == {
        "path": "/system.slice/edge-agent.service", "memory_current_bytes": 2900000768,
        "memory_max_bytes": 3221225472, "memory_high_bytes": 2899102924,
        "events": {"low": 0, "high": 17, "max": 4, "oom": 2, "oom_kill": 1}}


def test_cgroup_path_override() -> None:
    collected = CgroupCollector(reader(AGX), topology(AGX), path="system.slice/").collect()
    # system.slice has memory.max "max" and no memory.current or memory.events
    assert collected == {"path": "/system.slice", "memory_current_bytes": None,
                         "memory_max_bytes": None, "memory_high_bytes": None,
                         "events": NO_EVENTS}


def test_cgroup_on_a_hybrid_hierarchy_has_no_values() -> None:
    assert CgroupCollector(reader(VM), topology(VM)).collect() == {
        "path": "/system.slice/edge-agent.service", "memory_current_bytes": None,
        "memory_max_bytes": None, "memory_high_bytes": None, "events": NO_EVENTS}


# -- thermal, power, fans ------------------------------------------------------------------

def test_thermal_with_powered_down_zones() -> None:
    zones = ThermalCollector(reader(AGX), topology(AGX)).collect()
    assert [(z["zone"], z["type"], z["temp_c"]) for z in zones] == [
        ("thermal_zone0", "soc2-thermal", 44.468), ("thermal_zone2", "tj-thermal", 47.218),
        ("thermal_zone3", "cpu-thermal", 46.781), ("thermal_zone4", "cv0-thermal", 43.906),
        ("thermal_zone5", "gpu-thermal", None), ("thermal_zone6", "soc0-thermal", 43.562),
        ("thermal_zone7", "cv1-thermal", 44.031), ("thermal_zone8", "soc1-thermal", 45.0),
        ("thermal_zone9", "cv2-thermal", None)]  # PMIC-Die (zone1) is not reported
    assert ThermalCollector(reader(VM), topology(VM)).collect() == []


def test_thermal_rereads_and_tolerates_garbage(tmp_path: Path) -> None:
    tree = copy_board(SERVER, tmp_path)
    collector = ThermalCollector(SysReader(Root(tree)), topology(SERVER))
    write(tree, "/sys/devices/virtual/thermal/thermal_zone0/temp", "81500\n")
    write(tree, "/sys/devices/virtual/thermal/thermal_zone2/temp", "garbage\n")
    assert [z["temp_c"] for z in collector.collect()] == [81.5, 27.8, None]


def test_power_rails_of_each_chip() -> None:
    def rails(board: str) -> list[tuple[Any, ...]]:
        return [tuple(r.values()) for r in PowerCollector(reader(board),
                                                          topology(board)).collect()]
    assert rails(AGX) == [("VDD_GPU_SOC", 19280.0, 168.0, 3239.04),  # mV * mA / 1000
                          ("VDD_CPU_CV", 19280.0, 40.0, 771.2),
                          ("VIN_SYS_5V0", 5024.0, 792.0, 3979.008),
                          ("VDDQ_VDD2_1V8AO", 5024.0, 120.0, 602.88)]
    assert rails(SERVER) == [("ina238-0-0040", 12048.0, 3520.0, 42408.96)]  # power1_input in µW
    assert rails(VENDOR) == [  # regulators: µV, no current sense
        ("vdd_cpu_big0_s0", 850.0, None, None), ("vdd_cpu_big1_s0", 850.0, None, None),
        ("vdd_npu_s0", 850.0, None, None), ("vdd_gpu_s0", 675.0, None, None),
        ("vdd_cpu_lit_s0", 750.0, None, None), ("vdd_log_s0", 750.0, None, None)]
    assert rails(VM) == []


def test_power_is_reread_each_sample(tmp_path: Path) -> None:
    tree = copy_board(NANO, tmp_path)
    collector = PowerCollector(SysReader(Root(tree)), topology(NANO))
    assert collector.collect()[0] == {"name": "VDD_IN", "voltage_mv": 5080.0,
                                      "current_ma": 1180.0, "power_mw": 5994.4}
    hwmon = tree / "sys/class/hwmon/hwmon1"
    (hwmon / "curr1_input").write_text("2000\n")
    assert collector.collect()[0]["power_mw"] == 10160.0


def test_fans() -> None:
    assert FanCollector(reader(AGX), topology(AGX)).collect() == [
        {"name": "generic_pwm_tachometer", "rpm": 1980, "pwm": None},
        {"name": "pwmfan", "rpm": None, "pwm": 86}]
    assert FanCollector(reader(VENDOR), topology(VENDOR)).collect() == [
        {"name": "pwmfan", "rpm": None, "pwm": 72}]
    assert FanCollector(reader(SERVER), topology(SERVER)).collect() == []


# -- gpus ----------------------------------------------------------------------------------

def devfreq_gpu(board: str) -> tuple[Any, ...]:
    (gpu,) = GpuCollector(reader(board), topology(board), None).collect()
    assert {k for k, v in gpu.items() if v is not None} <= {"name", "util_pct", "freq_hz"}
    return gpu["name"], gpu["util_pct"], gpu["freq_hz"]


def test_devfreq_gpus() -> None:
    assert devfreq_gpu(AGX) == ("ga10b", 12.5, 306000000)  # load 125 per-mille, cur_freq
    assert devfreq_gpu(NANO) == ("ga10b", 3.7, 612000000)
    assert devfreq_gpu(VENDOR) == ("mali-bifrost", 14.0, 300000000)  # "14@300000000Hz"
    assert devfreq_gpu(MAINLINE) == ("mali-valhall-csf", None, 400000000)  # panthor: no load
    # the i915 iGPU has a row; the committed tree has no gt_*_freq_mhz files to fill it
    assert devfreq_gpu(EDGE) == ("Intel GPU 0x7d55", None, None)


L4_SAMPLE = NvmlGpuSample(name="NVIDIA L4", util_pct=87.0, memory_used_bytes=8_589_934_592,
                          memory_total_bytes=24_152_899_584, temp_c=64.0, power_mw=61234.0,
                          graphics_clock_mhz=2040, memory_clock_mhz=6251,
                          throttle_reasons=["sw_power_cap"])


class FakeNvml:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail

    def sample(self) -> list[NvmlGpuSample]:
        if self.fail:
            raise RuntimeError("NVML Shared Library Not Found")
        return [L4_SAMPLE]


def test_nvml_gpu_through_the_protocol() -> None:
    assert GpuCollector(reader(SERVER), topology(SERVER), FakeNvml()).collect() == [{
        "name": "NVIDIA L4", "util_pct": 87.0, "freq_hz": 2_040_000_000,
        "memory_used_bytes": 8_589_934_592, "memory_total_bytes": 24_152_899_584,
        "temp_c": 64.0, "power_mw": 61234.0, "graphics_clock_mhz": 2040,
        "memory_clock_mhz": 6251, "throttle_reasons": ["sw_power_cap"]}]


def test_nvml_failure_keeps_the_gpu_with_none_values() -> None:
    for nvml in (FakeNvml(fail=True), None):
        (gpu,) = GpuCollector(reader(SERVER), topology(SERVER), nvml).collect()
        assert gpu["name"] == "NVIDIA GPU 0x27b8"  # as discovery named it from PCI
        assert set(gpu.values()) == {"NVIDIA GPU 0x27b8", None}


def test_nvml_is_not_asked_without_an_nvidia_discrete_gpu() -> None:
    assert GpuCollector(reader(AGX), topology(AGX), FakeNvml(fail=True)).collect()[0][
        "name"] == "ga10b"
    assert len(GpuCollector(reader(AGX), topology(AGX), FakeNvml()).collect()) == 1


class NotSupported(Exception):
    """Stands in for pynvml.NVMLError_NotSupported."""


class OldPynvml:
    """The pynvml calls the telemetry uses, before the ClocksEvent rename."""

    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_GRAPHICS = 0
    NVML_CLOCK_MEM = 2

    def __init__(self, fail_init: bool = False) -> None:
        self.fail_init = fail_init
        self.init_calls = 0
        self.shutdown_calls = 0

    def nvmlInit(self) -> None:
        self.init_calls += 1
        if self.fail_init:
            raise RuntimeError("Driver Not Loaded")

    def nvmlShutdown(self) -> None:
        self.shutdown_calls += 1

    def nvmlDeviceGetCount(self) -> int:
        return 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        return f"handle{index}"

    def nvmlDeviceGetName(self, handle: str) -> bytes:
        return b"NVIDIA L4"

    def nvmlDeviceGetUtilizationRates(self, handle: str) -> Any:
        return SimpleNamespace(gpu=87, memory=41)

    def nvmlDeviceGetMemoryInfo(self, handle: str) -> Any:
        return SimpleNamespace(total=24_152_899_584, used=8_589_934_592,
                               free=15_562_964_992)

    def nvmlDeviceGetTemperature(self, handle: str, sensor: int) -> int:
        assert sensor == self.NVML_TEMPERATURE_GPU
        return 64

    def nvmlDeviceGetPowerUsage(self, handle: str) -> int:
        raise NotSupported("Not Supported")

    def nvmlDeviceGetClockInfo(self, handle: str, clock: int) -> int:
        return {self.NVML_CLOCK_GRAPHICS: 2040, self.NVML_CLOCK_MEM: 6251}[clock]

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: str) -> int:
        return 0x1


class NewPynvml(OldPynvml):
    def __init__(self, old_driver: bool = False) -> None:
        super().__init__()
        self.old_driver = old_driver

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: str) -> int:
        if self.old_driver:
            raise NotSupported("Function Not Found")
        return 0x24


def test_pynvml_telemetry_reads_each_field_and_inits_once() -> None:
    module = NewPynvml()
    nvml = PynvmlTelemetry(module)
    nvml.sample()
    assert nvml.sample() == [NvmlGpuSample(
        name="NVIDIA L4", util_pct=87.0, memory_used_bytes=8_589_934_592,
        memory_total_bytes=24_152_899_584, temp_c=64.0,
        power_mw=None,  # not supported on this board: None for this field only
        graphics_clock_mhz=2040, memory_clock_mhz=6251,
        throttle_reasons=["sw_power_cap", "sw_thermal_slowdown"])]
    assert (module.init_calls, module.shutdown_calls) == (1, 0)


@pytest.mark.parametrize("module", [OldPynvml(), NewPynvml(old_driver=True)])
def test_pynvml_throttle_reasons_on_older_bindings_and_drivers(module: OldPynvml) -> None:
    (sample,) = PynvmlTelemetry(module).sample()
    assert sample.throttle_reasons == ["gpu_idle"]


def test_pynvml_init_failure_is_retried_and_reported_as_none() -> None:
    module = OldPynvml(fail_init=True)
    nvml = PynvmlTelemetry(module)
    collector = GpuCollector(reader(SERVER), topology(SERVER), nvml)
    assert collector.collect()[0]["util_pct"] is None
    module.fail_init = False
    assert collector.collect()[0]["util_pct"] == 87.0
    assert module.init_calls == 2


# -- npus ----------------------------------------------------------------------------------

def test_rknpu_per_core_load() -> None:
    assert NpuCollector(reader(VENDOR), topology(VENDOR)).collect() == [
        {"name": "rknpu", "util_pct": 5.667, "core_util_pct": [12.0, 0.0, 5.0],
         "freq_hz": 1_000_000_000, "active": False}]  # debugfs power reads "off"


def test_rknpu_load_from_procfs(tmp_path: Path) -> None:
    tree = copy_board(VENDOR, tmp_path)
    shutil.move(tree / "sys/kernel/debug/rknpu", tree / "proc/rknpu")
    write(tree, "/proc/rknpu/load", "NPU load:  Core0: 90%, Core1: 60%, Core2: 30%,\n")
    write(tree, "/proc/rknpu/power", "on\n")
    (npu,) = NpuCollector(SysReader(Root(tree)), discover(Root(tree))).collect()
    assert npu == {"name": "rknpu", "util_pct": 60.0, "core_util_pct": [90.0, 60.0, 30.0],
                   "freq_hz": 1_000_000_000, "active": True}


@pytest.mark.parametrize(("line", "cores", "util"), [
    # the driver's own padding: "%2.d%%," after " Core%d: "
    ("NPU load:  Core0:  0%, Core1:  0%, Core2:  0%,", [0.0, 0.0, 0.0], 0.0),
    ("NPU load:  Core0:100%, Core1: 7%, Core2:  0%,", [100.0, 7.0, 0.0], 35.667),
    # the known glitch: a busy time counted past the window, not clamped by older drivers
    ("NPU load:  Core0: 250%, Core1: 40%, Core2: 20%,", [None, 40.0, 20.0], 30.0),
    ("NPU load:  Core0: 101%, Core1: 4294967295%, Core2: 999%,", [None, None, None], None),
    ("NPU load:  37%", [37.0], 37.0),  # single-core parts print no CoreN
    ("NPU load:  Core2:  5%, Core0: 10%, Core1:  0%,", [10.0, 0.0, 5.0], 5.0),
])
def test_rknpu_load_formats_and_impossible_values_are_null_not_clamped(
        tmp_path: Path, line: str, cores: list[float | None], util: float | None) -> None:
    tree = copy_board(VENDOR, tmp_path)
    write(tree, "/sys/kernel/debug/rknpu/load", line + "\n")
    rknpu_reader = SysReader(Root(tree))
    (npu,) = NpuCollector(rknpu_reader, topology(VENDOR)).collect()
    assert (npu["core_util_pct"], npu["util_pct"]) == (cores, util)
    glitch = [w for w in rknpu_reader.warnings if "outside 0..100 %" in w]
    assert bool(glitch) == (None in cores)


@pytest.mark.parametrize("content", ["garbage\n", "", "NPU load:\n", "NPU load: Core0: %,\n",
                                     "\x00\xff\n"])
def test_rknpu_load_garbage_is_none(tmp_path: Path, content: str) -> None:
    tree = copy_board(VENDOR, tmp_path)
    write(tree, "/sys/kernel/debug/rknpu/load", content)
    write(tree, "/sys/kernel/debug/rknpu/power", "garbage\n")
    (npu,) = NpuCollector(SysReader(Root(tree)), topology(VENDOR)).collect()
    assert (npu["util_pct"], npu["core_util_pct"], npu["active"]) == (None, None, None)
    shutil.rmtree(tree / "sys/kernel/debug/rknpu")  # debugfs unmounted after start
    (npu,) = NpuCollector(SysReader(Root(tree)), topology(VENDOR)).collect()
    assert (npu["util_pct"], npu["core_util_pct"], npu["active"]) == (None, None, None)


def test_npus_without_a_load_counter() -> None:
    assert NpuCollector(reader(AGX), topology(AGX)).collect() == [
        {"name": "dla0", "util_pct": None, "core_util_pct": None, "freq_hz": None,
         "active": False},
        {"name": "dla1", "util_pct": None, "core_util_pct": None, "freq_hz": None,
         "active": False}]  # runtime-suspended: idle
    assert NpuCollector(reader(MAINLINE), topology(MAINLINE)).collect() == [
        {"name": "rocket", "util_pct": None, "core_util_pct": None, "freq_hz": None,
         "active": None}]


def test_dla_engine_activity_from_debugfs_clocks(tmp_path: Path) -> None:
    tree = copy_board(AGX, tmp_path)
    for core, enables, hz in (("dla0_core", "1", "1600000000"), ("dla1_core", "0", "0")):
        (tree / f"sys/kernel/debug/clk/{core}").mkdir(parents=True)
        write(tree, f"/sys/kernel/debug/clk/{core}/clk_enable_count", f"{enables}\n")
        write(tree, f"/sys/kernel/debug/clk/{core}/clk_rate", f"{hz}\n")
    collector = NpuCollector(SysReader(Root(tree)), topology(AGX))
    assert [(n["name"], n["active"], n["freq_hz"]) for n in collector.collect()] == [
        ("dla0", True, 1_600_000_000), ("dla1", False, 0)]
    write(tree, "/sys/kernel/debug/clk/dla0_core/clk_enable_count", "garbage\n")
    (tree / "sys/kernel/debug/clk/dla1_core/clk_rate").unlink()
    assert [(n["name"], n["active"], n["freq_hz"]) for n in collector.collect()] == [
        ("dla0", None, 1_600_000_000), ("dla1", False, None)]


def test_dla_clock_rate_from_bpmp_debugfs(tmp_path: Path) -> None:
    tree = copy_board(AGX, tmp_path)
    (tree / "sys/kernel/debug/bpmp/debug/clk/dla0_core").mkdir(parents=True)
    write(tree, "/sys/kernel/debug/bpmp/debug/clk/dla0_core/rate", "1369600000\n")
    collector = NpuCollector(SysReader(Root(tree)), topology(AGX))
    assert [(n["name"], n["active"], n["freq_hz"]) for n in collector.collect()] == [
        ("dla0", False, 1_369_600_000), ("dla1", False, None)]


def test_intel_npu_busy_time_over_wall_time(tmp_path: Path) -> None:
    tree = copy_board(EDGE, tmp_path)
    clock = Clock()
    collector = NpuCollector(SysReader(Root(tree)), topology(EDGE), clock=clock)
    assert [n["util_pct"] for n in collector.collect()] == [None, None, None]
    device = "/sys/devices/pci0000:00/0000:00:0b.0"
    write(tree, f"{device}/npu_busy_time_us", "183576541\n")
    write(tree, f"{device}/npu_current_frequency_mhz", "1400\n")
    write(tree, f"{device}/power/runtime_status", "active\n")
    clock.now += 1.0  # 250000 µs busy in 1 s
    assert collector.collect() == [
        {"name": "intel-npu", "util_pct": 25.0, "core_util_pct": None,
         "freq_hz": 1_400_000_000, "active": True},
        {"name": "hailo8", "util_pct": None, "core_util_pct": None, "freq_hz": None,
         "active": None},
        {"name": "coral-edgetpu-usb", "util_pct": None, "core_util_pct": None,
         "freq_hz": None, "active": None}]


# -- which backend each model instance runs ------------------------------------------------

def test_instance_backends_come_from_each_instance_entry() -> None:
    entry = {"name": "m", "version": "1", "edge_agent": {
        "providers": ["TensorrtExecutionProvider", "CUDAExecutionProvider"],
        "instances": [
            {"index": 0, "backend": "onnxruntime", "device": "gpu:0", "precision": "fp16",
             "providers": ["TensorrtExecutionProvider", "CUDAExecutionProvider"],
             "threads": 1},
            {"index": 1, "backend": "onnxruntime", "device": "dla:1", "precision": "int8",
             "providers": ["TensorrtExecutionProvider"]},
            "garbage"]}}
    assert instance_backends(entry) == [
        {"instance": 0, "backend": "onnxruntime", "device": "gpu:0", "precision": "fp16",
         "providers": ["TensorrtExecutionProvider", "CUDAExecutionProvider"]},
        {"instance": 1, "backend": "onnxruntime", "device": "dla:1", "precision": "int8",
         "providers": ["TensorrtExecutionProvider"]},
        {"instance": 2, "backend": None, "device": None, "precision": None,
         "providers": ["TensorrtExecutionProvider", "CUDAExecutionProvider"]}]


def test_instance_backends_of_an_entry_with_figures_only_leave_the_rest_unknown() -> None:
    entry = {"edge_agent": {"providers": ["CPUExecutionProvider"],
                            "instances": [{"index": 0}, {"index": 1}]}}
    assert instance_backends(entry) == [
        {"instance": index, "backend": None, "device": None, "precision": None,
         "providers": ["CPUExecutionProvider"]} for index in (0, 1)]
    for entry in ({}, {"edge_agent": None}, {"edge_agent": {"providers": "x"}},
                  {"edge_agent": {"providers": [], "instances": 3}}):
        assert instance_backends(entry) is None


# -- block, net ----------------------------------------------------------------------------

def test_block_rates_for_the_discovered_disks(tmp_path: Path) -> None:
    tree = copy_board(AGX, tmp_path)
    clock = Clock()
    collector = BlockCollector(SysReader(Root(tree)), topology(AGX), clock=clock)
    assert collector.collect() == [
        {"name": name, "read_bytes_per_s": None, "write_bytes_per_s": None, "util_pct": None}
        for name in ("mmcblk0", "nvme0n1")]  # no loop, zram, boot areas or partitions
    write(tree, "/proc/diskstats",
          " 179       0 mmcblk0 51203 5689 3911624 12800 22187 7395 1452216 11093 0 98311 "
          "23893 443 0 3544 44 1109 221\n"
          # +2048 sectors read, +4096 written, +500 ms busy
          " 259       0 nvme0n1 182400 20256 24195928 45577 93200 31042 18207416 46563 0 "
          "301622 92140 1862 0 14896 186 4656 931\n")
    clock.now += 2.0
    assert collector.collect() == [
        {"name": "mmcblk0", "read_bytes_per_s": 0.0, "write_bytes_per_s": 0.0,
         "util_pct": 0.0},
        {"name": "nvme0n1", "read_bytes_per_s": 524288.0, "write_bytes_per_s": 1048576.0,
         "util_pct": 25.0}]


def test_net_rates_skip_loopback_and_new_interfaces(tmp_path: Path) -> None:
    tree = copy_board(EDGE, tmp_path)
    clock = Clock()
    collector = NetCollector(SysReader(Root(tree)), clock=clock)
    assert collector.collect() == [
        {"name": "enp3s0", "rx_bytes_per_s": None, "tx_bytes_per_s": None, "rx_errors": 0,
         "tx_errors": 0},
        {"name": "wlp0s20f3", "rx_bytes_per_s": None, "tx_bytes_per_s": None,
         "rx_errors": 0, "tx_errors": 0}]
    write(tree, "/proc/net/dev", NET_HEADER + (
        "enp3s0: 1211334412  990122    2    0    0     0          0      3021 88128004  "
        "412330    1    0    0     0       0          0\n"  # +1000000 rx, +5000 tx
        "wlp0s20f3:   22013     112    0    0    0     0          0         0     9120      "
        "71    0    0    0     0       0          0\n"
        " wwan0:     100       1    0    0    0     0          0         0      100       "
        "1    0    0    0     0       0          0\n"))
    clock.now += 0.5
    assert collector.collect() == [
        {"name": "enp3s0", "rx_bytes_per_s": 2000000.0, "tx_bytes_per_s": 10000.0,
         "rx_errors": 2, "tx_errors": 1},
        {"name": "wlp0s20f3", "rx_bytes_per_s": 0.0, "tx_bytes_per_s": 0.0, "rx_errors": 0,
         "tx_errors": 0},
        {"name": "wwan0", "rx_bytes_per_s": None, "tx_bytes_per_s": None, "rx_errors": 0,
         "tx_errors": 0}]


def test_a_counter_that_went_backwards_has_no_rate(tmp_path: Path) -> None:
    tree = copy_board(VM, tmp_path)
    clock = Clock()
    collector = NetCollector(SysReader(Root(tree)), clock=clock)
    collector.collect()
    write(tree, "/proc/net/dev", NET_HEADER + (
        "  eth0:    1000      10    0    0    0     0          0         0     2000      "
        "20    0    0    0     0       0          0\n"))  # the driver was reloaded
    clock.now += 1.0
    assert collector.collect()[0]["rx_bytes_per_s"] is None


# -- thp -----------------------------------------------------------------------------------

def test_thp_mode_and_counters() -> None:
    thp = ThpCollector(reader(AGX)).collect()
    assert (thp["enabled"], thp["defrag"]) == ("madvise", "madvise")
    assert thp["counters"] == {  # 5.15 arm64: no scan_exceed, no pud counters
        "thp_migration_success": 535, "thp_migration_fail": 0, "thp_migration_split": 0,
        "thp_fault_alloc": 21402, "thp_fault_fallback": 3057, "thp_fault_fallback_charge": 0,
        "thp_collapse_alloc": 428, "thp_collapse_alloc_failed": 0, "thp_file_alloc": 0,
        "thp_file_fallback": 0, "thp_file_fallback_charge": 0, "thp_file_mapped": 0,
        "thp_split_page": 237, "thp_split_page_failed": 0, "thp_deferred_split_page": 713,
        "thp_split_pmd": 856, "thp_zero_page_alloc": 1, "thp_zero_page_alloc_failed": 0,
        "thp_swpout": 0, "thp_swpout_fallback": 0}
    server = ThpCollector(reader(SERVER)).collect()
    assert (server["enabled"], server["counters"]["thp_fault_alloc"]) == ("always", 412008)
    assert "thp_split_pud" in server["counters"]
    assert ThpCollector(reader(VENDOR)).collect()["enabled"] == "never"


# -- this machine --------------------------------------------------------------------------

def test_on_the_real_root() -> None:
    root = Root("/")
    collectors = build_collectors(root, discover(root))
    for c in collectors:
        c.collect()
    time.sleep(0.1)
    metrics = {c.key: c.collect() for c in collectors}
    cores = metrics["cpu"]["cores"]
    assert len(cores) == os.cpu_count()  # online CPUs, as /proc/stat lists them
    assert all(c["util_pct"] is None or 0 <= c["util_pct"] <= 100 for c in cores)
    assert metrics["cpu"]["util_pct"] is not None and 0 <= metrics["cpu"]["util_pct"] <= 100
    meminfo = Path("/proc/meminfo").read_text()
    mem_total = re.search(r"^MemTotal:\s+(\d+) kB$", meminfo, re.MULTILINE)
    assert mem_total is not None
    assert metrics["memory"]["total_bytes"] == int(mem_total.group(1)) * 1024
    assert 0 <= metrics["memory"]["used_pct"] <= 100
    assert metrics["load"]["total"] >= metrics["load"]["running"] >= 0
    assert json.loads(json.dumps(metrics)) == metrics
