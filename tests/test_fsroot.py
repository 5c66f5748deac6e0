"""The root-relative filesystem layer: resolution inside the root, escapes, write allowlist."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agent.kernel.fsroot import PathEscapesRoot, Root, RootError, WriteRefused


@pytest.fixture()
def tree(tmp_path: Path) -> Path:
    base = tmp_path / "root"
    dt = base / "sys/firmware/devicetree/base"
    dt.mkdir(parents=True)
    (dt / "model").write_bytes(b"Radxa ROCK 5B\0")
    (base / "proc").mkdir()
    os.symlink("/sys/firmware/devicetree/base", base / "proc/device-tree")  # absolute, as real
    policy = base / "sys/devices/system/cpu/cpufreq/policy0"
    policy.mkdir(parents=True)
    (policy / "scaling_governor").write_text("schedutil\n")
    (policy / "scaling_max_freq").write_text("1800000\n")
    cpu0 = base / "sys/devices/system/cpu/cpu0"
    cpu0.mkdir(parents=True)
    os.symlink("../cpufreq/policy0", cpu0 / "cpufreq")
    (tmp_path / "outside.txt").write_text("host secret\n")
    (base / "etc").mkdir()
    (base / "etc/agent.yaml").write_text("node_id: a\n")
    return base


def test_absolute_symlink_resolves_inside_the_root(tree: Path) -> None:
    root = Root(tree)
    assert root.read_bytes("/proc/device-tree/model") == b"Radxa ROCK 5B\0"
    assert root.realpath("/proc/device-tree") == "/sys/firmware/devicetree/base"


def test_relative_symlink_and_listdir(tree: Path) -> None:
    root = Root(tree)
    assert root.realpath("/sys/devices/system/cpu/cpu0/cpufreq") == \
        "/sys/devices/system/cpu/cpufreq/policy0"
    assert root.read_text("/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor") == \
        "schedutil\n"
    assert root.listdir("/sys/devices/system/cpu/cpufreq/policy0") == [
        "scaling_governor", "scaling_max_freq"]
    assert root.readlink("/sys/devices/system/cpu/cpu0/cpufreq") == "../cpufreq/policy0"


def test_glob_matches_components_inside_root(tree: Path) -> None:
    root = Root(tree)
    assert root.glob("/sys/devices/system/cpu/cpu*/cpufreq/scaling_*") == [
        "/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor",
        "/sys/devices/system/cpu/cpu0/cpufreq/scaling_max_freq"]
    assert root.glob("/sys/class/nothing/*") == []


def test_dotdot_above_root_is_refused(tree: Path) -> None:
    root = Root(tree)
    with pytest.raises(PathEscapesRoot, match="leaves the root"):
        root.read_text("/../outside.txt")
    assert not root.exists("/../outside.txt")


def test_symlink_leaving_the_root_is_refused(tree: Path) -> None:
    os.symlink("../../../outside.txt", tree / "sys/escape")
    root = Root(tree)
    with pytest.raises(PathEscapesRoot):
        root.read_text("/sys/escape")


def test_absolute_symlink_to_host_file_stays_in_root(tree: Path, tmp_path: Path) -> None:
    os.symlink(str(tmp_path / "outside.txt"), tree / "sys/host-link")
    root = Root(tree)
    # The absolute target is re-rooted, so it names a file inside the fixture, which is absent.
    with pytest.raises(FileNotFoundError):
        root.read_text("/sys/host-link")


def test_symlink_loop_is_an_error(tree: Path) -> None:
    os.symlink("loop-b", tree / "sys/loop-a")
    os.symlink("loop-a", tree / "sys/loop-b")
    with pytest.raises(RootError, match="too many levels"):
        Root(tree).read_text("/sys/loop-a")


def test_missing_root_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        Root(tmp_path / "absent")


def test_relative_paths_are_rejected(tree: Path) -> None:
    with pytest.raises(RootError, match="must be absolute"):
        Root(tree).read_text("sys/escape")


def test_allowlisted_write_goes_through_symlinks_in_one_write(tree: Path) -> None:
    root = Root(tree)
    root.write_text("/sys/devices/system/cpu/cpufreq/policy0/scaling_max_freq", "1416000")
    assert (tree / "sys/devices/system/cpu/cpufreq/policy0/scaling_max_freq").read_text() == \
        "1416000\n"  # a fixture attribute reads back like the kernel's: value and newline


def test_write_outside_allowlist_names_path_and_allowed(tree: Path) -> None:
    root = Root(tree)
    with pytest.raises(WriteRefused) as refused:
        root.write_text("/etc/agent.yaml", "node_id: evil\n")
    message = str(refused.value)
    assert message.startswith("/etc/agent.yaml: not a writable tuning path")
    assert "/sys/" in message and "/proc/" in message
    assert (tree / "etc/agent.yaml").read_text() == "node_id: a\n"


def test_write_with_dotdot_is_refused_even_if_it_would_match(tree: Path) -> None:
    root = Root(tree)
    path = "/sys/devices/system/cpu/cpufreq/policy0/../policy0/scaling_max_freq"
    with pytest.raises(WriteRefused, match=r"'\.\.' is not allowed"):
        root.write_text(path, "1")


def test_allowlisted_name_redirected_by_symlink_outside_kernel_trees(tree: Path) -> None:
    policy1 = tree / "sys/devices/system/cpu/cpufreq/policy1"
    policy1.mkdir()
    os.symlink("/etc/agent.yaml", policy1 / "scaling_governor")
    root = Root(tree)
    with pytest.raises(WriteRefused, match="outside the writable kernel trees"):
        root.write_text("/sys/devices/system/cpu/cpufreq/policy1/scaling_governor", "x")
    assert (tree / "etc/agent.yaml").read_text() == "node_id: a\n"


def test_allowlisted_symlink_escaping_root_is_refused(tree: Path) -> None:
    policy2 = tree / "sys/devices/system/cpu/cpufreq/policy2"
    policy2.mkdir()
    os.symlink("../../../../../../../outside.txt", policy2 / "scaling_governor")
    with pytest.raises(PathEscapesRoot):
        Root(tree).write_text("/sys/devices/system/cpu/cpufreq/policy2/scaling_governor", "x")
    assert (tree.parent / "outside.txt").read_text() == "host secret\n"


def test_cgroup_patterns_span_nested_directories(tree: Path) -> None:
    slice_dir = tree / "sys/fs/cgroup/edge-agent.slice/inference"
    slice_dir.mkdir(parents=True)
    (slice_dir / "memory.max").write_text("max\n")
    root = Root(tree)
    root.write_text("/sys/fs/cgroup/edge-agent.slice/inference/memory.max", "3221225472")
    assert (slice_dir / "memory.max").read_text() == "3221225472\n"
    with pytest.raises(WriteRefused):
        root.write_text("/sys/fs/cgroup/edge-agent.slice/inference/memory.stat", "0")


def test_custom_allowlist(tree: Path) -> None:
    root = Root(tree, writable=["/sys/devices/system/cpu/cpufreq/policy*/scaling_governor"])
    root.write_text("/sys/devices/system/cpu/cpufreq/policy0/scaling_governor", "performance")
    with pytest.raises(WriteRefused):
        root.write_text("/sys/devices/system/cpu/cpufreq/policy0/scaling_max_freq", "1")


def test_write_to_missing_file_does_not_create_it(tree: Path) -> None:
    root = Root(tree)
    with pytest.raises(FileNotFoundError):
        root.write_text("/sys/kernel/mm/transparent_hugepage/enabled", "never")
    assert not (tree / "sys/kernel/mm/transparent_hugepage/enabled").exists()


def test_host_root_reads_real_files() -> None:
    root = Root("/")
    assert root.is_host
    assert root.read_text("/proc/sys/kernel/osrelease").strip() == os.uname().release


def test_fixture_selection_attribute_moves_brackets_and_restores_bytes(tree: Path) -> None:
    thp = tree / "sys/kernel/mm/transparent_hugepage"
    thp.mkdir(parents=True)
    (thp / "enabled").write_text("always [madvise] never\n")
    root = Root(tree)
    root.write_text("/sys/kernel/mm/transparent_hugepage/enabled", "never")
    assert (thp / "enabled").read_text() == "always madvise [never]\n"
    root.write_text("/sys/kernel/mm/transparent_hugepage/enabled", "madvise")
    assert (thp / "enabled").read_text() == "always [madvise] never\n"
    with pytest.raises(OSError, match="'sometimes' is not one of"):
        root.write_text("/sys/kernel/mm/transparent_hugepage/enabled", "sometimes")
    assert (thp / "enabled").read_text() == "always [madvise] never\n"


FIXTURES = Path(__file__).parent / "fixtures"


@pytest.mark.parametrize("board", sorted(p.name for p in FIXTURES.iterdir()
                                         if (p / "sys").is_dir()))
def test_cached_links_resolve_every_path_as_the_walk_does(board: str) -> None:
    """Every path of a board tree (links and ``..`` included), both ways, the same answer."""
    root = Root(FIXTURES / board)
    paths = []
    for directory, names, files in os.walk(FIXTURES / board / "sys"):
        logical = "/" + str(Path(directory).relative_to(FIXTURES / board))
        paths += [f"{logical}/{name}" for name in names + files][:40]
    paths += ["/sys/devices/system/cpu/cpu0/../cpu1/online", "/sys/class/thermal/../block"]
    walked = {(p, last): root.resolve(p, last) for p in paths for last in (True, False)}
    with root.cached_links():
        for _ in range(2):  # the first time fills the cache, the second reads it
            assert {(p, last): root.resolve(p, last) for p, last in walked} == walked


def test_cached_links_last_one_operation_on_one_thread(tree: Path) -> None:
    import threading

    root = Root(tree)
    link = tree / "sys/devices/system/cpu/cpu0/cpufreq"
    policy1 = tree / "sys/devices/system/cpu/cpufreq/policy1"
    policy1.mkdir()
    seen: list[str] = []
    with root.cached_links():
        assert root.resolve("/sys/devices/system/cpu/cpu0/cpufreq").endswith("policy0")
        link.unlink()
        os.symlink("../cpufreq/policy1", link)  # changed under the block
        assert root.resolve("/sys/devices/system/cpu/cpu0/cpufreq").endswith("policy0")
        other = threading.Thread(target=lambda: seen.append(
            root.resolve("/sys/devices/system/cpu/cpu0/cpufreq")))
        other.start()
        other.join()
    assert seen[0].endswith("policy1")  # another thread reads the tree as it is
    assert root.resolve("/sys/devices/system/cpu/cpu0/cpufreq").endswith("policy1")  # after


def test_cached_links_on_the_host_root_resolve_as_realpath_does() -> None:
    root = Root("/")
    paths = ["/sys/class/net/lo", "/sys/class/net/lo/mtu", "/proc/sys/vm/swappiness",
             "/sys/devices/system/cpu/cpu0", "/sys/block", "/proc/self"]
    walked = {(p, last): root.resolve(p, last) for p in paths for last in (True, False)}
    with root.cached_links():
        for _ in range(2):
            assert {(p, last): root.resolve(p, last) for p, last in walked} == walked
