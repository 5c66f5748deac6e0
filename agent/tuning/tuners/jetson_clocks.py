"""``jetson_clocks:``: what NVIDIA's jetson_clocks script does, as journaled changes.

jetson_clocks itself is never run: its ``--store``/``--restore`` keeps one file in root's
home and ``--restore`` fails without a prior store.  Each of its writes here is an ordinary
planned change, so rollback restores every original byte for byte, in reverse order:

- ``gpu: max``: devfreq ``min_freq`` = ``max_freq`` (Documentation/ABI/testing/
  sysfs-class-devfreq), through the dvfs tuner's limit ordering, so min <= max holds after
  every write.  The max is the one in force after the plan: the wanted nvpmodel mode's GPU
  cap when the profile switches the mode.
- ``railgate: off``: nvgpu's ``railgate_enable`` = 0 in the GPU device directory (the GPU
  stays powered: no rail-ungate latency on the first kernel after idle).
- ``emc: max|<Hz>``: the memory clock through the BPMP debugfs clock interface
  (``/sys/kernel/debug/bpmp/debug/clk/emc``): ``mrq_rate_locked`` = 1 first, so BPMP's
  own EMC scaling no longer moves it, then ``rate`` = ``max_rate`` or the nvpmodel EMC cap,
  whichever is lower.  It needs root and a mounted debugfs (Documentation/filesystems/
  debugfs.rst: nothing below it is a stable ABI), so a profile lists it under ``optional``.
- ``fan: max|<0-255>``: pwm-fan's hwmon ``pwm1`` (Documentation/hwmon/pwm-fan.rst,
  sysfs-interface.rst: 0..255).  nvfancontrol rewrites it every polling interval; the plan
  warns when its service is installed or enabled (stopping it is the operator's choice).
  While this plan pins clocks (``gpu``, ``emc``, a dvfs minimum) a duty below ``FAN_FLOOR``
  is refused.  Rollback does not write the old duty back: it hands the fan to nvfancontrol
  or the thermal governor (:mod:`agent.tuning.fan`), as jetson_clocks --restore gives
  ``temp_control`` back on L4T's own pwm-fan driver.

Not done, unlike jetson_clocks: disabling every cpuidle state on every CPU (an idle=poll-like
burn for the whole SoC; use ``cpuidle.disable_deeper_than_us`` on the inference cores) and
onlining every core (that is the nvpmodel mode's choice; CPU min = max is ``dvfs.cpu``).
"""

from __future__ import annotations

from typing import Any

from agent.kernel.reader import SysReader
from agent.tuning import fan, nvpmodel
from agent.tuning.plan import PlanContext
from agent.tuning.tuners import dvfs
from agent.tuning.tuners.jetson import planned_mode, report_caps

DEVFREQ = "/sys/class/devfreq"
DEBUGFS = "/sys/kernel/debug"
EMC = f"{DEBUGFS}/bpmp/debug/clk/emc"
HWMON = "/sys/class/hwmon"
# the lowest duty while clocks are pinned: half the fan's airflow (a policy, not a kernel
# fact: pinned clocks leave thermal throttling as the only other relief)
FAN_FLOOR = 128
TUNER = "jetson_clocks"


def _mode_cap(ctx: PlanContext, param: str, path: str | None = None) -> int | None:
    """The planned mode's MAX_FREQ cap of ``param`` in Hz (None: no cap, no conf); with
    ``path``, only when the conf's MAX_FREQ file for it is that path."""
    conf = nvpmodel.load_conf(ctx.root)
    mode = planned_mode(ctx, conf) if conf is not None else None
    if conf is None or mode is None:
        return None
    if path is not None:
        real = ctx.root.realpath(path)
        if not any(ctx.root.exists(p) and ctx.root.realpath(p) == real
                   for p in conf.clock_paths.get((param, "MAX_FREQ"), [])):
            return None
    value = mode.values.get((param, "MAX_FREQ"))
    return value if value is not None and value > 0 else None


def _mode_changes(ctx: PlanContext) -> bool:
    return any(c.compare == "nvpmodel" for c in ctx.changes)


def _gpu(ctx: PlanContext) -> None:
    key = f"{TUNER}.gpu"
    nodes = [g.devfreq for g in ctx.topology.gpus if g.devfreq]
    if not nodes:
        ctx.lacking(key, "this device has no GPU devfreq node", "gpu: max on a Jetson iGPU")
        return
    reader = SysReader(ctx.root)
    for node in nodes:
        directory = f"{DEVFREQ}/{node}"
        available = reader.integers(f"{directory}/available_frequencies") or None
        top = max(available) if available else reader.integer(f"{directory}/max_freq")
        target = int(ctx.current(f"{directory}/max_freq", key))
        if _mode_changes(ctx):  # nvpmodel -m rewrites max_freq to the new mode's cap
            cap = _mode_cap(ctx, "GPU", f"{directory}/max_freq")
            target = min(cap, top) if cap is not None and top is not None else (top or target)
        offered = (available, reader.integer(f"{directory}/min_freq"), top)
        dvfs._limits(ctx, key, directory, ("min_freq", "max_freq"), {"min_hz": target},
                     offered, "hz", "devfreq")


def _railgate(ctx: PlanContext) -> None:
    for gpu in ctx.topology.gpus:
        if gpu.devfreq:
            ctx.want(TUNER, f"{DEVFREQ}/{gpu.devfreq}/device/railgate_enable", "0",
                     f"{TUNER}.railgate", lacking=(
                         ": this GPU driver has no railgate_enable (JetPack 7.2 and Thor gate "
                         "the GPU through power/control)", "railgate: off where nvgpu has "
                         "railgate_enable"),
                     note="GPU rail gating off: the GPU stays powered")


def _emc(ctx: PlanContext, wanted: int | str) -> None:
    key = f"{TUNER}.emc"
    if not ctx.root.exists(EMC):
        mounted = ctx.root.is_dir(DEBUGFS) and bool(SysReader(ctx.root).listdir(DEBUGFS))
        what = (f"{EMC} does not exist: BPMP exposes no emc clock in debugfs here"
                if mounted else f"debugfs not mounted at {DEBUGFS} (mount -t debugfs none "
                f"{DEBUGFS}, as root), so {EMC} does not exist")
        ctx.lacking(key, what, "emc: max or a rate in Hz where the BPMP debugfs clock "
                    "interface exists (root, debugfs mounted)")
        return
    low = int(ctx.current(f"{EMC}/min_rate", key))
    high = int(ctx.current(f"{EMC}/max_rate", key))
    cap = _mode_cap(ctx, "EMC")
    mode = _mode_name(ctx)
    if wanted == "max":
        rate = min(high, cap) if cap is not None else high
    else:
        rate = int(wanted)
        if not low <= rate <= high:
            raise ctx.error(key, f"{rate} Hz is outside {EMC}'s range {low}..{high} Hz; "
                            "allowed: max, or a rate in that range")
        if cap is not None and rate > cap:
            ctx.warnings.append(f"{key}: {rate} Hz is above the EMC cap {cap} Hz of nvpmodel "
                                f"mode {mode}; change the mode for more")
    ctx.want(TUNER, f"{EMC}/mrq_rate_locked", "1", key,
             note="BPMP's EMC scaling no longer moves the rate")
    ctx.want(TUNER, f"{EMC}/rate", str(rate), key,
             note=f"EMC held at {rate} Hz (max_rate {high} Hz" + (
                 f", nvpmodel {mode} cap {cap} Hz)" if cap is not None else ")"))


def _mode_name(ctx: PlanContext) -> str:
    conf = nvpmodel.load_conf(ctx.root)
    mode = planned_mode(ctx, conf) if conf is not None else None
    return mode.name if mode is not None else "unknown"


def _pinned(section: dict[str, Any], ctx: PlanContext) -> list[str]:
    """The keys of this plan that hold clocks up (a frequency floor raised, EMC locked)."""
    keys = [f"{TUNER}.{k}" for k in ("gpu", "emc") if k in section]
    keys += sorted({c.key for c in ctx.changes if c.key.startswith("dvfs.")
                    and c.path.endswith(("/min_freq", "/scaling_min_freq"))
                    and c.desired.isdigit() and (c.current or "").isdigit()
                    and int(c.desired) > int(c.current or 0)})
    return keys


def _fan(ctx: PlanContext, wanted: int | str, pinned: list[str]) -> None:
    key = f"{TUNER}.fan"
    reader = SysReader(ctx.root)
    fans = [ctx.root.realpath(f"{HWMON}/{h}") for h in reader.listdir(HWMON)
            if (reader.text(f"{HWMON}/{h}/name") or "").strip() == "pwmfan"]
    if not fans:
        ctx.lacking(key, "this device has no pwm-fan hwmon (name pwmfan)",
                    "fan: max or 0-255 where a pwm-fan is present")
        return
    duty = 255 if wanted == "max" else int(wanted)
    if pinned and duty < FAN_FLOOR:
        raise ctx.error(key, f"{duty} is below the fan floor {FAN_FLOOR} (50 % duty) while "
                        f"the plan pins clocks ({', '.join(pinned)}): the SoC then makes "
                        "full-power heat even when idle and only throttling would be left "
                        "to cool it; "
                        f"allowed: max or {FAN_FLOOR}..255, or no fan key (nvfancontrol and "
                        "the thermal governor keep the fan)")
    found = fan.nvfancontrol(ctx.root)
    if found is not None:
        ctx.warnings.append(f"{key}: nvfancontrol.service is {found[0]} ({found[1]}): while "
                            "it runs it overwrites pwm1 every polling interval, which verify "
                            "reports as drift; stop it ('sudo systemctl stop nvfancontrol') "
                            "for a fixed fan: rollback starts an enabled one again")
    for pwm1 in fans:
        current = ctx.current(f"{pwm1}/pwm1", key, fan.COMPARE)
        ctx.want(TUNER, f"{pwm1}/pwm1", str(duty), key, fan.COMPARE,
                 restore=fan.handback(current, str(duty), fan.cooling_state(ctx.root)),
                 note="rollback hands the fan back to nvfancontrol or the thermal governor")


def plan(section: dict[str, Any], ctx: PlanContext) -> None:
    if ctx.topology.board.family != "jetson":
        ctx.lacking(TUNER, f"this device is a {ctx.topology.board.family} board, not an "
                    "NVIDIA Jetson", "jetson_clocks on an NVIDIA Jetson")
        return
    conf = nvpmodel.load_conf(ctx.root)  # without one (a container) there are no caps
    if section.get("gpu") == "max":
        _gpu(ctx)
    if section.get("railgate") in ("off", False):
        _railgate(ctx)
    if "emc" in section:
        _emc(ctx, section["emc"])
    if "fan" in section:
        _fan(ctx, section["fan"], _pinned(section, ctx))
    if conf is not None:
        report_caps(ctx, conf)
