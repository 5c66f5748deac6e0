"""CPU latency QoS: the per-CPU resume latency value, and the system-wide /dev/cpu_dma_latency
hold that reverts by itself.

Documentation/power/pm_qos_interface.rst: a process that opens /dev/cpu_dma_latency adds a
CPU latency request; writing a binary s32 (or, with any other length, a hex string) sets it;
closing the file removes it.  So the hold lives exactly as long as the file descriptor:
the kernel drops it when the agent stops or crashes, and nothing needs to be journaled.
"""

from __future__ import annotations

import os
import struct
from typing import ClassVar

from agent.kernel.fsroot import Root

DMA_LATENCY = "/dev/cpu_dma_latency"
_S32 = struct.Struct("=i")  # native byte order, as the kernel copies it from user space


def resume_latency_value(us: int) -> str:
    """What ``pm_qos_resume_latency_us`` takes for "no state with a longer exit latency":
    0 there means "no constraint", so 0 us is written as "n/a" (sysfs-devices-power)."""
    if us < 0:
        raise ValueError(f"a resume latency is >= 0 us, not {us}")
    return "n/a" if us == 0 else str(us)


class LatencyHold:
    """/dev/cpu_dma_latency held open with ``us`` written, until :meth:`release`.

    On the real root this is the kernel's request.  Below a fixture root the device is a
    plain file holding the s32 the device reads, the CPU latency target: the lowest value
    of the holds open on it, or what it held before the first (the default), as the
    kernel aggregates the requests (PM_QOS_MIN) and drops each one as its file closes.
    """

    _fixture: ClassVar[dict[str, tuple[bytes, list[LatencyHold]]]] = {}  # path: default, holds

    def __init__(self, root: Root, us: int) -> None:
        if not 0 <= us < 2**31 - 1:
            raise ValueError(f"a CPU latency is 0..{2**31 - 2} us, not {us}")
        self.root, self.us = root, us
        self._path = root.host_path(DMA_LATENCY)
        self._fd: int | None = os.open(self._path, os.O_WRONLY if root.is_host else os.O_RDWR)
        try:
            if root.is_host:
                written = os.write(self._fd, _S32.pack(us))
                if written != _S32.size:
                    raise OSError(f"{DMA_LATENCY}: short write ({written} of 4 bytes)")
            else:
                self._fixture.setdefault(
                    self._path, (os.pread(self._fd, _S32.size, 0), []))[1].append(self)
                self._fixture_target()
        except OSError:
            self.release()
            raise

    def _fixture_target(self) -> None:
        """A fixture device reads the lowest open request, else its default."""
        default, holds = self._fixture[self._path]
        target = _S32.pack(min(h.us for h in holds)) if holds else default
        fd = os.open(self._path, os.O_WRONLY)
        try:
            os.pwrite(fd, target, 0)
        finally:
            os.close(fd)
        if not holds:
            del self._fixture[self._path]

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Close the device: the kernel removes the request.  Idempotent."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            entry = self._fixture.get(self._path)
            if entry is not None and self in entry[1]:
                entry[1].remove(self)
                self._fixture_target()
        finally:
            os.close(fd)
