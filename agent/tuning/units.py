"""The systemd boundary: the data plane's slice and scopes, through fixed argv, never a shell.

Under systemd, systemd owns the cgroup tree: the agent neither writes into its own unit's
cgroup nor enables controllers there (on systemd < 254 that puts ``ExecReload=`` and
``ExecStopPost=`` processes into an inner node, which the no-internal-process rule refuses).
The data plane runs as a transient scope (``systemd-run --scope``) in ``edge_agent.slice``,
and a profile's limits are that slice's runtime properties (``systemctl set-property
--runtime``): they apply to every data-plane process, survive its restarts, and vanish at
reboot with /run, as the tuning journal's boot-id rule expects.  Only the agent's own units
are ever changed.  ``systemctl show`` values are normalised to the form ``set-property``
takes, so a journaled original is restored exactly.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass

from agent.kernel.parsers import format_cpulist, parse_cpulist

CONTROL = "/run/systemd/system.control"  # where set-property --runtime writes its drop-ins
# A journaled restore value: set the original, then remove the runtime drop-in that
# set-property left, since none was there before the profile (docs/kernel-facts/ineffective.md)
UNSET = "\0unset:"
SLICE = "edge_agent.slice"  # an underscore: a dash would nest it in edge.slice
SCOPE_PREFIX = "edge-agent-serve-"
TIMEOUT_S = 15.0


@dataclass(frozen=True)
class Property:
    name: str  # what set-property takes
    shown: str  # what systemctl show prints (CPUQuota= is shown per second of CPU time)
    controller: str  # the cgroup controller systemd enables for it


# profile key (cgroup section) -> unit property
PROPERTIES: dict[str, Property] = {
    "memory_max": Property("MemoryMax", "MemoryMax", "memory"),
    "memory_high": Property("MemoryHigh", "MemoryHigh", "memory"),
    "cpu_max": Property("CPUQuota", "CPUQuotaPerSecUSec", "cpu"),
    "cpu_weight": Property("CPUWeight", "CPUWeight", "cpu"),
    "cpus": Property("AllowedCPUs", "AllowedCPUs", "cpuset"),
    "mems": Property("AllowedMemoryNodes", "AllowedMemoryNodes", "cpuset"),
}
BY_NAME = {p.name: p for p in PROPERTIES.values()}
NOT_SET = ("", "[not set]", "18446744073709551615")  # systemd 252 / 249 spell "unset" so
_SPAN = re.compile(r"(\d+(?:\.\d+)?)(us|ms|s|min|h)")
_SPAN_US = {"us": 1, "ms": 1000, "s": 1_000_000, "min": 60_000_000, "h": 3_600_000_000}


class UnitError(OSError):
    """systemd refused or could not be asked; the message has systemctl's own words."""

    def __str__(self) -> str:
        return str(self.strerror)


def check_owned(unit: str) -> None:
    """The agent changes its own units only: the slice and the data plane's scopes."""
    if unit != SLICE and not (unit.startswith(SCOPE_PREFIX) and unit.endswith(".scope")):
        raise UnitError(errno.EPERM, f"{unit}: not one of the agent's own units ({SLICE}, "
                        f"{SCOPE_PREFIX}*.scope); refused")


def dropin_path(unit: str, name: str) -> str:
    """The drop-in ``systemctl set-property --runtime UNIT NAME=...`` writes (logical path)."""
    return f"{CONTROL}/{unit}.d/50-{name}.conf"


def quota_percent(shown: str) -> str:
    """``CPUQuotaPerSecUSec=800ms`` (or ``1.500s``, ``infinity``) -> ``80%`` (``""``: none)."""
    if shown in ("infinity", *NOT_SET):
        return ""
    parts = _SPAN.findall(shown)
    if not parts or "".join(a + u for a, u in parts) != shown.replace(" ", ""):
        raise ValueError(f"not a systemd time span: {shown!r}")
    usec = sum(float(amount) * _SPAN_US[unit] for amount, unit in parts)
    percent = usec / 10_000
    return f"{percent:g}%"


def normalise(name: str, shown: str) -> str:
    """A ``systemctl show`` value in ``set-property`` form: what restores it exactly."""
    shown = shown.strip()
    if name == "CPUQuota":
        return quota_percent(shown)
    if name in ("MemoryMax", "MemoryHigh"):
        return "infinity" if shown in ("infinity", "max", *NOT_SET) else str(int(shown))
    if name in ("AllowedCPUs", "AllowedMemoryNodes"):
        return format_cpulist(parse_cpulist(shown.replace(" ", ",")))
    if name == "CPUWeight":
        return "" if shown in NOT_SET else shown
    return shown


class Units:
    """``systemctl`` and ``systemd-run``: each call is one fixed argv; ``run`` is the seam a
    fake (or the fixture-root model) replaces."""

    spawns = True  # False for a model: there is no systemd to start a scope through

    def run(self, argv: list[str]) -> str:
        binary = shutil.which(argv[0])
        if binary is None:
            raise UnitError(errno.ENOENT, f"{argv[0]} is not installed: systemd's tools are "
                            "needed to place the data plane")
        try:
            done = subprocess.run([binary, *argv[1:]], capture_output=True, text=True,
                                  timeout=TIMEOUT_S, check=False, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise UnitError(errno.ETIMEDOUT, f"{' '.join(argv)}: no answer from systemd in "
                            f"{TIMEOUT_S:.0f} s") from None
        if done.returncode != 0:
            raise UnitError(errno.EIO, f"{' '.join(argv)}: "
                            f"{done.stderr.strip() or f'exit status {done.returncode}'}")
        return done.stdout

    def show(self, unit: str, names: Iterable[str]) -> dict[str, str]:
        """Unit properties by ``set-property`` name, in ``set-property`` form."""
        wanted = {BY_NAME[n].shown if n in BY_NAME else n: n for n in names}
        output = self.run(["systemctl", "show", f"--property={','.join(wanted)}", "--", unit])
        values: dict[str, str] = {}
        for line in output.splitlines():
            key, sep, value = line.partition("=")
            if sep and key in wanted:
                try:
                    values[wanted[key]] = normalise(wanted[key], value)
                except ValueError as error:
                    raise UnitError(errno.EINVAL, f"{unit}: {key}={value}: {error}") from None
        return values

    def set_runtime(self, unit: str, name: str, value: str) -> None:
        """One runtime property (gone at reboot); only on the agent's own units.  A value
        marked ``UNSET`` is set and then its drop-in removed: the unit is left as it was
        before any runtime property, not holding the original as one."""
        check_owned(unit)
        self.run(["systemctl", "set-property", "--runtime", "--", unit,
                  f"{name}={value.removeprefix(UNSET)}"])
        if value.startswith(UNSET):
            self.remove_dropin(unit, name)

    def remove_dropin(self, unit: str, name: str) -> None:
        """Remove the property's runtime drop-in (and its directory once empty), then
        daemon-reload so systemd does not report the unit changed on disk."""
        path = dropin_path(unit, name)
        try:
            os.remove(path)
        except FileNotFoundError:
            return
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(path))
        self.run(["systemctl", "daemon-reload"])

    def scope_command(self, scope: str, argv: list[str]) -> list[str]:
        """``argv`` as a transient scope in the slice: systemd-run registers the scope and
        then execs ``argv``, so the process stays the caller's child (same pid, exit status
        and PR_SET_PDEATHSIG).  ``--collect``: a scope that failed (OOM kill) is not kept."""
        check_owned(scope)
        return ["systemd-run", "--scope", "--quiet", "--collect", "--no-ask-password",
                f"--unit={scope}", f"--slice={SLICE}",
                "--description=edge-agent data plane (edge-agent serve)", "--", *argv]
