"""The nvpmodel power mode as a journaled setting (Kind ``nvpmodel``, path ``nvpmodel:mode``).

The value is the mode id as a string (``"2"``).  Reading it is the active mode in
``/var/lib/nvpmodel/status`` (``pmode:0002``), else the conf's default.  Writing it runs
``/usr/sbin/nvpmodel -m N`` as a fixed argv (never a shell), stdin closed so a prompt can never
wait for an answer, with a timeout; the exit status is checked and so is the status file
afterwards.  The mode survives a reboot (nvpmodel reapplies it at boot from the status
file), so the change is ``persistent`` and its original lives in the persistent journal.

A switch that changes the GPU's TPC power-gating mask (``TPC_POWER_GATING TPC_PG_MASK`` in
the mode blocks) only takes effect after a reboot: nvpmodel then asks whether to reboot now.
The agent never reboots a device, so such a switch is refused (at plan time, and here again
should a journal ask for one).

Below a fixture root (``--root DIR``, the tests) there is no nvpmodel to run: a model
stands in that does what ``nvpmodel -m`` does to the status file, the state the kind reads.
It does not rewrite the mode's cpufreq/devfreq limits.
"""

from __future__ import annotations

import errno
import subprocess
from collections.abc import Callable
from pathlib import Path

from agent.kernel.fsroot import Root
from agent.tuning import nvpmodel
from agent.tuning.nvpmodel import NvpmodelConf, PowerMode

PATH = "nvpmodel:mode"
COMPARE = "nvpmodel"
NVPMODEL = "/usr/sbin/nvpmodel"  # nvidia-l4t-nvpmodel; a fixed path, never looked up in PATH
TIMEOUT_S = 60.0  # a switch onlines/offlines CPUs and rewrites clocks: seconds, not minutes
TPC = ("TPC_POWER_GATING", "TPC_PG_MASK")

# argv -> (exit status, stdout and stderr); injected by tests
Runner = Callable[[list[str]], tuple[int, str]]


def run_command(argv: list[str]) -> tuple[int, str]:
    """Run ``argv`` without a shell, stdin closed, within TIMEOUT_S; OSError on a timeout."""
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise OSError(errno.ETIMEDOUT, f"{' '.join(argv)}: no answer within "
                      f"{TIMEOUT_S:.0f} s") from None
    return done.returncode, (done.stdout + done.stderr).strip()


def reboot_reason(conf: NvpmodelConf, active: PowerMode | None, wanted: PowerMode) -> str | None:
    """Why switching from ``active`` to ``wanted`` needs a reboot, or None when it does not.

    A mode without a TPC_PG_MASK line leaves the mask alone; an unknown active mode with a
    wanted mask counts as a change (nvpmodel would compare with what it last set)."""
    want = wanted.values.get(TPC)
    have = active.values.get(TPC) if active else None
    if want is None or want == have:
        return None
    was = f"mode {active.id} ({active.name})" if active else "the active mode"
    return (f"switching from {was} to mode {wanted.id} ({wanted.name}) changes "
            f"{' '.join(TPC)} ({have if have is not None else 'unknown'} -> {want}) in "
            f"{nvpmodel.CONF}: nvpmodel then asks to reboot, and the agent never reboots a "
            f"device; switch by hand ('sudo nvpmodel -m {wanted.id}', then reboot) and apply "
            "the profile after that")


class NvpmodelMode:
    """The Kind for ``nvpmodel:mode``: read the active mode id, switch with nvpmodel -m."""

    persistent = True

    def __init__(self, run: Runner | None = None) -> None:
        self.run = run  # None: nvpmodel itself on the host, the status-file model elsewhere

    def read(self, root: Root, path: str) -> str | None:
        conf = nvpmodel.load_conf(root)
        mode = nvpmodel.active_mode_id(root, conf) if conf is not None else None
        return None if mode is None else str(mode)

    def write(self, root: Root, path: str, value: str) -> None:
        if path != PATH:
            raise OSError(errno.EINVAL, f"{path}: the nvpmodel kind sets only {PATH}")
        conf = nvpmodel.load_conf(root)
        if conf is None:
            raise OSError(errno.ENOENT, f"{nvpmodel.CONF}: no nvpmodel configuration here")
        wanted = conf.find(value.strip())
        if wanted is None:
            raise OSError(errno.EINVAL, f"nvpmodel mode {value!r} is not in {nvpmodel.CONF} "
                          f"(allowed: {conf.allowed()})")
        active_id = nvpmodel.active_mode_id(root, conf)
        if active_id == wanted.id:
            return
        reason = reboot_reason(conf, conf.modes.get(active_id) if active_id is not None
                               else None, wanted)
        if reason is not None:
            raise OSError(errno.EPERM, reason)
        if root.is_host or self.run is not None:
            argv = [NVPMODEL, "-m", str(wanted.id)]
            status, output = (self.run or run_command)(argv)
            if status != 0:
                raise OSError(errno.EIO, f"{' '.join(argv)} exited with status {status}"
                              + (f": {output}" if output else ""))
        else:
            switch_model(root, wanted)
        now = self.read(root, path)
        if now != str(wanted.id):
            raise OSError(errno.EIO, f"nvpmodel -m {wanted.id} returned, but "
                          f"{nvpmodel.STATUS} shows mode {now}")


def switch_model(root: Root, mode: PowerMode) -> None:
    """What ``nvpmodel -m`` leaves in the status file, for a fixture root."""
    Path(root.host_path(nvpmodel.STATUS)).write_text(f"pmode:{mode.id:04d}\n")
