"""Block devices and their request-queue parameters.

Queue files: https://docs.kernel.org/block/queue-sysfs.html.
"""

from __future__ import annotations

import re

from agent.discovery.model import BlockDevice
from agent.kernel import parsers
from agent.kernel.reader import SysReader

BLOCK = "/sys/block"
SECTOR_BYTES = 512  # /sys/block/X/size counts 512-byte sectors whatever the device's blocks
_VIRTUAL = re.compile(r"^(loop|ram|zram|mtdblock)\d+$|^mmcblk\d+(boot\d+|rpmb)$")


def parse_scheduler(text: str) -> tuple[str, list[str]]:
    """``[none] mq-deadline kyber`` -> (current, all); a lone ``none`` has no brackets."""
    words = text.split()
    if len(words) == 1 and not words[0].startswith("["):
        return words[0], words
    return parsers.parse_selection(text)


def _model(reader: SysReader, path: str) -> str | None:
    """NVMe/SCSI devices have ``model``; MMC cards (eMMC, SD) call it ``name``."""
    for attribute in ("model", "name"):
        if reader.exists(f"{path}/device/{attribute}"):
            return reader.text(f"{path}/device/{attribute}") or None
    return None


def discover_block(reader: SysReader) -> list[BlockDevice]:
    devices = []
    for name in reader.listdir(BLOCK):
        path = f"{BLOCK}/{name}"
        if _VIRTUAL.match(name) or not reader.exists(f"{path}/device"):
            continue
        queue = f"{path}/queue"
        scheduler = reader.parsed(f"{queue}/scheduler", parse_scheduler)
        rotational = reader.integer(f"{queue}/rotational")
        sectors = reader.integer(f"{path}/size")
        devices.append(BlockDevice(
            name=name, model=_model(reader, path),
            rotational=None if rotational is None else rotational == 1,
            scheduler=scheduler[0] if scheduler else None,
            available_schedulers=scheduler[1] if scheduler else None,
            nr_requests=reader.integer(f"{queue}/nr_requests"),
            read_ahead_kb=reader.integer(f"{queue}/read_ahead_kb"),
            io_poll=reader.integer(f"{queue}/io_poll"),
            io_poll_delay=reader.integer(f"{queue}/io_poll_delay"),
            size_bytes=sectors * SECTOR_BYTES if sectors is not None else None))
    return devices
