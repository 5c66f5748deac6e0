"""Discovery degrades to null plus a warning, never a traceback."""

from __future__ import annotations

import errno
import fnmatch
import os
from pathlib import Path

from agent.discovery import discover
from agent.discovery.thermal import discover_thermal
from agent.kernel.fsroot import Root
from agent.kernel.reader import SysReader


class FaultyRoot(Root):
    """A fixture root whose listed paths fail like the kernel does (EBUSY, EACCES, EINVAL).

    Regular files cannot reproduce these errors, so this stands in for kernel behaviour.
    """

    def __init__(self, base: Path, faults: dict[str, int]) -> None:
        super().__init__(base)
        self.faults = faults

    def read_bytes(self, path: str) -> bytes:
        for pattern, code in self.faults.items():
            if fnmatch.fnmatchcase(path, pattern):
                raise OSError(code, os.strerror(code), path)
        return super().read_bytes(path)


def write(base: Path, path: str, content: str | bytes) -> None:
    target = base / path.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        target.write_bytes(content)
    else:
        target.write_text(content)


def link(base: Path, path: str, target: str) -> None:
    where = base / path.lstrip("/")
    where.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(target, where)


def two_cluster_tree(base: Path) -> None:
    """Cluster policy4 has all CPUs offline (a Jetson power mode does this)."""
    cpu = "/sys/devices/system/cpu"
    write(base, f"{cpu}/present", "0-7\n")
    write(base, f"{cpu}/online", "0-3\n")
    for policy, cpus in (("policy0", range(4)), ("policy4", range(4, 8))):
        write(base, f"{cpu}/cpufreq/{policy}/related_cpus", " ".join(map(str, cpus)) + " \n")
        write(base, f"{cpu}/cpufreq/{policy}/cpuinfo_min_freq", "115200\n")
        write(base, f"{cpu}/cpufreq/{policy}/cpuinfo_max_freq", "2201600\n")
        write(base, f"{cpu}/cpufreq/{policy}/scaling_governor", "schedutil\n")
        for n in cpus:
            link(base, f"{cpu}/cpu{n}/cpufreq", f"../cpufreq/{policy}")


def test_inactive_policy_ebusy_keeps_membership_from_links(tmp_path: Path) -> None:
    two_cluster_tree(tmp_path)
    root = FaultyRoot(tmp_path, {"/sys/devices/system/cpu/cpufreq/policy4/*": errno.EBUSY})
    topology = discover(root)
    first, second = topology.cpu.clusters
    assert (first.cpus, first.max_khz, first.governor) == ([0, 1, 2, 3], 2201600, "schedutil")
    assert (second.policy, second.cpus, second.online_cpus) == ("policy4", [4, 5, 6, 7], [])
    assert (second.min_khz, second.max_khz, second.governor) == (None, None, None)
    assert topology.cpu.offline == [4, 5, 6, 7]
    assert any("policy4/cpuinfo_max_freq: unreadable (EBUSY" in w for w in topology.warnings)


def test_debugfs_permission_denied_is_named(tmp_path: Path) -> None:
    write(tmp_path, "/sys/firmware/devicetree/base/compatible",
          b"radxa,rock-5b\0rockchip,rk3588\0")
    dev = "/sys/devices/platform/fdab0000.npu"
    write(tmp_path, "/sys/firmware/devicetree/base/npu@fdab0000/compatible",
          b"rockchip,rk3588-rknpu\0")
    link(tmp_path, f"{dev}/of_node", "../../../firmware/devicetree/base/npu@fdab0000")
    write(tmp_path, f"{dev}/devfreq/fdab0000.npu/available_frequencies", "300000000 1000000000\n")
    link(tmp_path, f"{dev}/devfreq/fdab0000.npu/device", "../../../fdab0000.npu")
    link(tmp_path, "/sys/class/devfreq/fdab0000.npu",
         "../../devices/platform/fdab0000.npu/devfreq/fdab0000.npu")
    write(tmp_path, "/sys/kernel/debug/rknpu/load", "NPU load:  Core0:  1%, Core1:  2%,\n")
    root = FaultyRoot(tmp_path, {"/sys/kernel/debug/*": errno.EACCES})
    topology = discover(root)
    (npu,) = topology.npus
    assert (npu.name, npu.cores, npu.load_pct, npu.max_hz) == ("rknpu", 3, None, 1_000_000_000)
    assert "/sys/kernel/debug/rknpu/load: permission denied (needs root, or debugfs is locked " \
        "down)" in topology.warnings


def test_thermal_garbage_powered_down_and_einval(tmp_path: Path) -> None:
    zones = {"thermal_zone0": ("gpu-thermal", "-256000\n"),
             "thermal_zone1": ("cpu-thermal", "garbage\n"),
             "thermal_zone2": ("cv0-thermal", "0\n"),
             "thermal_zone10": ("tj-thermal", "51250\n")}
    for zone, (zone_type, temp) in zones.items():
        write(tmp_path, f"/sys/class/thermal/{zone}/type", zone_type + "\n")
        write(tmp_path, f"/sys/class/thermal/{zone}/temp", temp)
    reader = SysReader(FaultyRoot(tmp_path, {"*/thermal_zone2/temp": errno.EINVAL}))
    found = {z.name: (z.zone, z.temp_c) for z in discover_thermal(reader)}
    assert found == {"gpu": ("thermal_zone0", None), "cpu": ("thermal_zone1", None),
                     "cv0": ("thermal_zone2", None), "tj": ("thermal_zone10", 51.25)}
    assert reader.warnings == [
        "/sys/class/thermal/thermal_zone1/temp: expected an integer, got 'garbage'"]


def test_empty_root_gives_empty_topology(tmp_path: Path) -> None:
    topology = discover(Root(tmp_path)).to_dict()
    assert topology["board"]["family"] == "generic"
    assert topology["cpu"]["count"] == 0
    for key in ("gpus", "npus", "thermal", "power_rails", "block", "pci"):
        assert topology[key] == []
    assert topology["kernel"]["release"] is None
    assert topology["kernel"]["io_uring"] is None  # unknown: a fixture cannot be probed


def test_reader_warnings_stay_bounded(tmp_path: Path) -> None:
    """A service reading garbage every second for weeks must not grow a list for ever."""
    from agent.kernel.reader import SysReader

    reader = SysReader(Root(tmp_path), max_warnings=3)
    for number in range(10):
        reader.warn(f"value {number} is garbage")
    reader.warn("value 0 is garbage")
    assert reader.warnings == [f"value {n} is garbage" for n in range(3)]
    assert reader.suppressed == 7
