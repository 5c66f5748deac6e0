"""Settings that are not one kernel file: how each kind of change is read and written.

``KINDS`` is keyed by ``Change.compare``; the engine's writes and reads, and the plan's
current values, go through it for those compares.  A persistent kind survives a reboot (a
boot config, a file below /etc), so its originals go to the persistent journal, which the
boot-id rule never discards: the reboot that activates such a setting must not throw away
what rollback needs.

"file" is a whole small config file below an allowlist of exact paths, confined below the
root like the boot files (resolved inside it, atomic replace with fsync).  Its value is the
file's text; ``ABSENT`` restores "did not exist".  These paths stay out of
:mod:`agent.kernel.fsroot`'s sysfs allowlist, whose single-write(2) semantics suit kernel
knobs, not files that must be replaced whole.
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
import os
import subprocess
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

from agent.kernel.fsroot import Root
from agent.tuning import bootargs
from agent.tuning.bootargs import PREFIX, CmdlineKind
from agent.tuning.fan import FanKind
from agent.tuning.npu_hold import RknpuHold
from agent.tuning.nvpmodel_mode import NvpmodelMode

if TYPE_CHECKING:
    from agent.overlays.bootfs import ConfinedFiles

logger = logging.getLogger(__name__)

ABSENT = "\0absent"  # a file's value when it does not exist (no text file holds a NUL)
FILE_PATTERNS = ("/etc/default/irqbalance", "/etc/systemd/system/*.d/edge-agent-*.conf")
IRQBALANCE = "/etc/default/irqbalance"
DROP_INS = "/etc/systemd/system/*.d/edge-agent-*.conf"
# Fixed argvs (never a shell) run after such files changed, on the real root only: irqbalance
# reads its environment file when it starts (only restarted when it runs: try-restart);
# systemd reads drop-ins on daemon-reload, applied when the unit next starts.
FOLLOW_UPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (IRQBALANCE, ("systemctl", "try-restart", "irqbalance.service")),
    (DROP_INS, ("systemctl", "daemon-reload")))


class Kind(Protocol):
    persistent: bool  # survives a reboot: journaled in the persistent journal

    def read(self, root: Root, path: str) -> str | None:
        """The value verify compares; None when there is nothing."""

    def write(self, root: Root, path: str, value: str) -> None: ...


def _allowed(path: str) -> bool:
    return any(fnmatch.fnmatchcase(path, pattern) and path.count("/") == pattern.count("/")
               for pattern in FILE_PATTERNS)


class FileKind:
    """A whole config file of ``FILE_PATTERNS``, replaced atomically."""

    persistent = True

    @staticmethod
    def _files(root: Root) -> ConfinedFiles:
        from agent.overlays.bootfs import ConfinedFiles
        return ConfinedFiles(root, _allowed, "the allowlisted config files (" +
                             ", ".join(FILE_PATTERNS) + ")")

    def read(self, root: Root, path: str) -> str | None:
        data = self._files(root).read(path)
        return None if data is None else data.decode("utf-8", errors="surrogateescape")

    def write(self, root: Root, path: str, value: str) -> None:
        files = self._files(root)
        if value != ABSENT:
            files.write(path, value.encode("utf-8", errors="surrogateescape"))
            return
        files.remove(path)
        if fnmatch.fnmatchcase(path, DROP_INS):  # the drop-in directory edge-agent made
            with contextlib.suppress(OSError):
                os.rmdir(os.path.dirname(files.host_path(path)))


KINDS: dict[str, Kind] = {"file": FileKind(), "cmdline": CmdlineKind(),
                          "nvpmodel": NvpmodelMode(), "rknpu_hold": RknpuHold(),
                          "fan": FanKind()}


def follow_ups(root: Root, paths: Iterable[str]) -> list[str]:
    """Run each follow-up the written paths need once; notes saying what was (not) run.
    Kernel arguments take their boot layout's (update-grub, u-boot-update)."""
    written = set(paths)
    notes = []
    needed = [argv for pattern, argv in FOLLOW_UPS
              if any(fnmatch.fnmatchcase(p, pattern) for p in written)]
    if any(p.startswith(PREFIX) for p in written):
        needed += [argv for argv in [bootargs.follow_up(root)] if argv]
    for argv in needed:
        if not root.is_host:
            notes.append(f"not run below a fixture root: {' '.join(argv)}")
            continue
        try:
            done = subprocess.run(list(argv), capture_output=True, text=True, timeout=60,
                                  check=False)
        except (OSError, subprocess.TimeoutExpired) as error:
            notes.append(f"{' '.join(argv)}: {error}")
            continue
        notes.append(f"ran {' '.join(argv)}" + ("" if done.returncode == 0 else
                     f": exit {done.returncode}: {done.stderr.strip()[:200]}"))
    return notes
