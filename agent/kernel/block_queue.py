"""The block layer's rules for ``/sys/block/X/queue/*`` writes, per kernel version.

One place for what the kernel accepts, so the block tuner refuses at plan time what a write
would refuse at apply time, and fixture roots (see :func:`write`) refuse it too.  Sources:
Documentation/ABI/stable/sysfs-block and Documentation/block/queue-sysfs.rst, and the code in
block/blk-sysfs.c, blk-mq.c, blk-mq-tag.c and blk-mq-sched.c of 5.10, 5.15, 6.1 and 6.18:

- ``nr_requests``: a value below BLKDEV_MIN_RQ (4) is raised to 4.  With scheduler ``none``
  the request depth *is* the hardware tag depth (``mq/*/nr_tags``): more is EINVAL
  (blk_mq_tag_update_depth may not grow driver tags).  With a scheduler the scheduler tags may
  grow up to MAX_SCHED_RQ = 16 * BLKDEV_DEFAULT_RQ = 2048, more is EINVAL.  A value at or
  below the reserved tags is EINVAL.
- switching the scheduler resets ``nr_requests``: to the tag depth for ``none``
  (elevator_switch / blk_mq_exit_sched), to 2 * min(tag depth, 128) for a scheduler
  (blk_mq_init_sched; shared-tag sets keep the depth).  So the scheduler is written first.
- ``io_poll``: on 5.10-5.15 writing 0/1 turns polling off/on where the device has poll
  queues (HCTX_TYPE_POLL) and is EINVAL where it has none.  Since 5.16 ("block: don't allow
  writing to the poll queue attribute") the file reads 1 exactly when poll queues exist and a
  write is ignored there (EINVAL elsewhere): polling follows ``nvme.poll_queues``.
- ``io_poll_delay``: -1 classic polling, 0 adaptive hybrid, N > 0 sleep N us first (< -1 is
  EINVAL).  Hybrid polling was removed in 6.4 ("blk-mq: remove hybrid polling"): the file
  reads -1 and ignores writes.
- ``max_sectors_kb``: at most ``max_hw_sectors_kb`` and at least the page size in KiB, else
  EINVAL (queue_max_sectors_store; newer kernels clamp through queue limits instead).
- ``wbt_lat_usec`` (CONFIG_BLK_WBT): -1 restores the default target, 75000 us on rotational
  and 2000 us on other devices (wbt_default_latency_nsec); 0 turns throttling off; < -1 is
  EINVAL.  Without CONFIG_BLK_WBT the file is absent (6.x) or reads EINVAL (5.10).
- ``nomerges``: 0 merges, 1 only simple one-hit merges, 2 none; ``add_random``,
  ``rotational``: 0/1 (any non-zero reads back 1).
"""

from __future__ import annotations

import errno
import re
from pathlib import Path

from agent.kernel.attributes import emulate_attribute_write
from agent.kernel.pages import tree_page_size

BLKDEV_MIN_RQ = 4
BLKDEV_DEFAULT_RQ = 128
MAX_SCHED_RQ = 16 * BLKDEV_DEFAULT_RQ
IO_POLL_WRITES_IGNORED = (5, 16)  # io_poll reads the poll-queue state; writes are ignored
HYBRID_POLL_REMOVED = (6, 4)  # io_poll_delay reads -1, writes ignored
WBT_DEFAULT_USEC = {True: 75000, False: 2000}  # rotational -> default min latency target
NOMERGES = (0, 1, 2)

_RELEASE = re.compile(r"^(\d+)\.(\d+)")


def kernel_version(release: str | None) -> tuple[int, int] | None:
    """``5.15.148-tegra`` -> (5, 15); None when there is no release to read."""
    match = _RELEASE.match(release or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


def nr_requests_limit(scheduler: str | None, depth: int) -> int:
    """The largest nr_requests the kernel accepts with this scheduler and tag depth."""
    return depth if scheduler in (None, "none") else MAX_SCHED_RQ


def default_nr_requests(scheduler: str, depth: int) -> int:
    """What nr_requests reads right after switching to ``scheduler``."""
    return depth if scheduler == "none" else 2 * min(depth, BLKDEV_DEFAULT_RQ)


# -- the fixture model -----------------------------------------------------------------------

MODELLED = ("scheduler", "nr_requests", "io_poll", "io_poll_delay", "max_sectors_kb",
            "wbt_lat_usec", "nomerges", "add_random", "rotational")


def handles(logical: str) -> bool:
    parts = logical.split("/")
    return (len(parts) == 6 and parts[1:3] == ["sys", "block"] and parts[4] == "queue"
            and parts[5] in MODELLED)


def _integer(text: str, path: Path) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise OSError(errno.EINVAL, f"{path}: {text.strip()!r} is not a number") from None


def _read_int(path: Path, default: int) -> int:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return default


def tag_depth(base: Path, disk: Path) -> tuple[int | None, int]:
    """(hardware tag depth, reserved tags) from the first ``mq/N`` directory, else from
    debugfs ``block/<disk>/hctx0/tags`` (blk_mq_debugfs_tags_show: ``nr_tags=64``), where a
    fixture keeps the depth its kernel knows when the sysfs file is unreadable."""
    queues = sorted((disk / "mq").glob("*/nr_tags"))
    if queues:
        return _read_int(queues[0], 0), _read_int(queues[0].parent / "nr_reserved_tags", 0)
    tags = _text(base / "sys/kernel/debug/block" / disk.name / "hctx0/tags") or ""
    fields = dict(line.split("=", 1) for line in tags.splitlines() if "=" in line)
    if "nr_tags" not in fields:
        return None, 0
    return int(fields["nr_tags"]), int(fields.get("nr_reserved_tags", "0"))


def poll_queue_count(base: Path, name: str) -> int:
    """Poll hardware contexts of a disk, from debugfs ``block/<disk>/hctxN/type``."""
    types = (base / "sys/kernel/debug/block" / name).glob("hctx*/type")
    return sum(1 for t in types if t.read_text().strip() == "poll")


def _current_scheduler(queue: Path) -> str:
    text = (queue / "scheduler").read_text()
    found = re.search(r"\[([^\]]+)\]", text)
    return found.group(1) if found else text.strip()


def write(base: Path, target: Path, value: str) -> str | None:
    """The new content of a queue file after ``value`` is written to it below a fixture root
    ``base`` (a host path); None: the kernel ignores the write.  Raises OSError as the kernel
    does.  A scheduler switch also resets ``nr_requests`` beside it."""
    queue, name = target.parent, target.name
    disk = queue.parent
    version = kernel_version(_text(base / "proc/sys/kernel/osrelease")) or (99, 0)
    if name == "scheduler":
        before = _current_scheduler(queue)
        text = emulate_attribute_write(target.read_bytes(), value, str(target)).decode()
        wanted = value.strip()
        depth, _reserved = tag_depth(base, disk)
        if wanted != before and depth is not None and (queue / "nr_requests").exists():
            (queue / "nr_requests").write_text(f"{default_nr_requests(wanted, depth)}\n")
        return text
    number = _integer(value, target)
    if name == "nr_requests":
        return f"{_nr_requests(base, queue, disk, number, target)}\n"
    if name == "io_poll":
        if number < 0:
            raise OSError(errno.EINVAL, f"{target}: {number} is not an unsigned number")
        if not poll_queue_count(base, disk.name):
            raise OSError(errno.EINVAL, f"{target}: {disk.name} has no poll queues")
        return None if version >= IO_POLL_WRITES_IGNORED else f"{int(number != 0)}\n"
    if name == "io_poll_delay":
        if version >= HYBRID_POLL_REMOVED:
            return None
        if number < -1:
            raise OSError(errno.EINVAL, f"{target}: {number} < -1")
        return f"{number}\n"
    if name == "max_sectors_kb":
        hw = _read_int(queue / "max_hw_sectors_kb", 0)
        low = tree_page_size(base) // 1024
        if not low <= number <= hw:
            raise OSError(errno.EINVAL, f"{target}: {number} is outside {low}..{hw}")
        return f"{number}\n"
    if name == "wbt_lat_usec":
        if number < -1:
            raise OSError(errno.EINVAL, f"{target}: {number} < -1")
        if number == -1:
            number = WBT_DEFAULT_USEC[_read_int(queue / "rotational", 0) == 1]
        return f"{number}\n"
    if number < 0:
        raise OSError(errno.EINVAL, f"{target}: {number} is not an unsigned number")
    if name == "nomerges":
        return f"{2 if number == 2 else int(number != 0)}\n"
    return f"{int(number != 0)}\n"  # add_random, rotational


def _nr_requests(base: Path, queue: Path, disk: Path, number: int, target: Path) -> int:
    current = _read_int(target, 0)
    if number == current:
        return current
    number = max(number, BLKDEV_MIN_RQ)
    depth, reserved = tag_depth(base, disk)
    if depth is None:
        return number
    limit = nr_requests_limit(_current_scheduler(queue), depth)
    if number <= reserved or number > limit:
        raise OSError(errno.EINVAL, f"{target}: {number} is outside {reserved + 1}..{limit}")
    return number


def _text(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None
