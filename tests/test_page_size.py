"""The page size comes from the root, not from 4 KiB: a tree whose kernel runs 16 KiB pages
(the Raspberry Pi 5's) rounds memory cgroup limits to 16 KiB and refuses max_sectors_kb
below 16, at plan time and in the fixture kernel alike."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from test_cgroup_v2 import CG, container_engine
from tuning_helpers import copy_board, engine_for, write_profile

from agent.kernel.fsroot import Root
from agent.kernel.pages import PMD_SIZE, SMAPS, page_size, tree_page_size
from agent.tuning.errors import ProfileError

SMAPS_16K = ("aaaab1230000-aaaab1240000 r-xp 00000000 b3:02 1234   /usr/bin/python3\n"
             "Size:                 64 kB\nKernelPageSize:       16 kB\n"
             "MMUPageSize:          16 kB\nRss:                  48 kB\n")


def sixteen_k(tree: Path) -> Path:
    (tree / SMAPS).parent.mkdir(parents=True, exist_ok=True)
    (tree / SMAPS).write_text(SMAPS_16K)
    return tree


def test_a_tree_says_its_page_size(tmp_path: Path) -> None:
    tree = copy_board("rk3588-mainline", tmp_path)
    assert tree_page_size(tree) == 4096  # hpage_pmd_size 2 MiB: 4 KiB pages
    (tree / PMD_SIZE).write_text("33554432\n")  # 32 MiB PMDs: 16 KiB pages
    assert tree_page_size(tree) == 16384
    (tree / PMD_SIZE).write_text("536870912\n")
    assert tree_page_size(tree) == 65536
    assert tree_page_size(sixteen_k(tree)) == 16384  # KernelPageSize wins
    assert page_size(True, Path("/")) == os.sysconf("SC_PAGE_SIZE")


def test_memory_limits_are_whole_pages_of_the_trees_kernel(tmp_path: Path) -> None:
    engine, tree = container_engine(tmp_path, "cgroup: {memory_max: 1000005632}\n")
    sixteen_k(tree)
    [change] = engine.plan("limits").changes
    assert change.desired == "999997440"  # 61035 pages of 16 KiB (4 KiB pages: as given)
    engine.apply("limits")
    assert Root(tree).read_text(f"{CG}/inference/memory.max") == "999997440\n"
    assert engine.verify() == []
    engine.rollback()


def test_max_sectors_kb_below_a_16k_page_is_refused(tmp_path: Path) -> None:
    tree = sixteen_k(copy_board("rk3588-vendor", tmp_path))
    with pytest.raises(OSError) as caught:
        Root(tree).write_text("/sys/block/nvme0n1/queue/max_sectors_kb", "8")
    assert caught.value.errno == errno.EINVAL
    write_profile(tmp_path / "profiles", "blk", "block: {nvme0n1: {max_sectors_kb: 8}}\n")
    with pytest.raises(ProfileError) as refused:
        engine_for(tree, tmp_path / "state", [tmp_path / "profiles"]).plan("blk")
    assert "allowed 16..2048" in refused.value.message
