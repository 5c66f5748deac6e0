"""NVMe autonomous power-state transitions (APST): the deepest non-operational state's exit
latency a controller may use (docs/kernel-facts/ineffective.md, "NVMe APST").

drivers/nvme/host/core.c reads the ``nvme_core.default_ps_max_latency_us`` module parameter
once per controller, in nvme_init_ctrl, as the controller's user latency tolerance; writing
the parameter later changes nothing for controllers already probed.  The live knob is that
tolerance, ``/sys/class/nvme/nvmeN/power/pm_qos_latency_tolerance_us`` (drivers/base/power/
sysfs.c; nvme_set_latency_tolerance reprograms APST on a write; 0 turns APST off).  It exists
only on controllers that support APST (dev_pm_qos_expose_latency_tolerance).  So the profile's
value goes to every live controller, to the parameter (controllers hot-plugged later), and to
the kernel command line through the cmdline tuner (after a reboot, and before the first
probe).
"""

from __future__ import annotations

from typing import Any

from agent.kernel.reader import SysReader
from agent.tuning.bootargs import BootConfigError, config_path
from agent.tuning.plan import PlanContext
from agent.tuning.tuners import cmdline

PARAMETER = "default_ps_max_latency_us"
MODULE_PARAMETER = f"/sys/module/nvme_core/parameters/{PARAMETER}"
CONTROLLERS = "/sys/class/nvme"
TOLERANCE = "power/pm_qos_latency_tolerance_us"
KEY = f"nvme.{PARAMETER}"


def plan(section: dict[str, Any], ctx: PlanContext) -> None:
    if PARAMETER not in section:
        return
    value = str(section[PARAMETER])
    for name in sorted(SysReader(ctx.root).listdir(CONTROLLERS)):
        path = f"{CONTROLLERS}/{name}/{TOLERANCE}"
        if not ctx.root.exists(path):
            ctx.warnings.append(f"{KEY}: {name} skipped: it does not support APST (no "
                                f"{TOLERANCE}), so there is no latency to limit")
            continue
        ctx.want("nvme", path, value, KEY, note=f"{name}'s APST latency limit, live")
    ctx.want("nvme", MODULE_PARAMETER, value, KEY,
             lacking=(" (the nvme_core module is not loaded)", "a device with NVMe"),
             note="only for controllers probed later (hot-plug); the live ones are set "
                  "through their pm_qos_latency_tolerance_us")
    try:
        config_path(ctx.root)
    except BootConfigError as error:
        ctx.warnings.append(f"{KEY}: not kept across a reboot: no boot config edge-agent can "
                            f"edit for nvme_core.{PARAMETER}= ({error}); the live value "
                            "lasts until then")
        return
    cmdline.plan({f"nvme_core.{PARAMETER}": section[PARAMETER]}, ctx)
