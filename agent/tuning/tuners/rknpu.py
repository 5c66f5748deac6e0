"""The vendor rknpu driver's power settings (Rockchip BSP kernels; debugfs, root only).

drivers/rknpu/rknpu_debugger.c exposes, below /sys/kernel/debug/rknpu/:

- ``delayms``: how long the driver keeps the NPU powered after its last job before the
  delayed power-off work runs (rknpu_drv.c sets 3000 ms at probe).  A power-up costs
  regulator, clock and reset time on the next job, so a latency profile raises it.  It reads
  back ``%lu``; a non-number is refused with EFAULT.
- ``power``: ``on`` takes a power reference the driver counts apart from jobs
  (cmdline_power_refcount) and ``off`` drops all of them; it *reads* ``on`` while any
  reference (a job, or the idle delay) holds power, and ignores other words.

Mainline kernels (rocket accel driver) have neither; the files are absent there.
"""

from __future__ import annotations

from typing import Any

from agent.tuning.plan import PlanContext

DEBUGFS = "/sys/kernel/debug/rknpu"
ABSENT = (" (no vendor rknpu driver, or debugfs is not mounted)",
          "the Rockchip BSP kernel's rknpu driver with debugfs mounted")


def plan(section: dict[str, Any], ctx: PlanContext) -> None:
    if "power_off_delay_ms" in section:
        ctx.want("rknpu", f"{DEBUGFS}/delayms", str(section["power_off_delay_ms"]),
                 "rknpu.power_off_delay_ms", lacking=ABSENT)
    if "power" in section:
        power = section["power"]
        word = power if isinstance(power, str) else ("on" if power else "off")
        ctx.want("rknpu", f"{DEBUGFS}/power", word, "rknpu.power", lacking=ABSENT,
                 note="a power hold: 'on' while it reads off, released by rollback" if
                 word == "on" else None)
