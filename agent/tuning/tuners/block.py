"""Block queues per device-name pattern (NVMe power-state latency: :mod:`.nvme`).

Queue files: Documentation/block/queue-sysfs.rst and Documentation/ABI/stable/sysfs-block;
what the kernel accepts per version is in :mod:`agent.kernel.block_queue`.  Every limit is
checked here, at plan time, against the device and the planned scheduler:

- the scheduler is planned first: switching it resets ``nr_requests`` (blk_mq_init_sched), so
  a switch always journals ``nr_requests`` too and rollback restores it after the scheduler;
- ``nr_requests`` above what the kernel accepts is **refused** (not clamped): with ``none``
  that is the hardware tag depth, with a scheduler MAX_SCHED_RQ (2048).  A clamp would leave a
  profile that says 4096 verifying against 1023 on one board and 2048 on another; ``max``
  asks for the limit itself.  Below 4 the kernel raises it to 4 (BLKDEV_MIN_RQ): planned as 4.
  Where ``mq/*/nr_tags`` is unreadable the limit under ``none`` is the current nr_requests
  (which reads the tag depth there), never unbounded (docs/kernel-facts/ineffective.md).
- ``io_poll``/``io_poll_delay`` only where the device has poll queues and the kernel still
  honours the file (io_poll writes are ignored since 5.16, hybrid polling is gone since 6.4).
"""

from __future__ import annotations

import fnmatch
from typing import Any

from agent.discovery.model import BlockDevice
from agent.kernel import block_queue as bq
from agent.kernel.pages import page_size
from agent.tuning.plan import Change, PlanContext

ORDER = ("scheduler", "nr_requests")  # then the rest, as the profile lists them
RESET_NOTE = "switching to"
POLL_QUEUES_HINT = "boot with nvme.poll_queues=N (the cmdline: section) to get poll queues"


def plan(section: dict[str, Any], ctx: PlanContext) -> None:
    for pattern, wanted in section.items():
        devices = [d for d in ctx.topology.block if fnmatch.fnmatchcase(d.name, pattern)]
        if not devices:
            ctx.warnings.append(f"block.{pattern}: no block device matches; nothing to do")
        for device in devices:
            _plan_device(ctx, f"block.{pattern}", device, wanted)


def _plan_device(ctx: PlanContext, prefix: str, device: BlockDevice,
                 wanted: dict[str, Any]) -> None:
    queue = f"/sys/block/{device.name}/queue"
    planned = [c.desired for c in ctx.changes if c.path == f"{queue}/scheduler"]
    scheduler = planned[-1] if planned else device.scheduler  # another pattern's switch
    switched = False
    names = sorted(wanted, key=lambda n: ORDER.index(n) if n in ORDER else len(ORDER))
    for name in names:
        value, key = wanted[name], f"{prefix}.{name}"
        if name == "scheduler":
            switched = _plan_scheduler(ctx, key, device, value, "nr_requests" in wanted)
            scheduler = value
        elif name == "nr_requests":
            _plan_nr_requests(ctx, key, device, value, scheduler, switched)
        elif name in ("io_poll", "io_poll_delay"):
            _plan_polling(ctx, key, device, name, value)
        elif name == "max_sectors_kb":
            _plan_max_sectors(ctx, key, device, value)
        elif name == "wbt_lat_usec":
            _plan_wbt(ctx, key, device, value, scheduler)
        else:
            ctx.want("block", f"{queue}/{name}", str(value), key)


def _journal(ctx: PlanContext, path: str, desired: str, key: str, note: str) -> None:
    """A change recorded even where the file holds ``desired`` now: a scheduler switch
    will reset it, and rollback needs its original."""
    ctx.root.check_writable(path)
    ctx.changes.append(Change(tuner="block", path=path, current=ctx.current(path, key),
                              desired=desired, key=key, note=note))


def _plan_scheduler(ctx: PlanContext, key: str, device: BlockDevice, value: str,
                    sets_nr_requests: bool) -> bool:
    """Plan the switch; True when the scheduler changes (and so resets nr_requests)."""
    offered = device.available_schedulers or []
    if value not in offered:
        raise ctx.error(key, f"{value!r} is not offered by {device.name} "
                        f"(available: {', '.join(offered) or 'none'})")
    path = f"/sys/block/{device.name}/queue/scheduler"
    nr_path = f"/sys/block/{device.name}/queue/nr_requests"
    before = len(ctx.changes)
    ctx.want("block", path, value, key, compare="selection", resets=[nr_path])
    switched = len(ctx.changes) > before
    if switched and not sets_nr_requests and device.tag_depth is not None:
        # journal nr_requests, so rollback puts its original back after the original
        # scheduler (writing the value the switch leaves is a no-op)
        reset = bq.default_nr_requests(value, device.tag_depth)
        _journal(ctx, nr_path, str(reset), key, f"{RESET_NOTE} {value} resets nr_requests "
                 f"to {reset}; journaled so rollback restores it")
    return switched


def _plan_nr_requests(ctx: PlanContext, key: str, device: BlockDevice, value: int | str,
                      scheduler: str | None, switched: bool) -> None:
    path = f"/sys/block/{device.name}/queue/nr_requests"
    limit, why = _nr_requests_limit(ctx, key, device, scheduler)
    number = limit if value == "max" else int(value)
    if number > limit:
        raise ctx.error(key, f"{number} is more than {device.name} accepts: allowed "
                        f"{bq.BLKDEV_MIN_RQ}..{limit} ({why}), or max")
    if number < bq.BLKDEV_MIN_RQ:
        ctx.warnings.append(f"{key}: {number} on {device.name}: the kernel raises it to "
                            f"{bq.BLKDEV_MIN_RQ} (BLKDEV_MIN_RQ); planned as "
                            f"{bq.BLKDEV_MIN_RQ}")
        number = bq.BLKDEV_MIN_RQ
    journaled = [c for c in ctx.changes if c.path == path and c.note and
                 c.note.startswith(RESET_NOTE)]  # another pattern's switch journaled it
    for change in journaled:
        ctx.changes.remove(change)
    if switched or journaled:  # written after the switch that resets it, whatever it holds
        _journal(ctx, path, str(number), key, f"written after the switch to {scheduler}")
    else:
        ctx.want("block", path, str(number), key)


def _nr_requests_limit(ctx: PlanContext, key: str, device: BlockDevice,
                       scheduler: str | None) -> tuple[int, str]:
    """The most the kernel accepts, and why.  Under ``none`` that is the tag depth; where
    ``mq/*/nr_tags`` cannot be read, the current nr_requests is that depth (it reads the
    depth, or less, while ``none`` runs), so more is refused rather than written blind."""
    depth = device.tag_depth
    if depth is not None:
        limit = bq.nr_requests_limit(scheduler, depth)
        return limit, (f"its hardware tag depth (mq/*/nr_tags) with scheduler {scheduler}"
                       if limit == depth else f"MAX_SCHED_RQ with scheduler {scheduler}; "
                       f"the hardware has {depth} tags")
    if scheduler not in (None, "none"):
        return bq.MAX_SCHED_RQ, f"MAX_SCHED_RQ with scheduler {scheduler}"
    if device.scheduler not in (None, "none") or device.nr_requests is None:
        raise ctx.error(key, f"{device.name}'s tag depth is unknown (mq/*/nr_tags is "
                        "unreadable) and with scheduler none nr_requests may not exceed it; "
                        "leave nr_requests out, or keep a scheduler (allowed up to "
                        f"{bq.MAX_SCHED_RQ})")
    return device.nr_requests, ("its current nr_requests: with scheduler none that is the "
                                "tag depth, which mq/*/nr_tags does not say here")


def _polls(device: BlockDevice) -> bool:
    """Poll queues: counted in debugfs where readable, else what io_poll reads (1 only with
    poll queues; on 5.10-5.15 an earlier ``echo 0`` also reads 0)."""
    if device.poll_queues is not None:
        return device.poll_queues > 0
    return device.io_poll == 1


def _plan_polling(ctx: PlanContext, key: str, device: BlockDevice, name: str,
                  value: int) -> None:
    path = f"/sys/block/{device.name}/queue/{name}"
    version = bq.kernel_version(ctx.topology.kernel.release) or (99, 0)
    release = ctx.topology.kernel.release or "this kernel"
    current = getattr(device, name)
    if current is None:
        ctx.lacking(key, f"{path} does not exist on this device", "keys the device has")
        return
    if name == "io_poll":
        if value == current:
            return
        if version >= bq.IO_POLL_WRITES_IGNORED:
            ctx.lacking(key, f"io_poll on {release} reads {current} and ignores writes (since "
                        "5.16 it says whether the device has poll queues)",
                        f"{current} here; {POLL_QUEUES_HINT}" if value else
                        f"{current} here; nvme.poll_queues=0 removes the poll queues")
            return
        if not _polls(device):
            ctx.lacking(key, f"{device.name} has no poll queues: writing io_poll is EINVAL",
                        f"0 here; {POLL_QUEUES_HINT}")
            return
    elif value != -1 and version >= bq.HYBRID_POLL_REMOVED:
        ctx.lacking(key, f"hybrid polling was removed in 6.4: io_poll_delay on {release} "
                    "reads -1 and ignores writes", "-1 (classic polling)")
        return
    elif value != -1 and not _polls(device):
        ctx.lacking(key, f"{device.name} has no poll queues, so it never polls and the "
                    "hybrid-polling delay has no effect", f"-1; {POLL_QUEUES_HINT}")
        return
    ctx.want("block", path, str(value), key)


def _plan_max_sectors(ctx: PlanContext, key: str, device: BlockDevice, value: int) -> None:
    """Between the page size and max_hw_sectors_kb (the controller's limit), as
    queue_max_sectors_store checks; bigger requests need no more than that."""
    hw = device.max_hw_sectors_kb
    low = page_size(ctx.root.is_host, ctx.root.base) // 1024
    if hw is not None and not low <= value <= hw:
        raise ctx.error(key, f"{value} is outside what {device.name} accepts: allowed "
                        f"{low}..{hw} (the page size .. max_hw_sectors_kb)")
    ctx.want("block", f"/sys/block/{device.name}/queue/max_sectors_kb", str(value), key)


def _plan_wbt(ctx: PlanContext, key: str, device: BlockDevice, value: int,
              scheduler: str | None) -> None:
    """-1 asks for the kernel's default target, which is what verify then reads."""
    path = f"/sys/block/{device.name}/queue/wbt_lat_usec"
    if device.wbt_lat_usec is None:
        ctx.lacking(key, f"{device.name} has no writeback throttling ({path} is absent or "
                    "unreadable: CONFIG_BLK_WBT off, or not a blk-mq queue)",
                    "keys the device has")
        return
    if scheduler == "bfq" and value != 0:
        ctx.warnings.append(f"{key}: BFQ turns writeback throttling off by default; a "
                            "latency target turns it back on beside BFQ")
    desired = str(bq.WBT_DEFAULT_USEC[bool(device.rotational)]) if value == -1 else str(value)
    ctx.want("block", path, desired, key, write=str(value))

