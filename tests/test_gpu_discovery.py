"""GPUs found by the DRM driver bound to their card (the Pi 5's V3D has no devfreq, no PCI
function and no NVML), i915/xe/amdgpu clocks read from the driver's own files, one entry
per device whichever source found it, and the Hailo listed once when its character device
has no ``device`` link.  Variants of the committed trees are built in tmp_path
(tests/fixtures/variants.py)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from agent.discovery import Topology, discover
from agent.discovery.drm import parse_sclk
from agent.kernel.fsroot import Root
from agent.kernel.reader import SysReader
from agent.telemetry.collectors.gpu import GpuCollector

FIXTURES = Path(__file__).resolve().parent / "fixtures"
sys.path.insert(0, str(FIXTURES))
import make_fixtures  # noqa: E402
import sysfs_tree as st  # noqa: E402
import variants  # noqa: E402

Tree = st.Tree

MHZ = 1_000_000


def committed(board: str) -> Topology:
    return discover(Root(FIXTURES / board))


def variant(name: str, tmp_path: Path) -> tuple[Path, Topology]:
    root = tmp_path / name
    root.mkdir()
    variants.VARIANTS[name](Tree(root))
    assert make_fixtures.problems(root) == []
    return root, discover(Root(root))


def gpu_rows(root: Path, topology: Topology) -> list[dict[str, object]]:
    return GpuCollector(SysReader(Root(root)), topology, None).collect()


# -- the Pi 5's V3D ------------------------------------------------------------------------

def test_pi5_v3d_is_found_by_its_drm_driver_and_vc4_display_is_not() -> None:
    (gpu,) = committed("rpi5-hailo").gpus
    assert (gpu.name, gpu.vendor, gpu.kind, gpu.driver, gpu.drm_card, gpu.source,
            gpu.sysfs) == ("2712-v3d", "broadcom", "integrated", "v3d", "card1", "drm",
                           "/sys/devices/platform/axi/1002000000.v3d")
    # the firmware owns V3D's clock: nothing to read, nothing made up
    assert (gpu.devfreq, gpu.min_hz, gpu.max_hz, gpu.cur_hz, gpu.pci_bdf) == (
        None, None, None, None, None)


def stats(timestamp: int, bin_ns: int, render_ns: int) -> str:
    return ("queue\ttimestamp\tjobs\truntime\n"
            f"bin\t{timestamp}\t10\t{bin_ns}\nrender\t{timestamp}\t10\t{render_ns}\n"
            f"tfu\t{timestamp}\t0\t0\ncsd\t{timestamp}\t0\t0\n"
            f"cache_clean\t{timestamp}\t0\t0\ncpu\t{timestamp}\t0\t0\n")


def test_pi5_v3d_load_is_its_busiest_queue_between_two_gpu_stats(tmp_path: Path) -> None:
    root = tmp_path / "rpi5"
    shutil.copytree(FIXTURES / "rpi5-hailo", root, symlinks=True)
    topology = discover(Root(root))
    collector = GpuCollector(SysReader(Root(root)), topology, None)
    stats_file = root / "sys/devices/platform/axi/1002000000.v3d/gpu_stats"
    stats_file.write_text(stats(1_000_000_000, 100_000_000, 200_000_000))
    (first,) = collector.collect()
    assert first == {  # one reading is no interval; V3D has no clock file at all
        "name": "2712-v3d", "util_pct": None, "freq_hz": None, "memory_used_bytes": None,
        "memory_total_bytes": None, "temp_c": None, "power_mw": None,
        "graphics_clock_mhz": None, "memory_clock_mhz": None, "throttle_reasons": None}
    # 2 s later: bin ran 0.2 s, render 1.2 s of them -> 60 %, not the 70 % of a sum
    stats_file.write_text(stats(3_000_000_000, 300_000_000, 1_400_000_000))
    assert collector.collect()[0]["util_pct"] == 60.0
    stats_file.write_text(stats(4_000_000_000, 0, 0))  # counters back to 0: driver reloaded
    assert collector.collect()[0]["util_pct"] is None
    stats_file.write_text("garbage\n")
    assert collector.collect()[0]["util_pct"] is None


# -- Intel: i915 and xe --------------------------------------------------------------------

def test_i915_mhz_files_give_range_limits_and_actual_clock(tmp_path: Path) -> None:
    root, topology = variant("x86-edge-npu-i915-freq", tmp_path)
    (gpu,) = topology.gpus  # the PCI entry, given its card and clocks: not a second GPU
    assert (gpu.name, gpu.pci_bdf, gpu.driver, gpu.drm_card, gpu.source) == (
        "Intel GPU 0x7d55", "0000:00:02.0", "i915", "card1", "pci")
    assert (gpu.min_hz, gpu.max_hz, gpu.limit_min_hz, gpu.limit_max_hz, gpu.cur_hz) == (
        100 * MHZ, 2250 * MHZ, 100 * MHZ, 2250 * MHZ, 650 * MHZ)  # act, not the request
    (row,) = gpu_rows(root, topology)
    assert (row["name"], row["freq_hz"], row["util_pct"]) == ("Intel GPU 0x7d55", 650 * MHZ,
                                                              None)


def test_xe_reads_gt0_freq0_in_mhz(tmp_path: Path) -> None:
    root, topology = variant("x86-edge-npu-xe", tmp_path)
    (gpu,) = topology.gpus
    assert (gpu.driver, gpu.drm_card, gpu.min_hz, gpu.max_hz, gpu.cur_hz) == (
        "xe", "card1", 100 * MHZ, 2250 * MHZ, 1150 * MHZ)  # gt0's act_freq, not gt1's
    assert gpu_rows(root, topology)[0]["freq_hz"] == 1150 * MHZ


def test_committed_i915_tree_has_no_mhz_files_and_reports_none() -> None:
    (gpu,) = committed("x86-edge-npu").gpus
    assert (gpu.drm_card, gpu.max_hz, gpu.cur_hz) == ("card1", None, None)


# -- devfreq GPUs keep one entry -----------------------------------------------------------

@pytest.mark.parametrize(("board", "card"), [("rk3588-mainline", "card1"),
                                             ("rk3588-vendor", None),
                                             ("jetson-agx-orin-jp6", None)])
def test_devfreq_gpu_is_one_entry_with_its_card(board: str, card: str | None) -> None:
    # panthor's card1 is the devfreq GPU's device; vendor Mali has no DRM card (card0 is the
    # rockchip-drm display, card1 the rknpu), nor has the Jetson's nvgpu
    (gpu,) = committed(board).gpus
    assert (gpu.source, gpu.drm_card) == ("devfreq", card)


def test_nvidia_drm_card_joins_the_pci_gpu(tmp_path: Path) -> None:
    root = tmp_path / "server"
    shutil.copytree(FIXTURES / "x86-server-nvidia", root, symlinks=True)
    st.drm_node(Tree(root), "/sys/devices/pci0000:98/0000:98:02.0/0000:99:00.0", "card1",
                "226:1")  # nvidia-drm's card on the L4
    (gpu,) = discover(Root(root)).gpus
    assert (gpu.pci_bdf, gpu.driver, gpu.drm_card, gpu.kind) == (
        "0000:99:00.0", "nvidia", "card1", "discrete")


def test_devfreq_of_a_drm_gpu_on_an_oddly_named_node_is_still_read(tmp_path: Path) -> None:
    root = tmp_path / "mainline"
    shutil.copytree(FIXTURES / "rk3588-mainline", root, symlinks=True)
    Tree(root).dt("/sys/firmware/devicetree/base/gpu@fb000000/name", "mali")
    (gpu,) = discover(Root(root)).gpus  # panthor's card names it a GPU; devfreq has the clock
    assert (gpu.driver, gpu.devfreq, gpu.drm_card, gpu.cur_hz, gpu.max_hz) == (
        "panthor", "fb000000.gpu", "card1", 400_000_000, 1_000_000_000)


def test_display_only_drm_devices_are_not_gpus() -> None:
    assert committed("bare-vm").gpus == []  # bochs-drm card0
    assert [g.driver for g in committed("x86-server-nvidia").gpus] == ["nvidia"]  # ast card0


# -- amdgpu's level table ------------------------------------------------------------------

def test_amdgpu_sclk_levels_and_the_starred_current_one() -> None:
    assert parse_sclk("0: 500Mhz \n1: 1200Mhz *\n2: 2100Mhz \n") == ([500, 1200, 2100], 1200)
    assert parse_sclk("0: 800Mhz \n") == ([800], None)
    with pytest.raises(ValueError, match="pp_dpm_sclk"):
        parse_sclk("garbage\n")


# -- Hailo: one NPU per PCI function -------------------------------------------------------

def test_pi5_hailo_chardev_without_device_link_is_listed_once() -> None:
    (npu,) = committed("rpi5-hailo").npus
    assert (npu.name, npu.driver, npu.vendor, npu.device, npu.sysfs) == (
        "hailo8", "hailo", "hailo", "/dev/hailo0",
        "/sys/devices/platform/axi/1000110000.pcie/pci0001:00/0001:00:00.0/0001:01:00.0")


def test_hailo_node_matched_by_driver_major_and_board_index(tmp_path: Path) -> None:
    _, topology = variant("rpi5-hailo-node-without-location", tmp_path)
    (npu,) = topology.npus
    assert (npu.device, npu.sysfs.rsplit("/", 1)[-1] if npu.sysfs else None) == (
        "/dev/hailo0", "0001:01:00.0")


def test_x86_hailo_chardev_without_device_link_is_listed_once() -> None:
    hailos = [n for n in committed("x86-edge-npu").npus if n.vendor == "hailo"]
    assert [(n.name, n.driver, n.device, n.sysfs) for n in hailos] == [
        ("hailo8", "hailo", "/dev/hailo0", "/sys/devices/pci0000:00/0000:00:1c.0/0000:01:00.0")]


def test_hailo_with_device_link_is_listed_once(tmp_path: Path) -> None:
    _, topology = variant("x86-edge-hailo-node-with-device-link", tmp_path)
    hailos = [n for n in topology.npus if n.vendor == "hailo"]
    assert [(n.name, n.driver, n.device, n.sysfs) for n in hailos] == [
        ("hailo8", "hailo", "/dev/hailo0", "/sys/devices/pci0000:00/0000:00:1c.0/0000:01:00.0")]


def test_amdgpu_card_gives_levels_current_clock_and_busy_percent(tmp_path: Path) -> None:
    tree = Tree(tmp_path)
    bridge = "/sys/devices/pci0000:00/0000:00:01.1"
    gpu = st.pci_device(tree, bridge, "0000:03:00.0", vendor=0x1002, device=0x7480,
                        pci_class=0x030000, driver="amdgpu",
                        link=st.PcieLink("16.0 GT/s PCIe", 8))
    tree.files(gpu, {"pp_dpm_sclk": "0: 500Mhz \n1: 1850Mhz *\n2: 2655Mhz \n",
                     "gpu_busy_percent": "37\n"})
    st.drm_node(tree, gpu, "card0", "226:0")
    topology = discover(Root(tmp_path))
    (found,) = topology.gpus
    assert (found.vendor, found.kind, found.driver, found.drm_card, found.source) == (
        "amd", "discrete", "amdgpu", "card0", "pci")
    assert (found.min_hz, found.max_hz, found.cur_hz, found.available_hz) == (
        500 * MHZ, 2655 * MHZ, 1850 * MHZ, [500 * MHZ, 1850 * MHZ, 2655 * MHZ])
    (row,) = gpu_rows(tmp_path, topology)
    assert (row["util_pct"], row["freq_hz"]) == (37.0, 1850 * MHZ)
