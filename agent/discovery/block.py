"""Block devices and their request-queue parameters.

Queue files: https://docs.kernel.org/block/queue-sysfs.html.
"""

from __future__ import annotations

import errno
import re

from agent.discovery.model import BlockDevice
from agent.kernel import parsers
from agent.kernel.reader import SysReader

BLOCK = "/sys/block"
DEBUGFS_BLOCK = "/sys/kernel/debug/block"
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
            size_bytes=sectors * SECTOR_BYTES if sectors is not None else None,
            max_sectors_kb=reader.integer(f"{queue}/max_sectors_kb"),
            max_hw_sectors_kb=reader.integer(f"{queue}/max_hw_sectors_kb"),
            wbt_lat_usec=_wbt(reader, f"{queue}/wbt_lat_usec"),
            nomerges=reader.integer(f"{queue}/nomerges"),
            add_random=reader.integer(f"{queue}/add_random"),
            **_hw_queues(reader, name, f"{path}/mq")))
    return devices


def _wbt(reader: SysReader, path: str) -> int | None:
    """wbt_lat_usec; a queue without writeback throttling set up reads EINVAL (5.10), and
    kernels built without CONFIG_BLK_WBT have no file."""
    if not reader.exists(path):
        return None
    return reader.integer(path, tolerate=(errno.EINVAL,))


def _hw_queues(reader: SysReader, name: str, mq: str) -> dict[str, int | None]:
    """Hardware contexts (``mq/N``), their tag depth, and how many are poll queues.

    sysfs does not say a context's type; debugfs does (``block/<disk>/hctxN/type``: default,
    read or poll; blk-mq-debugfs.c), and it is root-only and may be unmounted: then None.
    A context count without the type cannot tell poll queues apart, so it is not guessed."""
    contexts = [n for n in reader.listdir(mq) if n.isdigit()] if reader.exists(mq) else []
    if not contexts:
        return {"tag_depth": None, "hw_queues": None, "poll_queues": None}
    debugfs = f"{DEBUGFS_BLOCK}/{name}"
    types = [reader.text(f"{debugfs}/hctx{n}/type", tolerate=(errno.EACCES, errno.EPERM))
             for n in contexts] if reader.exists(debugfs) else []
    return {"tag_depth": reader.integer(f"{mq}/{min(contexts, key=int)}/nr_tags"),
            "hw_queues": len(contexts),
            "poll_queues": types.count("poll") if types and None not in types else None}
