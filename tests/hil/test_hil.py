"""Hardware-in-the-loop: the agent on a real board's real /sys.

Skipped unless EDGE_AGENT_HIL=1.  They tune the real device (and roll it back), so run them
only on a board set aside for it:

    EDGE_AGENT_HIL=1 EDGE_AGENT_HIL_FAMILY=rockchip EDGE_AGENT_HIL_PROVIDER=CPUExecutionProvider \\
    EDGE_AGENT_HIL_BROKER=broker.lab:1883 .venv/bin/python -m pytest -m hil tests/hil
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.hil, pytest.mark.timeout(900), pytest.mark.skipif(
    os.environ.get("EDGE_AGENT_HIL") != "1",
    reason="hardware-in-the-loop: set EDGE_AGENT_HIL=1 on a board set aside for it")]

AGENT = [sys.executable, "-m", "agent"]


def agent(*words: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*AGENT, *words], capture_output=True, text=True, timeout=600,
                          check=check)


def test_discovery_matches_the_board() -> None:
    topology = json.loads(agent("discover", "--json").stdout)
    family = os.environ.get("EDGE_AGENT_HIL_FAMILY")
    if family:
        assert topology["board"]["family"] == family
    assert topology["cpu"]["count"] == os.cpu_count()
    assert topology["cpu"]["clusters"], "no cpufreq clusters found"
    if family == "jetson":
        assert topology["gpus"], "a Jetson has an integrated GPU"
    if family == "rockchip":
        assert topology["npus"] or topology["gpus"], "RK3588: NPU or Mali expected"


def test_profile_apply_verify_rollback_on_the_real_sys(tmp_path: Path) -> None:
    state = str(tmp_path / "state")
    before = agent("profile", "plan", "auto", "--json")
    changes = json.loads(before.stdout)["changes"]
    try:
        agent("profile", "apply", "auto", "--state-dir", state)
        assert agent("profile", "verify", "--state-dir", state, check=False).returncode == 0
    finally:
        agent("profile", "rollback", "--state-dir", state)
    for change in changes:  # every original value is back
        if change["path"].startswith("systemd:"):
            continue  # a unit property: test_data_plane_limits_through_systemd checks those
        current = Path(change["path"]).read_text().strip()
        assert change["current"] is None or str(change["current"]) in current


def test_inference_runs_on_the_expected_provider(tmp_path: Path) -> None:
    stats = json.loads(agent("infer", "--seconds", "3", "--json", "--state-dir",
                             str(tmp_path)).stdout)
    expected = os.environ.get("EDGE_AGENT_HIL_PROVIDER")
    if expected:
        assert stats["providers"][0] == expected
    assert stats["count"] > 0 and stats["errors"] == 0


def test_selftest_and_telemetry_reach_the_broker(tmp_path: Path) -> None:
    broker = os.environ.get("EDGE_AGENT_HIL_BROKER")
    if not broker:
        pytest.skip("EDGE_AGENT_HIL_BROKER=host:port names the lab broker")
    host, _, port = broker.rpartition(":")
    config = tmp_path / "agent.yaml"
    config.write_text(f"mqtt: {{host: {host}, port: {port}}}\nstate_dir: {tmp_path}/state\n")
    report = json.loads(agent("selftest", "--config", str(config), "--json",
                              check=False).stdout)
    checks = {c["name"]: c["status"] for c in report["checks"]}
    assert checks["mqtt"] == "pass" and checks["inference"] == "pass"


def cyclictest_max_us() -> int:
    result = subprocess.run(["cyclictest", "-m", "-q", "-t1", "-p80", "-i1000", "-l5000"],
                            capture_output=True, text=True, timeout=120, check=True)
    return max(int(m) for m in re.findall(r"Max:\s+(\d+)", result.stdout))


@pytest.mark.skipif(shutil.which("cyclictest") is None, reason="rt-tests is not installed")
def test_cyclictest_with_and_without_the_realtime_profile(tmp_path: Path) -> None:
    state = str(tmp_path / "state")
    without = cyclictest_max_us()
    try:
        agent("profile", "apply", "realtime", "--force", "--state-dir", state)
        with_profile = cyclictest_max_us()
    finally:
        agent("profile", "rollback", "--state-dir", state)
    print(f"cyclictest max latency: {without} us without, {with_profile} us with realtime")
    assert with_profile <= max(without * 2, without + 100)  # no worse beyond noise


def test_data_plane_limits_through_systemd(tmp_path: Path) -> None:
    """For real: a process started as the data plane is in a scope of edge_agent.slice, a
    profile's limits reach the slice's cgroup files through systemd, and rollback restores
    what systemctl showed before.  Needs root, systemd and cgroup v2."""
    from agent.discovery import discover
    from agent.kernel.fsroot import Root
    from agent.tuning.engine import Engine
    from agent.tuning.journal import Journal
    from agent.tuning.placement import SystemdPlacement, detect
    from agent.tuning.profiles import ProfileStore
    from agent.tuning.units import SLICE

    root = Root("/")
    topology = discover(root)
    placement = detect(root, topology)
    if not isinstance(placement, SystemdPlacement) or os.geteuid() != 0:
        pytest.skip(f"needs root, systemd and cgroup v2 (placement: {placement.mode})")
    assert placement.units is not None
    names = ["MemoryMax", "MemoryHigh", "CPUQuota", "CPUWeight", "AllowedCPUs"]
    before = placement.units.show(SLICE, names)
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    (profiles / "hil-limits.yaml").write_text(
        "cgroup: {memory_max: 512M, memory_high: 256M, cpu_max: '50000 100000', "
        "cpu_weight: 50, cpus: '0'}\n")
    engine = Engine(root, topology, Journal(tmp_path / "state"),
                    ProfileStore(root, dirs=[profiles]), placement)
    child = subprocess.Popen(placement.command(["sleep", "60"], 1))
    try:
        cgroup = Path(f"/proc/{child.pid}/cgroup").read_text()
        assert f"0::/{SLICE}/edge-agent-serve-" in cgroup, cgroup
        engine.apply("hil-limits", force=True)
        files = Path("/sys/fs/cgroup") / SLICE
        assert (files / "memory.max").read_text().strip() == str(512 * 2**20)
        assert (files / "memory.high").read_text().strip() == str(256 * 2**20)
        assert (files / "cpu.max").read_text().split()[0] == "50000"
        assert (files / "cpu.weight").read_text().strip() == "50"
        assert (files / "cpuset.cpus").read_text().strip() == "0"
        assert engine.verify() == []
    finally:
        engine.rollback()
        child.kill()
        child.wait()
    assert placement.units.show(SLICE, names) == before
