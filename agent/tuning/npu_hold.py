"""The vendor rknpu driver's power hold as a journaled setting (Kind ``rknpu_hold``, path
``/sys/kernel/debug/rknpu/power``; docs/kernel-facts/ineffective.md, "rknpu power").

Writing ``on`` there takes a hold (``cmdline_power_refcount``, and ``rknpu_power_get``: the
regulators, clocks and runtime PM of the NPU).  The file *reads* ``on`` whenever
``power_refcount`` is above 0, which a running job or the idle power-off delay also makes
true, so the word cannot show that the hold was taken.  The hold is therefore always written
(whatever the file reads), rollback writes ``off`` (which drops the holds taken through the
file, never a job's), and the value read back is the word checked against what the hold
does: the RKNPU platform device's runtime PM status is ``active`` (where sysfs shows it).
"""

from __future__ import annotations

from agent.kernel.fsroot import Root

COMPARE = "rknpu_hold"
POWER = "/sys/kernel/debug/rknpu/power"
RUNTIME_STATUS = "/sys/bus/platform/drivers/RKNPU/*/power/runtime_status"


def runtime_statuses(root: Root) -> list[str]:
    """``power/runtime_status`` of each device the RKNPU driver is bound to."""
    statuses = []
    for path in root.glob(RUNTIME_STATUS):
        try:
            statuses.append(root.read_text(path).strip())
        except OSError:
            continue
    return statuses


class RknpuHold:
    persistent = False

    def read(self, root: Root, path: str) -> str | None:
        """``on`` only when power is on and the device is runtime-active; else what is
        seen (``off``, or ``on`` with the status that contradicts it)."""
        try:
            word = root.read_text(path).strip()
        except FileNotFoundError:
            return None
        inactive = [s for s in runtime_statuses(root) if s != "active"]
        if word == "on" and inactive:
            return f"on, but runtime_status {inactive[0]}"
        return word

    def write(self, root: Root, path: str, value: str) -> None:
        root.write_text(path, value)
