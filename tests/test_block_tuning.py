"""Block queue semantics: the scheduler before nr_requests, nr_requests against the tag depth,
wbt_lat_usec/nomerges/add_random/max_sectors_kb limits, io_poll/io_poll_delay by kernel
version and poll queues -- planned, applied, verified and rolled back byte-exact on copies
of the fixture boards, whose queue files refuse what the kernel refuses
(agent/kernel/block_queue.py)."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
from tuning_helpers import copy_board, engine_for, snapshot, write_profile

from agent.kernel import block_queue as bq
from agent.kernel.fsroot import Root
from agent.tuning.errors import ProfileError
from agent.tuning.plan import Change

# kernel releases of the boards: 5.10 Xavier, 5.15 Orin, 6.1 RK3588 vendor, 6.8 x86 server
# (two poll queues per NVMe drive), 6.11 x86 edge (BFQ), 6.18 RK3588 mainline
QUEUE = "sys/block/{}/queue/{}"


def _engine(tmp_path: Path, board: str, profile: str):  # type: ignore[no-untyped-def]
    tree = copy_board(board, tmp_path)
    profiles = tmp_path / "profiles"
    write_profile(profiles, "blk", profile)
    return tree, engine_for(tree, tmp_path / "state", [profiles])


def _read(tree: Path, disk: str, name: str) -> str:
    return (tree / QUEUE.format(disk, name)).read_text()


def _round_trip(tree: Path, engine, profile: str = "blk") -> list[Change]:  # type: ignore[no-untyped-def]
    """Apply, verify, roll back; the tree must come back byte for byte."""
    before = snapshot(tree)
    plan = engine.plan(profile)
    assert snapshot(tree) == before, "plan must not write"
    engine.apply(profile)
    assert engine.verify() == []
    engine.rollback()
    assert snapshot(tree) == before
    return plan.changes


# -- the kernel's rules, as the fixture root applies them --------------------------------


def test_fixture_root_refuses_nr_requests_above_the_tag_depth(tmp_path: Path) -> None:
    tree = copy_board("jetson-agx-orin-jp6", tmp_path)
    root = Root(tree)
    with pytest.raises(OSError) as caught:  # none: the request depth is the tag depth
        root.write_text("/sys/block/nvme0n1/queue/nr_requests", "1024")
    assert caught.value.errno == errno.EINVAL
    root.write_text("/sys/block/nvme0n1/queue/nr_requests", "2")  # raised to BLKDEV_MIN_RQ
    assert _read(tree, "nvme0n1", "nr_requests") == "4\n"
    root.write_text("/sys/block/nvme0n1/queue/scheduler", "mq-deadline")
    assert _read(tree, "nvme0n1", "nr_requests") == "256\n"  # 2 * min(1023, 128)
    root.write_text("/sys/block/nvme0n1/queue/nr_requests", "2048")  # sched tags may grow
    with pytest.raises(OSError):
        root.write_text("/sys/block/nvme0n1/queue/nr_requests", "2049")  # MAX_SCHED_RQ
    root.write_text("/sys/block/nvme0n1/queue/scheduler", "none")
    assert _read(tree, "nvme0n1", "nr_requests") == "1023\n"


@pytest.mark.parametrize(("board", "value", "reads"), [
    ("jetson-agx-orin-jp6", "1", None),      # 5.15, no poll queues: EINVAL
    ("rk3588-mainline", "0", None),          # 6.18, none either: EINVAL
    ("x86-server-nvidia", "0", "1\n"),       # 6.8 with poll queues: ignored, still 1
])
def test_fixture_root_io_poll_follows_the_kernel(board: str, value: str, reads: str | None,
                                                 tmp_path: Path) -> None:
    tree = copy_board(board, tmp_path)
    path = "/sys/block/nvme0n1/queue/io_poll"
    if reads is None:
        with pytest.raises(OSError) as caught:
            Root(tree).write_text(path, value)
        assert caught.value.errno == errno.EINVAL
    else:
        Root(tree).write_text(path, value)
        assert _read(tree, "nvme0n1", "io_poll") == reads


def test_fixture_root_max_sectors_wbt_nomerges(tmp_path: Path) -> None:
    tree = copy_board("rk3588-vendor", tmp_path)
    root = Root(tree)
    for bad in ("4096", "2"):  # above max_hw_sectors_kb 2048, below the page size
        with pytest.raises(OSError):
            root.write_text("/sys/block/nvme0n1/queue/max_sectors_kb", bad)
    root.write_text("/sys/block/nvme0n1/queue/wbt_lat_usec", "0")
    assert _read(tree, "nvme0n1", "wbt_lat_usec") == "0\n"
    root.write_text("/sys/block/nvme0n1/queue/wbt_lat_usec", "-1")  # the default again
    assert _read(tree, "nvme0n1", "wbt_lat_usec") == "2000\n"
    root.write_text("/sys/block/nvme0n1/queue/nomerges", "7")  # non-zero, not 2: simple only
    assert _read(tree, "nvme0n1", "nomerges") == "1\n"


# -- planning ----------------------------------------------------------------------------


def test_scheduler_is_planned_before_nr_requests_and_rolled_back_after(
        tmp_path: Path) -> None:
    """The profile lists nr_requests first; the switch to mq-deadline must come first or it
    would reset nr_requests to 256, and rollback must restore the scheduler first."""
    tree, engine = _engine(tmp_path, "jetson-agx-orin-jp6",
                           "block: {nvme0n1: {nr_requests: 2048, scheduler: mq-deadline}}\n")
    changes = engine.plan("blk").changes
    assert [c.path.rsplit("/", 1)[1] for c in changes] == ["scheduler", "nr_requests"]
    engine.apply("blk")
    assert (_read(tree, "nvme0n1", "scheduler"), _read(tree, "nvme0n1", "nr_requests")) == (
        "none [mq-deadline] kyber bfq \n", "2048\n")
    assert engine.verify() == []
    engine.rollback()
    assert _read(tree, "nvme0n1", "nr_requests") == "1023\n"
    assert _read(tree, "nvme0n1", "scheduler") == "[none] mq-deadline kyber bfq \n"


def test_a_scheduler_switch_journals_nr_requests_it_resets(tmp_path: Path) -> None:
    """The user had set nr_requests 64 under mq-deadline; switching to none resets it to
    1023, and rollback puts mq-deadline back (256) and then the 64."""
    tree = copy_board("rk3588-vendor", tmp_path)
    Root(tree).write_text("/sys/block/mmcblk0/queue/nr_requests", "64")
    profiles = tmp_path / "profiles"
    write_profile(profiles, "blk", "block: {mmcblk0: {scheduler: none}}\n")
    engine = engine_for(tree, tmp_path / "state", [profiles])
    changes = _round_trip(tree, engine)
    assert [(c.path.rsplit("/", 1)[1], c.current, c.desired) for c in changes] == [
        ("scheduler", "mq-deadline", "none"), ("nr_requests", "64", "64")]
    assert _read(tree, "mmcblk0", "nr_requests") == "64\n"


def test_a_switch_by_one_pattern_and_nr_requests_by_another(tmp_path: Path) -> None:
    """'*' switches the scheduler (journaling nr_requests), 'nvme*' sets nr_requests: one
    nr_requests change, after the switch, limited by the new scheduler."""
    tree, engine = _engine(tmp_path, "rk3588-vendor",
                           "block: {'*': {scheduler: kyber}, 'nvme*': {nr_requests: 1500}}\n")
    changes = _round_trip(tree, engine)
    assert [(c.path.split("/")[3], c.path.rsplit("/", 1)[1], c.desired) for c in changes] == [
        ("mmcblk0", "scheduler", "kyber"), ("mmcblk0", "nr_requests", "128"),
        ("nvme0n1", "scheduler", "kyber"), ("nvme0n1", "nr_requests", "1500")]


@pytest.mark.parametrize(("board", "profile", "allowed"), [
    ("jetson-xavier-nx-jp5-rt", "{nvme0n1: {nr_requests: 1024}}", "4..1023"),
    ("rk3588-vendor", "{nvme0n1: {scheduler: mq-deadline, nr_requests: 4096}}", "4..2048"),
    ("rk3588-mainline", "{mmcblk0: {nr_requests: 2049}}", "4..2048"),
])
def test_nr_requests_above_the_limit_is_refused_with_the_range(
        board: str, profile: str, allowed: str, tmp_path: Path) -> None:
    _tree, engine = _engine(tmp_path, board, f"block: {profile}\n")
    with pytest.raises(ProfileError) as caught:
        engine.plan("blk")
    assert caught.value.key.endswith(".nr_requests")
    assert caught.value.file.endswith("blk.yaml")
    assert f"allowed {allowed}" in caught.value.message


def test_nr_requests_max_and_the_minimum(tmp_path: Path) -> None:
    tree, engine = _engine(tmp_path, "rk3588-mainline",
                           "block: {nvme0n1: {scheduler: kyber, nr_requests: max}, "
                           "mmcblk0: {nr_requests: 1}}\n")
    plan = engine.plan("blk")
    assert {(c.path.split("/")[3], c.desired) for c in plan.changes
            if c.path.endswith("nr_requests")} == {("nvme0n1", "2048"), ("mmcblk0", "4")}
    assert any("raises it to 4" in w for w in plan.warnings)
    _round_trip(tree, engine)


def test_new_queue_keys_round_trip(tmp_path: Path) -> None:
    tree, engine = _engine(tmp_path, "jetson-orin-nano-jp6",
                           "block: {'*': {wbt_lat_usec: 0, nomerges: 2, add_random: 1}, "
                           "nvme0n1: {max_sectors_kb: 2048}}\n")
    before = snapshot(tree)
    engine.apply("blk")
    assert [_read(tree, "nvme0n1", n) for n in ("wbt_lat_usec", "nomerges", "add_random",
                                                "max_sectors_kb")] == [
        "0\n", "2\n", "1\n", "2048\n"]
    assert engine.verify() == []
    engine.rollback()
    assert snapshot(tree) == before


def test_wbt_minus_one_plans_the_default_it_reads_back(tmp_path: Path) -> None:
    tree = copy_board("x86-edge-npu", tmp_path)  # BFQ: throttling off, reads 0
    profiles = tmp_path / "profiles"
    write_profile(profiles, "blk", "block: {nvme0n1: {wbt_lat_usec: -1}}\n")
    engine = engine_for(tree, tmp_path / "state", [profiles])
    plan = engine.plan("blk")
    [change] = plan.changes
    assert (change.current, change.desired, change.write_value) == ("0", "2000", "-1")
    assert any("BFQ" in w for w in plan.warnings)
    _round_trip(tree, engine)


@pytest.mark.parametrize(("setting", "allowed"), [
    ("max_sectors_kb: 4096", "4..2048"), ("max_sectors_kb: 2", None)])
def test_max_sectors_kb_outside_the_hardware_limit_is_refused(
        setting: str, allowed: str | None, tmp_path: Path) -> None:
    _tree, engine = _engine(tmp_path, "rk3588-vendor", f"block: {{nvme0n1: {{{setting}}}}}\n")
    with pytest.raises(ProfileError) as caught:
        engine.plan("blk")
    if allowed is None:  # the schema's floor: a page is 4 KiB at least
        assert caught.value.key == "block.nvme0n1.max_sectors_kb"
    else:
        assert f"allowed {allowed}" in caught.value.message


def test_wbt_lat_usec_without_writeback_throttling_is_lacking(tmp_path: Path) -> None:
    tree = copy_board("rk3588-mainline", tmp_path)
    (tree / QUEUE.format("nvme0n1", "wbt_lat_usec")).unlink()  # CONFIG_BLK_WBT=n
    profiles = tmp_path / "profiles"
    write_profile(profiles, "blk", "block: {nvme0n1: {wbt_lat_usec: 0}}\n")
    write_profile(profiles, "soft", "include: [blk]\noptional: [block]\n")
    engine = engine_for(tree, tmp_path / "state", [profiles])
    with pytest.raises(ProfileError) as caught:
        engine.plan("blk")
    assert "CONFIG_BLK_WBT" in caught.value.message
    plan = engine.plan("soft")
    assert plan.changes == [] and any("skipped" in w for w in plan.warnings)


# -- polling -----------------------------------------------------------------------------


def test_io_poll_on_5_10_needs_poll_queues(tmp_path: Path) -> None:
    _tree, engine = _engine(tmp_path, "jetson-xavier-nx-jp5-rt",
                            "block: {nvme0n1: {io_poll: 1}}\n")
    with pytest.raises(ProfileError) as caught:
        engine.plan("blk")
    assert "no poll queues" in caught.value.message
    assert "nvme.poll_queues" in caught.value.message


def test_io_poll_on_5_15_with_poll_queues_is_written_and_restored(tmp_path: Path) -> None:
    """On 5.10-5.15 io_poll turns polling on and off where poll queues exist."""
    tree = copy_board("jetson-agx-orin-jp6", tmp_path)
    for index, kind in ((1, "poll"),):  # give nvme0n1 a poll context, as poll_queues=1 does
        (tree / f"sys/block/nvme0n1/mq/{index}").mkdir()
        (tree / f"sys/block/nvme0n1/mq/{index}/nr_tags").write_text("1023\n")
        hctx = tree / f"sys/kernel/debug/block/nvme0n1/hctx{index}"
        hctx.mkdir()
        (hctx / "type").write_text(f"{kind}\n")
    profiles = tmp_path / "profiles"
    write_profile(profiles, "blk", "block: {nvme0n1: {io_poll: 1, io_poll_delay: 0}}\n")
    engine = engine_for(tree, tmp_path / "state", [profiles])
    changes = _round_trip(tree, engine)
    assert [(c.path.rsplit("/", 1)[1], c.desired) for c in changes] == [
        ("io_poll", "1"), ("io_poll_delay", "0")]


@pytest.mark.parametrize(("board", "setting", "why"), [
    ("x86-server-nvidia", "io_poll: 0", "ignores writes"),          # 6.8: reads 1, fixed
    ("rk3588-mainline", "io_poll_delay: 0", "removed in 6.4"),      # hybrid polling gone
    ("rk3588-vendor", "io_poll_delay: 10", "no poll queues"),       # 6.1 has hybrid, no queues
])
def test_polling_the_kernel_no_longer_honours_is_refused(
        board: str, setting: str, why: str, tmp_path: Path) -> None:
    _tree, engine = _engine(tmp_path, board, f"block: {{nvme0n1: {{{setting}}}}}\n")
    with pytest.raises(ProfileError) as caught:
        engine.plan("blk")
    assert why in caught.value.message


def test_polling_that_already_holds_plans_nothing(tmp_path: Path) -> None:
    _tree, engine = _engine(tmp_path, "x86-server-nvidia",
                            "block: {'nvme*': {io_poll: 1, io_poll_delay: -1}}\n")
    assert engine.plan("blk").changes == []


def test_discovery_reports_poll_queues_and_tag_depth(tmp_path: Path) -> None:
    from agent.discovery import discover

    topology = discover(Root(copy_board("x86-server-nvidia", tmp_path)))
    nvme = {d.name: d for d in topology.block}
    assert [(d.tag_depth, d.hw_queues, d.poll_queues, d.io_poll) for d in nvme.values()] == [
        (1023, 3, 2, 1), (1023, 3, 2, 1)]
    assert topology.kernel.nvme_poll_queues == 2


def test_kernel_version_and_limits() -> None:
    assert bq.kernel_version("5.15.148-tegra") == (5, 15)
    assert bq.kernel_version("6.18.2") == (6, 18)
    assert bq.kernel_version(None) is None
    assert bq.nr_requests_limit("none", 1023) == 1023
    assert bq.nr_requests_limit("bfq", 64) == 2048
    assert bq.default_nr_requests("mq-deadline", 64) == 128
    assert bq.default_nr_requests("none", 64) == 64


def _hide_tag_depth(tree: Path, disk: str, depth: int) -> None:
    """``mq/*/nr_tags`` unreadable to the agent; the fixture kernel still knows the depth,
    from debugfs ``hctx0/tags`` (blk_mq_debugfs_tags_show), as the real one does."""
    for tags in (tree / f"sys/block/{disk}/mq").glob("*/nr_tags"):
        tags.unlink()
    debugfs = tree / f"sys/kernel/debug/block/{disk}/hctx0"
    debugfs.mkdir(parents=True, exist_ok=True)
    (debugfs / "tags").write_text(f"nr_tags={depth}\nnr_reserved_tags=0\nactive_queues=0\n")


def test_unreadable_tag_depth_under_none_is_bounded_by_the_current_nr_requests(
        tmp_path: Path) -> None:
    """mmcblk0 under none reads 64 (its tag depth) and mq/*/nr_tags is unreadable: 1024 is
    refused at plan time, as the kernel refuses it (EINVAL), instead of planned blind;
    a lower value and max (64) still round-trip."""
    tree = copy_board("rk3588-vendor", tmp_path)
    Root(tree).write_text("/sys/block/mmcblk0/queue/scheduler", "none")
    _hide_tag_depth(tree, "mmcblk0", 64)
    assert _read(tree, "mmcblk0", "nr_requests") == "64\n"
    with pytest.raises(OSError) as caught:
        Root(tree).write_text("/sys/block/mmcblk0/queue/nr_requests", "1024")
    assert caught.value.errno == errno.EINVAL
    profiles = tmp_path / "profiles"
    write_profile(profiles, "blk", "block: {'mmcblk*': {nr_requests: 1024}}\n")
    write_profile(profiles, "low", "block: {'mmcblk*': {nr_requests: 32}}\n")
    engine = engine_for(tree, tmp_path / "state", [profiles])
    with pytest.raises(ProfileError) as refused:
        engine.plan("blk")
    assert refused.value.key == "block.mmcblk*.nr_requests"
    assert "allowed 4..64 (its current nr_requests" in refused.value.message
    [change] = _round_trip(tree, engine, "low")
    assert (change.current, change.desired) == ("64", "32")


def test_unreadable_tag_depth_and_a_switch_to_none_is_refused(tmp_path: Path) -> None:
    tree = copy_board("rk3588-vendor", tmp_path)  # mmcblk0 under mq-deadline
    _hide_tag_depth(tree, "mmcblk0", 64)
    engine = engine_for(tree, tmp_path / "state", [tmp_path / "profiles"])
    write_profile(tmp_path / "profiles", "blk",
                  "block: {mmcblk0: {scheduler: none, nr_requests: 100}}\n")
    with pytest.raises(ProfileError) as refused:
        engine.plan("blk")
    assert "tag depth is unknown" in refused.value.message
    write_profile(tmp_path / "profiles", "sched",
                  "block: {mmcblk0: {scheduler: kyber, nr_requests: 1024}}\n")
    assert [c.desired for c in _round_trip(tree, engine, "sched")] == ["kyber", "1024"]
