"""Loop devices made and removed through /dev/loop-control, so that tests cause real
uevents without touching a device that exists on the host."""

from __future__ import annotations

import errno
import fcntl
import os
import time
from pathlib import Path

TIMEOUT_S = 5.0
LOOP_CTL_ADD = 0x4C80  # <linux/loop.h>
LOOP_CTL_REMOVE = 0x4C81


class LoopDevices:
    """Creates and removes loop devices through /dev/loop-control, to cause real uevents."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self.created: set[str] = set()

    def add(self) -> str:
        # Far above the numbers in use, so `losetup -f` elsewhere is unlikely to pick ours.
        names = os.listdir("/sys/class/block")
        taken = [int(n[4:]) for n in names if n.startswith("loop") and n[4:].isdigit()]
        number = max([*taken, 0]) + 100
        while True:
            try:
                fcntl.ioctl(self._fd, LOOP_CTL_ADD, number)
            except FileExistsError:
                number += 1
                continue
            name = f"loop{number}"
            self.created.add(name)
            return name

    def change(self, name: str) -> None:
        Path("/sys/class/block", name, "uevent").write_text("change")

    def remove(self, name: str) -> None:
        """Remove ``name``, waiting out a transient EBUSY (udevd probing it, where one runs)."""
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            try:
                fcntl.ioctl(self._fd, LOOP_CTL_REMOVE, int(name[4:]))
            except OSError as exc:
                if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
                continue
            self.created.discard(name)
            return
