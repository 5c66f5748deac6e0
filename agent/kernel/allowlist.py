"""The tuning knobs the filesystem layer lets the agent write, and the kernel trees their
resolved targets must stay in: one reviewed list, kept apart from the layer that enforces it."""

from __future__ import annotations

# Tuning knobs the agent may change; everything else is read-only to it.  ``*`` matches
# within one path component, ``**`` matches any number of components.
WRITABLE_PATTERNS: tuple[str, ...] = (
    "/sys/devices/system/cpu/cpufreq/policy*/scaling_governor",
    "/sys/devices/system/cpu/cpufreq/policy*/scaling_min_freq",
    "/sys/devices/system/cpu/cpufreq/policy*/scaling_max_freq",
    "/sys/devices/system/cpu/cpufreq/policy*/energy_performance_preference",
    "/sys/devices/system/cpu/cpufreq/boost",
    "/sys/devices/system/cpu/intel_pstate/no_turbo",
    "/sys/devices/system/cpu/cpu*/cpuidle/state*/disable",  # journals from before PM QoS
    "/sys/devices/system/cpu/cpu*/power/pm_qos_resume_latency_us",
    "/sys/class/devfreq/*/governor",
    "/sys/class/devfreq/*/min_freq",
    "/sys/class/devfreq/*/max_freq",
    "/sys/class/devfreq/*/device/railgate_enable",  # nvgpu (Jetson iGPU)
    "/sys/kernel/debug/bpmp/debug/clk/emc/rate",  # Jetson BPMP clock debugfs
    "/sys/kernel/debug/bpmp/debug/clk/emc/mrq_rate_locked",
    "/sys/devices/platform/pwm-fan*/hwmon/hwmon*/pwm1",
    "/sys/devices/pwm-fan*/hwmon/hwmon*/pwm1",  # Xavier (L4T): the DT node's device at the top
    "/sys/kernel/mm/transparent_hugepage/enabled",
    "/sys/kernel/mm/transparent_hugepage/defrag",
    "/sys/kernel/mm/transparent_hugepage/khugepaged/defrag",
    "/sys/block/*/queue/scheduler",
    "/sys/block/*/queue/nr_requests",
    "/sys/block/*/queue/read_ahead_kb",
    "/sys/block/*/queue/io_poll",
    "/sys/block/*/queue/io_poll_delay",
    "/sys/block/*/queue/rq_affinity",
    "/sys/block/*/queue/wbt_lat_usec",
    "/sys/block/*/queue/nomerges",
    "/sys/block/*/queue/add_random",
    "/sys/block/*/queue/max_sectors_kb",
    "/sys/module/nvme/parameters/poll_queues",
    "/sys/module/nvme_core/parameters/default_ps_max_latency_us",
    "/sys/class/nvme/*/power/pm_qos_latency_tolerance_us",  # a controller's live APST limit
    "/sys/fs/cgroup/**/cgroup.subtree_control",
    "/sys/fs/cgroup/**/cgroup.procs",
    "/sys/fs/cgroup/**/cgroup.threads",
    "/sys/fs/cgroup/**/cgroup.type",
    "/sys/fs/cgroup/**/memory.max",
    "/sys/fs/cgroup/**/memory.high",
    "/sys/fs/cgroup/**/cpu.max",
    "/sys/fs/cgroup/**/cpu.weight",
    "/sys/fs/cgroup/**/cpuset.cpus",
    "/sys/fs/cgroup/**/cpuset.mems",
    "/sys/fs/cgroup/**/cpuset.cpus.partition",
    "/proc/irq/*/smp_affinity",
    "/proc/irq/*/smp_affinity_list",
    "/proc/irq/default_smp_affinity",
    "/proc/sys/kernel/sched_rt_runtime_us",
    "/sys/devices/virtual/workqueue/cpumask",  # unbound workqueues' CPUs (rt.workqueue_cpus)
    "/proc/sys/kernel/io_uring_disabled",
    "/proc/sys/kernel/io_uring_group",
    "/proc/sys/vm/*",
    # the sysctl tuner's allowlist beyond vm.* (agent/tuning/tuners/sysctl.py)
    "/proc/sys/kernel/timer_migration",
    "/proc/sys/kernel/nmi_watchdog",
    "/proc/sys/kernel/numa_balancing",
    "/proc/sys/net/core/busy_poll",
    "/proc/sys/net/core/busy_read",
    "/sys/module/pcie_aspm/parameters/policy",
    # the vendor rknpu driver's power hold and idle power-off delay (debugfs)
    "/sys/kernel/debug/rknpu/power",
    "/sys/kernel/debug/rknpu/delayms",
    # rocket (mainline) NPU cores' runtime PM: kept resumed, and the autosuspend delay
    "/sys/devices/platform/**/*.npu/power/control",
    "/sys/devices/platform/**/*.npu/power/autosuspend_delay_ms",
)

# A symlink may redirect an allowlisted name, but never out of these kernel trees.
WRITABLE_TREES: tuple[str, ...] = ("/sys", "/proc/sys", "/proc/irq")
