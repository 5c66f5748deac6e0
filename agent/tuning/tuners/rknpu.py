"""Keeping the RK3588 NPU powered between jobs (docs/kernel-facts/ineffective.md, "rknpu
power").

Vendor BSP kernels (the rknpu driver, drivers/rknpu/rknpu_debugger.c) have, below
/sys/kernel/debug/rknpu/:

- ``delayms``: how long the driver keeps the NPU powered after its last job (rknpu_drv.c sets
  3000 ms at probe).  It reads back ``%lu``; a non-number is refused with EFAULT.
- ``power``: ``on`` takes a power hold (see :mod:`agent.tuning.npu_hold`: written whatever
  the file reads, since it reads ``on`` while a job or the idle delay holds power too, and
  verified against the device's runtime PM status); rollback writes ``off``.

Mainline kernels (the rocket accel driver, drivers/accel/rocket/rocket_core.c) power each
NPU core through runtime PM with a 50 ms autosuspend delay: ``power: on`` is
``power/control = on`` on every core (pm_runtime_forbid: resumed and kept so; it reads back
exactly), and ``power_off_delay_ms`` is each core's ``power/autosuspend_delay_ms``
(Documentation/ABI/testing/sysfs-devices-power).
"""

from __future__ import annotations

from typing import Any

from agent.tuning.npu_hold import COMPARE, POWER
from agent.tuning.plan import Change, PlanContext

DEBUGFS = "/sys/kernel/debug/rknpu"
ABSENT = (" (no vendor rknpu driver with debugfs mounted, and no rocket NPU cores)",
          "the Rockchip BSP kernel's rknpu driver with debugfs mounted, or rocket's cores")
ROCKET = "rocket"


def plan(section: dict[str, Any], ctx: PlanContext) -> None:
    cores = [core for npu in ctx.topology.npus if npu.driver == ROCKET
             for core in npu.core_sysfs]
    if cores and not ctx.root.is_dir(DEBUGFS):
        _plan_rocket(section, ctx, cores)
        return
    if "power_off_delay_ms" in section:
        ctx.want("rknpu", f"{DEBUGFS}/delayms", str(section["power_off_delay_ms"]),
                 "rknpu.power_off_delay_ms", lacking=ABSENT)
    if "power" in section:
        _plan_hold(ctx, _word(section["power"]))


def _word(power: Any) -> str:
    return power if isinstance(power, str) else ("on" if power else "off")


def _plan_hold(ctx: PlanContext, word: str) -> None:
    key = "rknpu.power"
    ctx.root.check_writable(POWER)
    if POWER not in ctx.baseline and not ctx.root.exists(POWER):
        ctx.lacking(key, f"{POWER} does not exist on this device{ABSENT[0]}", ABSENT[1])
        return
    current = ctx.current(POWER, key, COMPARE)
    if word == "off":
        if current.startswith("on"):
            ctx.warnings.append(f"{key}: off: nothing planned; {POWER} reads on while a job or "
                                "the idle power-off delay holds power, which off does not end "
                                "(it only drops holds taken through the file)")
        return
    ctx.changes.append(Change(
        tuner="rknpu", path=POWER, current=current, desired="on", key=key, compare=COMPARE,
        restore="off", note="a power hold, taken even where the file reads on (a job or the "
        "idle delay may hold power now and let go later); verified by the NPU's runtime PM "
        "status; rollback writes off, which drops every hold taken through the file"))


def _plan_rocket(section: dict[str, Any], ctx: PlanContext, cores: list[str]) -> None:
    lacking = (" (the core has no runtime PM attributes)", "a core with runtime PM")
    for core in cores:
        if "power" in section:
            word = _word(section["power"])
            ctx.want("rknpu", f"{core}/power/control", "on" if word == "on" else "auto",
                     "rknpu.power", lacking=lacking,
                     note="rocket core kept resumed (runtime PM forbidden)" if word == "on"
                     else None)
        if "power_off_delay_ms" in section:
            ctx.want("rknpu", f"{core}/power/autosuspend_delay_ms",
                     str(section["power_off_delay_ms"]), "rknpu.power_off_delay_ms",
                     lacking=lacking, note="rocket core's runtime PM autosuspend delay")
