"""NPU and DLA discovery by bound driver, wherever the device sits, Rocket's facade accel
node, and the runtime versions on the root (librknnrt, TensorRT, CUDA, OpenVINO).

The committed board trees cover the usual layouts; tests/fixtures/variants.py builds the
unusual ones into tmp_path from the same builders."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from agent.discovery import Topology, discover
from agent.discovery.model import RuntimeVersion
from agent.discovery.runtimes import RKNNRT_VERSION, discover_runtimes, scan_version
from agent.kernel.fsroot import Root
from agent.kernel.reader import SysReader

FIXTURES = Path(__file__).resolve().parent / "fixtures"
sys.path.insert(0, str(FIXTURES))
import make_fixtures  # noqa: E402
import runtime_files  # noqa: E402
import variants  # noqa: E402
from sysfs_tree import Tree  # noqa: E402


def committed(board: str) -> Topology:
    return discover(Root(FIXTURES / board))


def variant(name: str, tmp_path: Path, **options: int) -> Topology:
    root = tmp_path / name
    root.mkdir()
    builder = variants.VARIANTS[name]
    builder(Tree(root), **options)  # type: ignore[call-arg]
    assert make_fixtures.problems(root) == []
    return discover(Root(root))


def npus(topology: Topology) -> list[tuple[object, ...]]:
    return [(n.name, n.driver, n.cores, n.device, n.sysfs) for n in topology.npus]


# -- Rockchip ------------------------------------------------------------------------------

def test_vendor_rknpu_found_by_driver_and_devfreq() -> None:
    (npu,) = committed("rk3588-vendor").npus
    assert (npu.name, npu.driver, npu.cores, npu.devfreq, npu.device, npu.sysfs) == (
        "rknpu", "rknpu", 3, "fdab0000.npu", "/dev/dri/renderD129",
        "/sys/devices/platform/fdab0000.npu")
    assert (npu.max_hz, npu.load_pct, npu.version) == (1_000_000_000, [12, 0, 5], "v0.9.6")


def test_vendor_rknpu_elsewhere_without_devfreq_is_found_by_its_driver(
        tmp_path: Path) -> None:
    (npu,) = variant("rk3588-vendor-npu-elsewhere", tmp_path).npus
    assert (npu.name, npu.driver, npu.cores, npu.devfreq, npu.device, npu.sysfs) == (
        "rknpu", "rknpu", 3, None, "/dev/dri/renderD129", variants.RKNPU_ELSEWHERE)
    assert (npu.min_hz, npu.max_hz, npu.governor) == (None, None, None)
    assert npu.load_pct == [12, 0, 5]  # debugfs does not depend on where the device is


def test_rocket_accel_node_on_the_driverless_facade_counts_the_bound_cores() -> None:
    (npu,) = committed("rk3588-mainline").npus
    assert (npu.name, npu.driver, npu.cores, npu.device, npu.sysfs) == (
        "rocket", "rocket", 3, "/dev/accel/accel0", "/sys/devices/platform/rknn")
    assert npu.core_sysfs == [f"/sys/devices/platform/{u}.npu"
                              for u in ("fdab0000", "fdac0000", "fdad0000")]
    # the facade has no driver; the devfreq-less rknn-core devices are not rknpu
    assert not (FIXTURES / "rk3588-mainline/sys/devices/platform/rknn/driver").exists()


def test_rocket_cores_elsewhere_and_one_not_probed(tmp_path: Path) -> None:
    (npu,) = variant("rk3588-mainline-cores-elsewhere", tmp_path, bound=2).npus
    assert (npu.name, npu.cores, npu.device, npu.sysfs) == (
        "rocket", 2, "/dev/accel/accel0", "/sys/devices/platform/rknn")
    assert npu.core_sysfs == [f"{variants.ROCKET_CORES_ELSEWHERE}/{u}.npu"
                              for u in ("fdab0000", "fdac0000")]


def test_rocket_cores_without_an_accel_node(tmp_path: Path) -> None:
    root = tmp_path / "tree"
    root.mkdir()
    variants.rk3588_mainline_cores_elsewhere(Tree(root))
    (root / "sys/class/accel/accel0").unlink()
    (npu,) = discover(Root(root)).npus
    assert (npu.name, npu.cores, npu.device) == ("rocket", 3, None)


# -- Jetson, Intel -------------------------------------------------------------------------

def test_dla_found_by_the_nvdla_driver_wherever_host1x_sits(tmp_path: Path) -> None:
    expected = [("dla0", "nvdla", 1, None, f"{variants.DLA_HOST1X_ELSEWHERE}/15880000.nvdla0"),
                ("dla1", "nvdla", 1, None, f"{variants.DLA_HOST1X_ELSEWHERE}/158c0000.nvdla1")]
    assert npus(variant("jetson-agx-dla-elsewhere", tmp_path)) == expected
    assert [n.name for n in committed("jetson-xavier-nx-jp5-rt").npus] == ["dla0", "dla1"]
    assert committed("jetson-orin-nano-jp6").npus == []


def test_intel_npu_from_its_pci_driver_without_an_accel_node(tmp_path: Path) -> None:
    found = variant("x86-edge-npu-without-accel-node", tmp_path).npus
    assert (found[0].name, found[0].driver, found[0].device, found[0].max_hz,
            found[0].sysfs) == ("intel-npu", "intel_vpu", None, 1_400_000_000,
                                "/sys/devices/pci0000:00/0000:00:0b.0")
    assert [n.name for n in committed("x86-edge-npu").npus] == [
        "intel-npu", "hailo8", "coral-edgetpu-usb"]


def test_a_driver_link_that_dangles_is_skipped(tmp_path: Path) -> None:
    root = tmp_path / "tree"
    root.mkdir()
    tree = Tree(root)
    tree.file("/sys/bus/platform/drivers/rocket/uevent", "DRIVER=rocket\n")
    tree.link("/sys/bus/platform/drivers/rocket/fdab0000.npu",
              "../../../../devices/platform/fdab0000.npu")  # the device is gone
    assert discover(Root(root)).npus == []


# -- runtimes ------------------------------------------------------------------------------

def runtimes(board: str) -> dict[str, object]:
    return {name: (found["version"], found["source"]) if found else None
            for name, found in committed(board).to_dict()["runtimes"].items()}


@pytest.mark.parametrize(("board", "expected"), [
    ("rk3588-vendor", {"librknnrt": ("2.3.0", "library")}),
    ("rk3588-mainline", {}),
    ("jetson-agx-orin-jp6", {"tensorrt": ("10.3.0.30", "dpkg"),
                             "cuda": ("12.6.68", "version.json")}),
    ("jetson-xavier-nx-jp5-rt", {"tensorrt": ("8.5.2", "library"),
                                 "cuda": ("11.4.315", "version.json")}),
    ("x86-edge-npu", {"openvino": ("2024.6.0", "library")}),
    ("x86-server-nvidia", {"cuda": ("12.4.131", "version.json")}),
    ("bare-vm", {}),
])
def test_runtime_versions_on_the_fixture_roots(board: str, expected: dict[str, object]) -> None:
    assert runtimes(board) == {"librknnrt": None, "tensorrt": None, "cuda": None,
                               "openvino": None, "onnxruntime": None, **expected}


def test_librknnrt_version_across_a_chunk_boundary_and_past_the_limit(tmp_path: Path) -> None:
    path = tmp_path / "usr/lib/librknnrt.so"
    path.parent.mkdir(parents=True)
    text = b"librknnrt version: 1.6.0 (9a7b5d24c@2023-12-13T17:31:11)"
    path.write_bytes(b"\0" * (1024 * 1024 - 10) + text + b"\0")
    reader = SysReader(Root(tmp_path))
    assert scan_version(reader, "/usr/lib/librknnrt.so", RKNNRT_VERSION) == "1.6.0"
    assert scan_version(reader, "/usr/lib/librknnrt.so", RKNNRT_VERSION, limit=4096) is None
    path.write_bytes(b"\x7fELF no version string here")
    assert discover_runtimes(reader).librknnrt == RuntimeVersion(
        version=None, path="/usr/lib/librknnrt.so", source="library")


@pytest.mark.parametrize("content", ["", "{", "[]", '{"cuda": {}}', '{"cuda": "12"}'])
def test_cuda_version_json_garbage_is_none(tmp_path: Path, content: str) -> None:
    (tmp_path / "usr/local/cuda").mkdir(parents=True)
    (tmp_path / "usr/local/cuda/version.json").write_text(content)
    reader = SysReader(Root(tmp_path))
    found = discover_runtimes(reader).cuda
    assert found is not None and found.version is None
    assert reader.warnings


def test_cuda_version_txt_and_dpkg_stanzas_not_installed(tmp_path: Path) -> None:
    tree = Tree(tmp_path)
    runtime_files.cuda_toolkit(tree, "10.2.300", json_file=False)
    runtime_files.dpkg_status(tree, [("libnvinfer8", "8.2.1-1+cuda10.2", "arm64")])
    status = tmp_path / "var/lib/dpkg/status"
    status.write_text(status.read_text() + "\nPackage: libnvinfer10\n"
                      "Status: deinstall ok config-files\nVersion: 10.0.0-1\n")
    found = discover_runtimes(SysReader(Root(tmp_path)))
    assert (found.cuda, found.tensorrt) == (
        RuntimeVersion("10.2.300", "/usr/local/cuda/version.txt", "version.txt"),
        RuntimeVersion("8.2.1", "/var/lib/dpkg/status", "dpkg"))


def test_openvino_from_python_metadata(tmp_path: Path) -> None:
    dist = tmp_path / "usr/local/lib/python3.12/dist-packages/openvino-2025.1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Name: openvino\nVersion: 2025.1.0\n")
    assert discover_runtimes(SysReader(Root(tmp_path))).openvino == RuntimeVersion(
        "2025.1.0", "/usr/local/lib/python3.12/dist-packages/openvino-2025.1.0.dist-info",
        "dist-info")


def test_an_empty_root_has_no_runtimes_and_no_warnings(tmp_path: Path) -> None:
    reader = SysReader(Root(tmp_path))
    assert json.dumps(discover_runtimes(reader).__dict__) == json.dumps(
        dict.fromkeys(["librknnrt", "tensorrt", "cuda", "openvino", "onnxruntime"]))
    assert reader.warnings == []


def test_the_host_reports_this_interpreters_onnxruntime() -> None:
    found = discover_runtimes(SysReader(Root("/"))).onnxruntime
    assert found is not None and found.source.startswith("dist-info:onnxruntime")
