"""Profile loading (include, cycles, site overrides) and the Jetson nvpmodel base policy."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from cli_helpers import edge_agent
from tuning_helpers import (
    FIXTURES,
    REPO_PROFILES,
    SharedBoard,
    copy_board,
    plan_engine,
)

from agent.discovery.model import Board
from agent.kernel.fsroot import Root
from agent.tuning import nvpmodel
from agent.tuning.errors import ProfileError
from agent.tuning.profiles import ProfileStore


def store_with(tmp_path: Path, profiles: dict[str, str]) -> ProfileStore:
    directory = tmp_path / "profiles"
    directory.mkdir()
    for name, text in profiles.items():
        (directory / f"{name}.yaml").write_text(text)
    return ProfileStore(Root(tmp_path), dirs=[directory])


def test_include_merges_in_order_later_wins(tmp_path: Path) -> None:
    store = store_with(tmp_path, {
        "a": "thp: {enabled: always, defrag: never}\nsysctl: {vm.swappiness: 1}\n",
        "b": "thp: {enabled: never}\n",
        "c": "include: [a, b]\nsysctl: {vm.swappiness: 3}\n"})
    profile = store.load("c")
    assert profile.settings == {"thp": {"enabled": "never", "defrag": "never"},
                                "sysctl": {"vm.swappiness": 3}}
    assert profile.chain == ["a", "b", "c"]


def test_include_cycle_is_named(tmp_path: Path) -> None:
    store = store_with(tmp_path, {"a": "include: [b]\n", "b": "include: [c]\n",
                                  "c": "include: [a]\n"})
    with pytest.raises(ProfileError, match=r"a\.yaml: include: include cycle: a -> b -> c -> a"):
        store.load("a")


def test_unknown_key_names_file_path_and_allowed(tmp_path: Path) -> None:
    store = store_with(tmp_path, {"x": "thp: {enable: never}\n"})
    with pytest.raises(ProfileError) as error:
        store.load("x")
    assert str(error.value) == (f"{tmp_path}/profiles/x.yaml: thp.enable: unknown key "
                                "(allowed: enabled, defrag, khugepaged_defrag, dynamic)")


def test_site_profile_overrides_builtin_through_the_root(tmp_path: Path) -> None:
    site = tmp_path / "etc/edge-agent/profiles"
    site.mkdir(parents=True)
    (site / "balanced.yaml").write_text("thp: {enabled: never}\n")
    store = ProfileStore(Root(tmp_path), dirs=[REPO_PROFILES])
    profile = store.load("balanced")
    assert profile.file == "/etc/edge-agent/profiles/balanced.yaml"
    assert profile.settings == {"thp": {"enabled": "never"}}
    assert store.load("latency").settings["thp"]["enabled"] == "never"  # includes the site one


@pytest.mark.parametrize(("board", "expected"), [
    (Board(family="rockchip", soc="rk3588"), "rk3588"),
    (Board(family="rockchip", soc="rk3588s"), "rk3588"),
    (Board(family="jetson", soc="tegra234"), "jetson-orin"),
    (Board(family="x86"), "x86"),
    (Board(family="generic", soc="bcm2712"), "balanced")])
def test_auto_picks_the_board_profile(board: Board, expected: str, tmp_path: Path) -> None:
    assert ProfileStore(Root(tmp_path), dirs=[REPO_PROFILES]).auto(board).name == expected


def test_every_shipped_profile_plans_on_its_boards(tmp_path: Path,
                                                   shared_board: SharedBoard) -> None:
    for board in ("jetson-agx-orin-jp6", "rk3588-vendor", "x86-edge-npu"):
        engine = plan_engine(shared_board(board), tmp_path / board)
        for name in engine.store.names():
            profile = engine.store.load(name)
            if profile.matches(engine.topology.board):
                assert engine.plan(name).profile == name


def test_nvpmodel_conf_and_active_caps() -> None:
    root = Root(FIXTURES / "jetson-agx-orin-jp6")
    conf = nvpmodel.parse_conf(root.read_text(nvpmodel.CONF))
    assert (conf.default, sorted((m.id, m.name) for m in conf.modes.values())) == (
        2, [(0, "MAXN"), (1, "MODE_15W"), (2, "MODE_30W"), (3, "MODE_50W")])
    assert conf.modes[1].values[("CPU_A78_0", "MAX_FREQ")] == 1113600
    mode = nvpmodel.active_caps(root)
    assert mode is not None
    name, caps = mode
    assert name == "MODE_30W"
    assert caps["/sys/devices/system/cpu/cpufreq/policy0/scaling_max_freq"] == 1728000
    assert caps["/sys/devices/platform/bus@0/17000000.ga10b/devfreq/17000000.ga10b/"
                "max_freq"] == 612000000
    assert nvpmodel.active_caps(Root(FIXTURES / "rk3588-vendor")) is None


def test_plan_warns_beyond_nvpmodel_caps(tmp_path: Path, shared_board: SharedBoard) -> None:
    tree = shared_board("jetson-agx-orin-jp6")
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    (profiles / "maxed.yaml").write_text("dvfs: {cpu: {all: {max_khz: max, governor: "
                                         "performance}}, gpu: {max_hz: '~600000000'}}\n")
    plan = plan_engine(tree, tmp_path / "state", [profiles]).plan("maxed")
    beyond = [w for w in plan.warnings if "nvpmodel mode MODE_30W" in w]
    assert len(beyond) == 2  # policy0 and policy4; the GPU ask is within its cap
    assert "policy0/scaling_max_freq = 2201600 is above the cap 1728000" in beyond[0]


BROKEN = "/etc/edge-agent/profiles/broken.yaml"
BROKEN_ERROR = (f"{BROKEN}: thp.enable: unknown key (allowed: enabled, defrag, "
                "khugepaged_defrag, dynamic)")


def profile_cli(tree: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``edge-agent profile ARGS --root TREE``, called in this process (tests/cli_helpers.py)."""
    return edge_agent("profile", *args, "--root", tree, cwd=REPO_PROFILES.parent)


@pytest.fixture()
def site_tree(tmp_path: Path) -> Path:
    """An x86 board whose site profile directory holds one broken profile, one unreadable
    one (a directory named like a profile) and one good one."""
    tree = copy_board("x86-edge-npu", tmp_path)
    site = tree / "etc/edge-agent/profiles"
    site.mkdir(parents=True)
    (site / "broken.yaml").write_text("thp: {enable: never}\n")
    (site / "unreadable.yaml").mkdir()
    (site / "site-good.yaml").write_text("include: [balanced]\nsysctl: {vm.swappiness: 5}\n")
    return tree


def test_one_broken_site_profile_is_listed_with_its_error(site_tree: Path) -> None:
    result = profile_cli(site_tree, "list", "--json")
    assert result.returncode == 0, result.stderr
    listing = json.loads(result.stdout)
    names = [row["name"] for row in listing["profiles"]]
    assert "site-good" in names and "balanced" in names and "x86" in names
    assert "broken" not in names and "unreadable" not in names
    assert listing["auto"] == "x86"
    assert listing["errors"] == [
        {"name": "broken", "error": BROKEN_ERROR},
        {"name": "unreadable", "error": "/etc/edge-agent/profiles/unreadable.yaml: cannot be "
         "read: Is a directory"}]
    text = profile_cli(site_tree, "list")
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert f"! broken                 error: {BROKEN_ERROR}" in lines
    assert any(line.startswith("* x86 ") for line in lines)
    assert any(line.startswith("  site-good ") for line in lines)


def test_plan_auto_skips_a_broken_profile_with_a_warning(site_tree: Path) -> None:
    result = profile_cli(site_tree, "plan", "auto", "--json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["profile"] == "x86"
    assert f"profile broken is skipped: {BROKEN_ERROR}" in plan["warnings"]
    text = profile_cli(site_tree, "plan", "auto")
    assert text.returncode == 0, text.stderr
    assert f"warning: profile broken is skipped: {BROKEN_ERROR}" in text.stdout.splitlines()
    assert profile_cli(site_tree, "plan", "site-good").returncode == 0


@pytest.mark.parametrize("action", ["show", "plan"])
def test_the_broken_profile_by_name_is_a_usage_error(site_tree: Path, action: str) -> None:
    result = profile_cli(site_tree, action, "broken")
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.strip().splitlines() == [f"edge-agent profile {action}: {BROKEN_ERROR}"]


@pytest.mark.parametrize(("text", "key", "lines"), [
    ("thp: {enabled: never}\nsysctl: {vm.swappiness: 1}\nthp: {defrag: never}\n", "thp",
     "1 and 3"),
    ("sysctl:\n  vm.swappiness: 1\n  vm.dirty_ratio: 5\n  vm.swappiness: 10\n",
     "sysctl.vm.swappiness", "2 and 4"),
], ids=["top-level", "nested"])
def test_a_key_given_twice_in_a_profile_is_refused(tmp_path: Path, text: str, key: str,
                                                   lines: str) -> None:
    store = store_with(tmp_path, {"x": text})
    with pytest.raises(ProfileError) as error:
        store.load("x")
    assert str(error.value) == f"{tmp_path}/profiles/x.yaml: {key}: given twice (lines {lines})"


def test_a_key_given_twice_in_a_site_profile_is_refused(tmp_path: Path) -> None:
    site = tmp_path / "etc/edge-agent/profiles"
    site.mkdir(parents=True)
    (site / "line-a.yaml").write_text("include: [balanced]\ninclude: [latency]\n")
    with pytest.raises(ProfileError) as error:
        ProfileStore(Root(tmp_path), dirs=[REPO_PROFILES]).load("line-a")
    assert str(error.value) == ("/etc/edge-agent/profiles/line-a.yaml: include: given twice "
                                "(lines 1 and 2)")
