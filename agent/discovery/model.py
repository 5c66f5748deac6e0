"""The topology contract (``schema: topology/1``) as dataclasses.

Field names are the JSON keys; units are in the names.  The topology/1 keys are a contract:
new keys may be added, none renamed or removed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

SCHEMA = "topology/1"


@dataclass
class Board:
    family: str  # jetson | rockchip | x86 | generic
    model: str | None = None
    soc: str | None = None
    compatible: list[str] = field(default_factory=list)
    arch: str | None = None
    virtual: bool | None = None  # a hypervisor was detected (x86 cpuinfo flag)
    vendor: str | None = None
    module: str | None = None  # Jetson module part, e.g. p3701-0005
    module_name: str | None = None
    l4t: str | None = None
    jetpack: str | None = None


@dataclass
class IdleState:
    name: str
    latency_us: int | None
    residency_us: int | None
    disabled: bool | None
    state: str = ""  # sysfs directory, e.g. state1
    disabled_cpus: list[int] = field(default_factory=list)


@dataclass
class Cluster:
    id: int
    cpus: list[int]
    policy: str | None
    core_type: str | None  # big | mid | little | uniform
    min_khz: int | None  # hardware range (cpuinfo_*), not the current limits
    max_khz: int | None
    available_khz: list[int] | None
    governor: str | None
    available_governors: list[str] | None
    core_name: str | None = None
    capacity: int | None = None
    online_cpus: list[int] = field(default_factory=list)
    scaling_min_khz: int | None = None
    scaling_max_khz: int | None = None
    cur_khz: int | None = None
    scaling_driver: str | None = None
    idle_states: list[IdleState] = field(default_factory=list)


@dataclass
class Cpu:
    count: int
    online: list[int]
    offline: list[int] = field(default_factory=list)
    isolated: list[int] = field(default_factory=list)
    clusters: list[Cluster] = field(default_factory=list)
    idle_states: list[IdleState] = field(default_factory=list)
    idle_driver: str | None = None


@dataclass
class NumaNode:
    id: int
    cpus: list[int]
    total_bytes: int | None


@dataclass
class Memory:
    total_bytes: int | None
    swap_total_bytes: int | None = None
    numa_nodes: list[NumaNode] = field(default_factory=list)


@dataclass
class Gpu:
    name: str
    vendor: str
    kind: str  # integrated | discrete
    devfreq: str | None = None
    min_hz: int | None = None
    max_hz: int | None = None
    available_hz: list[int] | None = None
    governor: str | None = None
    available_governors: list[str] | None = None
    pci_bdf: str | None = None
    numa_node: int | None = None
    memory_bytes: int | None = None
    driver: str | None = None
    source: str = "sysfs"  # devfreq | pci | nvml | drm
    uuid: str | None = None
    limit_min_hz: int | None = None  # current limits (devfreq, nvpmodel caps, i915/xe min/max)
    limit_max_hz: int | None = None
    cur_hz: int | None = None
    drm_card: str | None = None  # "card1": the DRM card its driver registered
    sysfs: str | None = None  # the resolved device directory


@dataclass
class Npu:
    name: str
    driver: str | None
    cores: int | None
    devfreq: str | None = None
    device: str | None = None  # /dev node
    min_hz: int | None = None
    max_hz: int | None = None
    vendor: str | None = None
    available_hz: list[int] | None = None
    governor: str | None = None
    load_pct: list[int] | None = None
    sysfs: str | None = None
    version: str | None = None
    limit_min_hz: int | None = None
    limit_max_hz: int | None = None
    cur_hz: int | None = None
    core_sysfs: list[str] = field(default_factory=list)  # one device per core (Rocket)


@dataclass
class ThermalZone:
    zone: str
    type: str
    name: str  # normalised type: -therm/-thermal/_tegra dropped, lower case
    temp_c: float | None


@dataclass
class PowerRail:
    name: str
    voltage_mv: float | None
    current_ma: float | None
    power_mw: float | None
    source: str  # chip driver: ina3221, ina238, regulator, ...
    sensor: str | None = None  # hwmon or regulator directory


@dataclass
class Fan:
    name: str
    sensor: str
    pwm: int | None = None
    pwm_enable: int | None = None
    rpm: int | None = None


@dataclass
class BlockDevice:
    name: str
    model: str | None
    rotational: bool | None
    scheduler: str | None
    available_schedulers: list[str] | None
    nr_requests: int | None
    read_ahead_kb: int | None
    io_poll: int | None
    io_poll_delay: int | None
    size_bytes: int | None = None
    max_sectors_kb: int | None = None
    max_hw_sectors_kb: int | None = None
    wbt_lat_usec: int | None = None  # None: no writeback throttling (CONFIG_BLK_WBT off)
    nomerges: int | None = None
    add_random: int | None = None
    tag_depth: int | None = None  # hardware tags per queue (mq/*/nr_tags); None: bio-based
    hw_queues: int | None = None  # blk-mq hardware contexts (mq/*), poll ones included
    poll_queues: int | None = None  # HCTX_TYPE_POLL contexts (debugfs); None: not readable


@dataclass
class PciDevice:
    bdf: str
    vendor_id: str | None
    device_id: str | None
    class_: str | None
    driver: str | None
    numa_node: int | None
    link_speed: str | None
    link_width: int | None
    link_speed_gts: float | None = None


@dataclass
class Thp:
    enabled: str | None
    defrag: str | None
    khugepaged_defrag: int | None = None
    cmdline: str | None = None  # transparent_hugepage= set by the admin: do not override


@dataclass
class Kernel:
    release: str | None
    version: str | None
    preempt_rt: bool
    preempt_model: str | None
    cgroup_v2: bool
    cgroup_mode: str | None  # v2 | hybrid | v1
    cgroup_controllers: list[str]
    thp: Thp
    io_uring: bool | None
    io_uring_disabled: int | None
    psi: bool
    cmdline: str | None = None
    sched_rt_runtime_us: int | None = None
    io_uring_group: int | None = None  # kernel.io_uring_group (6.6+); -1: no group
    # how io_uring stands: enabled | restricted (disabled=1: CAP_SYS_ADMIN or the group) |
    # disabled (sysctl 2) | blocked (EPERM: sysctl or seccomp) | not built (ENOSYS)
    io_uring_status: str | None = None
    nvme_poll_queues: int | None = None  # nvme.poll_queues module parameter


@dataclass
class UdevDeviceInfo:
    subsystem: str
    sys_name: str
    devnode: str | None
    driver: str | None


@dataclass
class Udev:
    used: bool
    devices: list[UdevDeviceInfo] = field(default_factory=list)


@dataclass
class RuntimeVersion:
    """An inference runtime found on the root: its version and the file that said so."""
    version: str | None
    path: str
    source: str  # library | dpkg | version.json | version.txt | dist-info


@dataclass
class Runtimes:
    """Vendor runtimes the backends need; null where absent."""
    librknnrt: RuntimeVersion | None = None
    tensorrt: RuntimeVersion | None = None
    cuda: RuntimeVersion | None = None
    openvino: RuntimeVersion | None = None
    onnxruntime: RuntimeVersion | None = None  # this interpreter's distribution (host only)


@dataclass
class Topology:
    board: Board
    cpu: Cpu
    memory: Memory
    gpus: list[Gpu]
    npus: list[Npu]
    thermal: list[ThermalZone]
    power_rails: list[PowerRail]
    fans: list[Fan]
    block: list[BlockDevice]
    pci: list[PciDevice]
    kernel: Kernel
    udev: Udev
    root: str
    warnings: list[str]
    schema: str = SCHEMA
    runtimes: Runtimes = field(default_factory=Runtimes)

    def to_dict(self) -> dict[str, Any]:
        """The JSON contract: ``schema`` first, ``class_`` spelled ``class``."""
        body = dataclasses.asdict(self)
        for device in body["pci"]:
            device["class"] = device.pop("class_")
        return {"schema": body.pop("schema"), **body}
