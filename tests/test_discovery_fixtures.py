"""Discovery on fixture trees of real boards: exact values, per tests/fixtures/README.md."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest
from cli_helpers import edge_agent

from agent.discovery import Topology, discover
from agent.discovery.nvml import NvmlGpu
from agent.kernel.fsroot import Root

FIXTURES = Path(__file__).resolve().parent / "fixtures"
BOARDS = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir() and p.name[0] not in "_.")


class FakeNvml:
    """The NVIDIA L4 of the x86-server fixture as NVML would report it."""

    def gpus(self) -> list[NvmlGpu]:
        return [NvmlGpu(index=0, name="NVIDIA L4", pci_bus_id="00000000:99:00.0",
                        memory_total_bytes=24_152_899_584,
                        uuid="GPU-5b1e0c53-6bd1-4a9e-8f27-000000000001",
                        max_graphics_clock_mhz=2040)]


@cache
def board(name: str) -> Topology:
    nvml = FakeNvml() if name == "x86-server-nvidia" else None
    return discover(Root(FIXTURES / name), nvml=nvml)


def test_every_required_board_has_a_fixture() -> None:
    assert {"jetson-agx-orin-jp6", "jetson-orin-nano-jp6", "rk3588-vendor",
            "x86-server-nvidia", "bare-vm"} <= set(BOARDS)


@pytest.mark.parametrize("name", BOARDS)
def test_json_contract_keys(name: str) -> None:
    data = json.loads(json.dumps(board(name).to_dict()))
    assert data["schema"] == "topology/1"
    assert set(data["board"]) >= {"family", "model", "soc", "compatible"}
    assert set(data["cpu"]) >= {"count", "online", "clusters", "idle_states"}
    for cluster in data["cpu"]["clusters"]:
        assert set(cluster) >= {"id", "cpus", "policy", "core_type", "min_khz", "max_khz",
                                "available_khz", "governor", "available_governors"}
    assert set(data["memory"]) >= {"total_bytes", "numa_nodes"}
    for gpu in data["gpus"]:
        assert set(gpu) >= {"name", "vendor", "kind", "devfreq", "min_hz", "max_hz",
                            "available_hz", "governor", "pci_bdf", "numa_node", "memory_bytes"}
    for npu in data["npus"]:
        assert set(npu) >= {"name", "driver", "cores", "devfreq", "device", "min_hz", "max_hz"}
    for device in data["pci"]:
        assert set(device) >= {"bdf", "vendor_id", "device_id", "class", "driver", "numa_node",
                               "link_speed", "link_width"}
    assert set(data["kernel"]) >= {"release", "preempt_rt", "cgroup_v2", "cgroup_controllers",
                                   "thp", "io_uring", "psi"}
    assert isinstance(data["warnings"], list)


@pytest.mark.parametrize("name", BOARDS)
def test_cli_json_and_summary_on_fixture(name: str) -> None:
    """The command a person runs: exit 0, JSON parses, summary names the board's CPUs.  In
    this process (tests/cli_helpers.py): test_golden.py runs it as a process, per board."""
    base = ["discover", "--root", str(FIXTURES / name)]
    as_json = edge_agent(*base, "--json")
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout)["cpu"]["count"] == board(name).cpu.count
    summary = edge_agent(*base)
    assert summary.returncode == 0 and "Traceback" not in summary.stderr
    assert f"{board(name).cpu.count} CPUs" in summary.stdout


def clusters(topology: Topology) -> list[tuple[object, ...]]:
    return [(c.policy, c.cpus, c.core_type, c.core_name, c.min_khz, c.max_khz, c.governor)
            for c in topology.cpu.clusters]


def test_agx_orin_identity_and_offline_cluster() -> None:
    t = board("jetson-agx-orin-jp6")
    assert (t.board.family, t.board.soc, t.board.module, t.board.l4t, t.board.jetpack) == (
        "jetson", "tegra234", "p3701-0005", "36.4.3", "6.2")
    assert t.board.model == "NVIDIA Jetson AGX Orin Developer Kit"
    assert t.board.compatible == ["nvidia,p3737-0000+p3701-0005", "nvidia,p3701-0005",
                                  "nvidia,tegra234"]
    assert (t.cpu.count, t.cpu.online, t.cpu.offline) == (12, list(range(8)), [8, 9, 10, 11])
    assert clusters(t) == [
        ("policy0", [0, 1, 2, 3], "uniform", "Cortex-A78AE", 115200, 2201600, "schedutil"),
        ("policy4", [4, 5, 6, 7], "uniform", "Cortex-A78AE", 115200, 2201600, "schedutil"),
        ("policy8", [8, 9, 10, 11], "uniform", "Cortex-A78AE", 115200, 2201600, "schedutil")]
    first, _, offline = t.cpu.clusters
    assert first.scaling_max_khz == 1728000  # the nvpmodel MODE_30W cap
    assert first.available_khz is not None and len(first.available_khz) == 29
    assert (first.available_khz[0], first.available_khz[-1]) == (115200, 2201600)
    assert offline.online_cpus == [] and offline.idle_states == []
    assert [(s.name, s.latency_us, s.residency_us, s.disabled) for s in t.cpu.idle_states] == [
        ("WFI", 1, 1, False), ("c7", 2000, 10000, False)]
    assert t.memory.total_bytes == 65879896064
    assert [(n.id, n.cpus) for n in t.memory.numa_nodes] == [(0, list(range(12)))]


def test_agx_orin_gpu_dla_thermal_rails_fans() -> None:
    t = board("jetson-agx-orin-jp6")
    (gpu,) = t.gpus
    assert (gpu.name, gpu.vendor, gpu.kind, gpu.devfreq, gpu.driver) == (
        "ga10b", "nvidia", "integrated", "17000000.ga10b", "gk20a")
    assert (gpu.min_hz, gpu.max_hz, gpu.limit_max_hz, gpu.governor) == (
        306000000, 1301250000, 612000000, "nvhost_podgov")
    assert [(n.name, n.driver, n.cores) for n in t.npus] == [("dla0", "nvdla", 1),
                                                               ("dla1", "nvdla", 1)]
    zones = {z.type: (z.zone, z.temp_c) for z in t.thermal}
    assert zones["gpu-thermal"] == ("thermal_zone5", None)  # -256 °C: powered down
    assert zones["cv2-thermal"] == ("thermal_zone9", None)
    assert zones["cpu-thermal"] == ("thermal_zone3", 46.781)
    assert zones["tj-thermal"] == ("thermal_zone2", 47.218)
    assert "PMIC-Die" not in zones
    assert [(r.name, r.voltage_mv, r.current_ma, r.power_mw, r.source, r.sensor)
            for r in t.power_rails] == [
        ("VDD_GPU_SOC", 19280, 168, 3239.04, "ina3221", "1-0040"),
        ("VDD_CPU_CV", 19280, 40, 771.2, "ina3221", "1-0040"),
        ("VIN_SYS_5V0", 5024, 792, 3979.008, "ina3221", "1-0040"),
        ("VDDQ_VDD2_1V8AO", 5024, 120, 602.88, "ina3221", "1-0041")]
    assert sorted((f.name, f.pwm, f.rpm) for f in t.fans) == [
        ("generic_pwm_tachometer", None, 1980), ("pwmfan", 86, None)]
    # mq-deadline sets nr_requests to twice the 64 MMC tags (blk_mq_init_sched)
    assert [(b.name, b.model, b.scheduler, b.nr_requests) for b in t.block] == [
        ("mmcblk0", "DG4064", "mq-deadline", 128), ("nvme0n1", "Samsung SSD 980 PRO 1TB", "none",
                                                   1023)]
    assert (t.block[1].io_poll, t.block[1].io_poll_delay, t.block[1].rotational) == (0, -1, False)
    nvme = next(d for d in t.pci if d.driver == "nvme")
    assert (nvme.bdf, nvme.class_, nvme.link_speed_gts, nvme.link_width, nvme.numa_node) == (
        "0004:01:00.0", "0x010802", 16.0, 4, None)
    assert (t.kernel.preempt_rt, t.kernel.preempt_model, t.kernel.io_uring) == (
        False, "PREEMPT", None)
    assert t.kernel.sched_rt_runtime_us == 950000


def test_orin_nano_gpu_found_by_of_node_name_gpu() -> None:
    t = board("jetson-orin-nano-jp6")
    assert (t.board.family, t.board.module, t.board.module_name) == (
        "jetson", "p3767-0005", "Jetson Orin Nano (devkit)")
    assert [(c.policy, c.cpus, c.max_khz) for c in t.cpu.clusters] == [
        ("policy0", [0, 1, 2, 3], 1728000), ("policy4", [4, 5], 1728000)]
    (gpu,) = t.gpus
    assert (gpu.name, gpu.devfreq, gpu.min_hz, gpu.max_hz) == (
        "ga10b", "17000000.gpu", 306000000, 1020000000)
    assert t.npus == []  # Orin Nano has no DLA
    assert {z.type for z in t.thermal if z.temp_c is None} == {
        "cv0-thermal", "cv1-thermal", "cv2-thermal"}
    assert [(r.name, r.power_mw) for r in t.power_rails] == [
        ("VDD_IN", 5080 * 1180 / 1000), ("VDD_CPU_GPU_CV", 5080 * 245 / 1000),
        ("VDD_SOC", 5080 * 380 / 1000)]


def test_rk3588_vendor_big_little_mali_rknpu() -> None:
    t = board("rk3588-vendor")
    assert (t.board.family, t.board.soc, t.board.model) == (
        "rockchip", "rk3588", "Radxa ROCK 5 Model B")
    a76 = [408000, 600000, 816000, 1008000, 1200000, 1416000, 1608000, 1800000, 2016000,
           2208000, 2400000]
    assert clusters(t) == [
        ("policy0", [0, 1, 2, 3], "little", "Cortex-A55", 408000, 1800000, "schedutil"),
        ("policy4", [4, 5], "big", "Cortex-A76", 408000, 2400000, "schedutil"),
        ("policy6", [6, 7], "big", "Cortex-A76", 408000, 2400000, "schedutil")]
    assert t.cpu.clusters[1].available_khz == a76
    big = t.cpu.clusters[1]
    assert [(s.name, s.latency_us, s.residency_us) for s in big.idle_states] == [
        ("WFI", 1, 1), ("cpu-sleep", 220, 1000)]
    assert ("/sys/devices/system/cpu/cpu5/cpuidle/state1/residency: expected an integer, got "
            "'garbage'") in t.warnings
    (gpu,) = t.gpus  # dmc is the memory controller, not a GPU
    assert (gpu.name, gpu.vendor, gpu.devfreq, gpu.driver, gpu.min_hz, gpu.max_hz) == (
        "mali-bifrost", "arm", "fb000000.gpu", "mali", 300000000, 1000000000)
    (npu,) = t.npus
    assert (npu.name, npu.driver, npu.cores, npu.devfreq, npu.device) == (
        "rknpu", "rknpu", 3, "fdab0000.npu", "/dev/dri/renderD129")
    assert (npu.min_hz, npu.max_hz, npu.load_pct, npu.version) == (
        300000000, 1000000000, [12, 0, 5], "v0.9.6")
    assert [z.name for z in t.thermal] == ["gpu", "soc", "npu", "bigcore1", "littlecore",
                                           "center", "bigcore0"]
    assert [(r.name, r.voltage_mv) for r in t.power_rails] == [
        ("vdd_cpu_big0_s0", 850.0), ("vdd_cpu_big1_s0", 850.0), ("vdd_npu_s0", 850.0),
        ("vdd_gpu_s0", 675.0), ("vdd_cpu_lit_s0", 750.0), ("vdd_log_s0", 750.0)]
    assert [b.name for b in t.block] == ["mmcblk0", "nvme0n1"]  # ram0, loop, boot parts gone
    kernel = t.kernel
    assert (kernel.psi, kernel.io_uring, kernel.preempt_rt, kernel.preempt_model) == (
        False, None, False, "none")
    assert (kernel.thp.enabled, kernel.thp.cmdline) == ("never", "never")
    assert kernel.cgroup_v2 and "cpuset" in kernel.cgroup_controllers
    assert t.memory.total_bytes == 16474476544


def test_rk3588_mainline_rt_rocket_panthor() -> None:
    t = board("rk3588-mainline")
    assert (t.kernel.preempt_rt, t.kernel.preempt_model, t.kernel.io_uring,
            t.kernel.io_uring_disabled) == (True, "PREEMPT_RT", True, 0)
    assert [(c.policy, c.min_khz, c.max_khz) for c in t.cpu.clusters] == [
        ("policy0", 1008000, 1800000), ("policy4", 1200000, 2400000),
        ("policy6", 1200000, 2400000)]
    (gpu,) = t.gpus
    assert (gpu.name, gpu.driver, gpu.devfreq) == ("mali-valhall-csf", "panthor", "fb000000.gpu")
    (npu,) = t.npus
    assert (npu.name, npu.driver, npu.cores, npu.device, npu.devfreq) == (
        "rocket", "rocket", 3, "/dev/accel/accel0", None)
    assert "package" in {z.name for z in t.thermal}


def test_x86_server_numa_nvme_and_nvml_gpu() -> None:
    t = board("x86-server-nvidia")
    assert (t.board.family, t.board.model, t.board.vendor) == (
        "x86", "Supermicro SYS-120U-TNR (X12DPU-6)", "Supermicro")
    assert t.cpu.count == 16 and len(t.cpu.clusters) == 16  # acpi-cpufreq: policy per CPU
    policy3 = t.cpu.clusters[3]
    assert (policy3.policy, policy3.cpus, policy3.cur_khz, policy3.max_khz) == (
        "policy3", [3], 3299907, 2801000)  # turbo above cpuinfo_max is reported as is
    assert policy3.available_khz is not None and policy3.available_khz[0] == 800000
    assert [(n.id, n.cpus, n.total_bytes) for n in t.memory.numa_nodes] == [
        (0, list(range(8)), 65291868 * 1024), (1, list(range(8, 16)), 66042268 * 1024)]
    (gpu,) = t.gpus  # the ASPEED BMC VGA is no compute GPU
    assert (gpu.name, gpu.kind, gpu.source, gpu.pci_bdf, gpu.numa_node, gpu.memory_bytes,
            gpu.driver) == ("NVIDIA L4", "discrete", "nvml", "0000:99:00.0", 1, 24_152_899_584,
                            "nvidia")
    (coral,) = t.npus
    assert (coral.name, coral.driver, coral.device) == ("coral-edgetpu-pcie", "apex",
                                                        "/dev/apex_0")
    assert [(b.name, b.model) for b in t.block] == [
        ("nvme0n1", "Samsung SSD 980 PRO 1TB"), ("nvme1n1", "SAMSUNG MZQL23T8HCLS-00A07")]
    (rail,) = t.power_rails
    assert (rail.source, rail.voltage_mv, rail.current_ma, rail.power_mw) == (
        "ina238", 12048, 3520, 42408.96)
    assert [z.type for z in t.thermal] == ["x86_pkg_temp", "acpitz", "x86_pkg_temp"]
    assert t.kernel.thp.enabled == "always" and not t.kernel.preempt_rt
    assert not any("NVML" in w for w in t.warnings)


def test_x86_server_without_nvml_keeps_pci_facts() -> None:
    t = discover(Root(FIXTURES / "x86-server-nvidia"))
    (gpu,) = t.gpus
    assert (gpu.source, gpu.pci_bdf, gpu.numa_node, gpu.memory_bytes) == (
        "pci", "0000:99:00.0", 1, None)
    assert any(w.startswith("NVML not queried") for w in t.warnings)


def test_x86_edge_hybrid_npu_hailo_coral_usb() -> None:
    t = board("x86-edge-npu")
    p_cores = [c for c in t.cpu.clusters if c.core_type == "big"]
    e_cores = [c for c in t.cpu.clusters if c.core_type == "little"]
    assert sorted(c for cl in p_cores for c in cl.cpus) == list(range(12))
    assert sorted(c for cl in e_cores for c in cl.cpus) == [12, 13, 14, 15]
    assert {(c.core_name, c.max_khz, c.available_khz, c.scaling_driver) for c in e_cores} == {
        ("E-core", 3800000, None, "intel_pstate")}
    assert p_cores[0].available_governors == ["performance", "powersave"]
    assert t.cpu.isolated == [12, 13, 14, 15]
    (gpu,) = t.gpus
    assert (gpu.vendor, gpu.kind, gpu.driver, gpu.pci_bdf) == ("intel", "integrated", "i915",
                                                               "0000:00:02.0")
    assert [(n.name, n.driver, n.device, n.max_hz) for n in t.npus] == [
        ("intel-npu", "intel_vpu", "/dev/accel/accel0", 1_400_000_000),
        ("hailo8", "hailo", "/dev/hailo0", None),
        ("coral-edgetpu-usb", None, t.npus[2].device, None)]
    assert (t.kernel.io_uring_disabled, t.kernel.io_uring, t.kernel.sched_rt_runtime_us) == (
        1, True, -1)
    (nvme,) = t.block
    assert (nvme.scheduler, nvme.available_schedulers) == (
        "bfq", ["mq-deadline", "kyber", "bfq", "none"])


def test_bare_vm_has_nothing_but_cpus_memory_and_virtio() -> None:
    t = board("bare-vm")
    assert (t.board.family, t.board.model, t.board.virtual) == ("x86", None, True)
    assert [(c.policy, c.cpus, c.min_khz, c.core_type) for c in t.cpu.clusters] == [
        (None, [0, 1], None, "uniform")]
    assert t.cpu.idle_states == [] and t.cpu.idle_driver == "none"
    assert (t.gpus, t.npus, t.thermal, t.power_rails, t.fans) == ([], [], [], [], [])
    assert [(b.name, b.model, b.scheduler) for b in t.block] == [("vda", None, "none")]
    assert (t.kernel.cgroup_v2, t.kernel.cgroup_mode, t.kernel.cgroup_controllers) == (
        False, "hybrid", [])
    assert t.memory.total_bytes == 8335282176
    assert t.warnings == []


@pytest.mark.parametrize("name", BOARDS)
def test_fixture_discovery_never_touches_the_host(name: str) -> None:
    """A fixture's answers come from the fixture: the host's kernel release never leaks in."""
    import os

    assert board(name).kernel.release != os.uname().release or name == "bare-vm"
    assert board(name).root == str(FIXTURES / name)
