"""Jetson: the nvpmodel mode (a persistent kind run through ``nvpmodel -m``) and the
jetson_clocks section, planned, applied, verified and rolled back on copies of the Jetson
fixture boards.  Nothing runs nvpmodel here: the runner is injected, or the fixture model
stands in for it."""

from __future__ import annotations

import errno
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tuning_helpers import copy_board, engine_for, snapshot, write_profile

from agent.kernel.fsroot import Root
from agent.tuning import kinds, nvpmodel_mode
from agent.tuning.engine import Engine
from agent.tuning.errors import ProfileError
from agent.tuning.fan import FanKind
from agent.tuning.journal import FILE_NAME, PERSISTENT_FILE
from agent.tuning.nvpmodel_mode import COMPARE, PATH, NvpmodelMode

EMC = "/sys/kernel/debug/bpmp/debug/clk/emc"
AGX_GPU = "/sys/class/devfreq/17000000.ga10b"
NANO_GPU = "/sys/class/devfreq/17000000.gpu"
AGX_FAN = "/sys/devices/platform/pwm-fan/hwmon/hwmon3/pwm1"
NANO_FAN = "/sys/devices/platform/pwm-fan/hwmon/hwmon2/pwm1"
CLOCKS = ("jetson_clocks: {gpu: max, railgate: off, emc: max, fan: max}\n"
          "optional: [jetson_clocks.emc]\n")


@pytest.fixture(autouse=True)
def nvpmodel_kind(monkeypatch: pytest.MonkeyPatch) -> Iterator[NvpmodelMode]:
    """A fresh nvpmodel kind in the engine's registry for each test (its runner can be
    replaced there without touching the others)."""
    kind = NvpmodelMode()
    monkeypatch.setitem(kinds.KINDS, COMPARE, kind)
    yield kind


def board_engine(tmp_path: Path, board: str, profile: str) -> tuple[Path, Engine]:
    tree = copy_board(board, tmp_path)
    profiles = tmp_path / "profiles"
    write_profile(profiles, "p", profile)
    return tree, engine_for(tree, tmp_path / "state", [profiles], persistent=True)


def planned(engine: Engine) -> dict[str, str]:
    return {c.path: c.desired for c in engine.plan("p").changes}


def round_trip(tree: Path, engine: Engine, handed_back: tuple[str, ...] = ()) -> None:
    """apply, verify clean, rollback byte for byte (but the ``handed_back`` fan files, which
    rollback leaves to nvfancontrol), journal gone."""
    before = snapshot(tree)
    plan = engine.plan("p")
    assert snapshot(tree) == before, "plan must not write"
    result = engine.apply("p")
    assert [c.path for c in result.written] == [c.path for c in plan.changes]
    assert engine.verify() == []
    assert snapshot(tree) != before
    assert engine.rollback()[0] == "p"
    after = snapshot(tree)
    for path in handed_back:
        assert after.pop(path.lstrip("/")) != before.pop(path.lstrip("/"))
    assert after == before
    assert not (tree.parent / "state" / FILE_NAME).exists()
    assert not (tree.parent / "state" / PERSISTENT_FILE).exists()


# -- jetson_clocks -------------------------------------------------------------------------

def test_jetson_clocks_on_agx_orin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tree, engine = board_engine(tmp_path, "jetson-agx-orin-jp6", CLOCKS)
    plan = engine.plan("p")
    assert [(c.path, c.current, c.desired) for c in plan.changes] == [
        (f"{AGX_GPU}/min_freq", "306000000", "612000000"),  # = max_freq (MODE_30W's cap)
        (f"{AGX_GPU}/device/railgate_enable", "1", "0"),
        (f"{EMC}/mrq_rate_locked", "0", "1"),  # locked before the rate is set
        (f"{EMC}/rate", "2133000000", "3199000000"),  # MODE_30W has no EMC cap: max_rate
        (AGX_FAN, "86", "255")]
    assert any("nvfancontrol.service is enabled" in w for w in plan.warnings)
    restarted: list[list[str]] = []
    monkeypatch.setitem(kinds.KINDS, "fan", FanKind(lambda argv: (restarted.append(argv),
                                                                   (0, ""))[1]))
    round_trip(tree, engine, handed_back=(AGX_FAN,))  # nvfancontrol rewrites it, not we
    assert restarted == [["systemctl", "restart", "nvfancontrol.service"]]


def test_jetson_clocks_on_orin_nano(tmp_path: Path) -> None:
    tree, engine = board_engine(tmp_path, "jetson-orin-nano-jp6", CLOCKS)
    plan = engine.plan("p")
    assert planned(engine) == {f"{NANO_GPU}/min_freq": "1020000000",
                               f"{NANO_GPU}/device/railgate_enable": "0",
                               f"{EMC}/mrq_rate_locked": "1", f"{EMC}/rate": "3199000000",
                               NANO_FAN: "255"}
    assert not any("nvfancontrol" in w for w in plan.warnings)  # not installed here
    round_trip(tree, engine)


def test_jetson_clocks_on_xavier_without_debugfs(tmp_path: Path) -> None:
    tree, engine = board_engine(tmp_path, "jetson-xavier-nx-jp5-rt", CLOCKS)
    plan = engine.plan("p")
    gpu = "/sys/class/devfreq/17000000.gv11b"
    assert planned(engine) == {f"{gpu}/min_freq": "1109250000",
                               f"{gpu}/device/railgate_enable": "0",
                               "/sys/devices/platform/pwm-fan/hwmon/hwmon1/pwm1": "255"}
    assert any(w.startswith("jetson_clocks.emc: skipped: debugfs not mounted")
               for w in plan.warnings)
    round_trip(tree, engine)


def test_emc_without_debugfs_is_an_error_when_the_profile_asks(tmp_path: Path) -> None:
    _, engine = board_engine(tmp_path, "jetson-xavier-nx-jp5-rt", "jetson_clocks: {emc: max}\n")
    with pytest.raises(ProfileError, match=r"p\.yaml: jetson_clocks\.emc: debugfs not "
                       r"mounted at /sys/kernel/debug"):
        engine.plan("p")


def test_emc_rate_outside_the_clock_range_is_refused(tmp_path: Path) -> None:
    _, engine = board_engine(tmp_path, "jetson-agx-orin-jp6",
                             "jetson_clocks: {emc: 4266000000}\n")
    with pytest.raises(ProfileError, match=r"jetson_clocks\.emc: 4266000000 Hz is outside "
                       r".*204000000\.\.3199000000 Hz; allowed: max"):
        engine.plan("p")


def test_emc_rate_write_above_max_rate_is_einval_as_on_the_device(tmp_path: Path) -> None:
    tree = copy_board("jetson-agx-orin-jp6", tmp_path)
    root = Root(tree)
    with pytest.raises(OSError) as error:
        root.write_text(f"{EMC}/rate", "4266000000")
    assert error.value.errno == errno.EINVAL
    assert root.read_text(f"{EMC}/rate") == "2133000000\n"
    with pytest.raises(OSError):
        root.write_text(AGX_FAN, "256")  # pwm-fan: duty 0..255


def test_fan_value_and_nvfancontrol_warning(tmp_path: Path) -> None:
    _, engine = board_engine(tmp_path, "jetson-agx-orin-jp6", "jetson_clocks: {fan: 200}\n")
    plan = engine.plan("p")
    assert planned(engine) == {AGX_FAN: "200"}
    warning = next(w for w in plan.warnings if "nvfancontrol" in w)
    assert "/etc/systemd/system/multi-user.target.wants/nvfancontrol.service" in warning
    assert "overwrites pwm1" in warning


@pytest.mark.parametrize(("section", "allowed"), [
    ("{fan: 256}", "max, or a PWM duty 0..255"), ("{gpu: min}", "one of max"),
    ("{railgate: on}", "off"), ("{emc: fast}", "max, or an EMC rate in Hz")])
def test_jetson_clocks_schema(tmp_path: Path, section: str, allowed: str) -> None:
    _, engine = board_engine(tmp_path, "jetson-orin-nano-jp6", f"jetson_clocks: {section}\n")
    with pytest.raises(ProfileError, match=allowed):
        engine.plan("p")


def test_jetson_sections_on_a_non_jetson_board(tmp_path: Path) -> None:
    _, engine = board_engine(tmp_path, "rk3588-vendor", "nvpmodel: {mode: MAXN}\n")
    with pytest.raises(ProfileError, match=r"nvpmodel: this device is a rockchip board, not "
                       r"an NVIDIA Jetson; allowed: nvpmodel on an NVIDIA Jetson"):
        engine.plan("p")
    write_profile(tmp_path / "profiles", "p", "nvpmodel: {mode: MAXN}\njetson_clocks: "
                  "{gpu: max}\noptional: [nvpmodel, jetson_clocks]\n")
    plan = engine.plan("p")
    assert plan.changes == []
    assert [w.split(":")[0] for w in plan.warnings] == ["nvpmodel", "jetson_clocks"]


# -- nvpmodel mode -------------------------------------------------------------------------

def test_nvpmodel_mode_switch_round_trip_on_orin_nano(tmp_path: Path) -> None:
    tree, engine = board_engine(tmp_path, "jetson-orin-nano-jp6", "nvpmodel: {mode: 25W}\n")
    plan = engine.plan("p")
    (change,) = plan.changes
    assert (change.tuner, change.path, change.current, change.desired, change.compare,
            change.persistent) == ("nvpmodel", PATH, "2", "1", COMPARE, True)
    assert plan.runtime["nvpmodel"] == {"mode": 1, "name": "25W",
                                        "caps_hz": {"EMC": 3199000000}}
    engine.apply("p")
    assert (tree / "var/lib/nvpmodel/status").read_text() == "pmode:0001\n"
    journal = json.loads((tmp_path / "state" / PERSISTENT_FILE).read_text())
    assert journal["changes"][0]["persistent"] is True
    assert engine.verify() == []
    engine.rollback()
    assert (tree / "var/lib/nvpmodel/status").read_text() == "pmode:0002\n"


def test_nvpmodel_round_trip_byte_exact(tmp_path: Path) -> None:
    tree, engine = board_engine(tmp_path, "jetson-orin-nano-jp6",
                                "nvpmodel: {mode: 0}\n" + CLOCKS)
    round_trip(tree, engine)


def test_nvpmodel_mode_by_id_or_name_and_unknown_modes(tmp_path: Path) -> None:
    _, engine = board_engine(tmp_path, "jetson-agx-orin-jp6", "nvpmodel: {mode: mode_30w}\n")
    plan = engine.plan("p")
    assert plan.changes == []  # the active mode, by name in any case
    assert plan.runtime["nvpmodel"] == {"mode": 2, "name": "MODE_30W", "caps_hz": {
        "DLA0_CORE": 1369600000, "DLA0_FALCON": None, "DLA1_CORE": 1369600000,
        "DLA1_FALCON": None, "EMC": None, "PVA0_AXI": None, "PVA0_VPS": 512000000}}
    write_profile(tmp_path / "profiles", "p", "nvpmodel: {mode: 2}\n")
    assert engine.plan("p").changes == []
    write_profile(tmp_path / "profiles", "p", "nvpmodel: {mode: 60W}\n")
    with pytest.raises(ProfileError, match=r"p\.yaml: nvpmodel\.mode: '60W' is not a power "
                       r"mode of /etc/nvpmodel\.conf on this device; allowed: 0 \(MAXN\), 1 "
                       r"\(MODE_15W\), 2 \(MODE_30W\), 3 \(MODE_50W\)"):
        engine.plan("p")
    write_profile(tmp_path / "profiles", "p", "nvpmodel: {mode: [1]}\n")
    with pytest.raises(ProfileError, match="a power mode id"):
        engine.plan("p")


def test_a_switch_that_changes_the_tpc_mask_is_refused(tmp_path: Path) -> None:
    tree, engine = board_engine(tmp_path, "jetson-agx-orin-jp6", "nvpmodel: {mode: MAXN}\n")
    with pytest.raises(ProfileError) as error:
        engine.plan("p")
    message = str(error.value)
    assert message.startswith(f"{tmp_path}/profiles/p.yaml: nvpmodel.mode: switching from "
                              "mode 2 (MODE_30W) to mode 0 (MAXN) changes TPC_POWER_GATING "
                              "TPC_PG_MASK (240 -> 0) in /etc/nvpmodel.conf")
    assert "never reboots" in message and "sudo nvpmodel -m 0" in message
    # the kind refuses it too, should a journal ever ask
    with pytest.raises(OSError, match="TPC_PG_MASK"):
        NvpmodelMode(run=lambda argv: pytest.fail("nvpmodel must not run")).write(
            Root(tree), PATH, "0")


def test_dvfs_and_gpu_max_follow_the_wanted_mode(tmp_path: Path) -> None:
    _, engine = board_engine(tmp_path, "jetson-orin-nano-jp6", "nvpmodel: {mode: 25W}\n"
                             "dvfs: {gpu: {min_hz: max}}\n")
    plan = engine.plan("p")
    assert plan.changes[0].path == PATH  # the switch comes first
    assert any(f"{NANO_GPU}/min_freq = 1020000000 is above the cap 918000000 of nvpmodel "
               "mode 25W" in w for w in plan.warnings)  # MAXN_SUPER, active now, has none
    write_profile(tmp_path / "profiles", "p", "nvpmodel: {mode: 25W}\n"
                  "jetson_clocks: {gpu: max, emc: max}\n")
    assert planned(engine) == {PATH: "1", f"{NANO_GPU}/min_freq": "918000000",  # 25W's caps
                               f"{EMC}/mrq_rate_locked": "1", f"{EMC}/rate": "3199000000"}
    write_profile(tmp_path / "profiles", "p", "nvpmodel: {mode: 15W}\n"
                  "jetson_clocks: {emc: 3199000000}\n")
    plan = engine.plan("p")
    assert any("3199000000 Hz is above the EMC cap 2133000000 Hz of nvpmodel mode 15W" in w
               for w in plan.warnings)


# -- the nvpmodel command ------------------------------------------------------------------

def test_nvpmodel_runs_as_a_fixed_argv(tmp_path: Path) -> None:
    tree = copy_board("jetson-orin-nano-jp6", tmp_path)
    calls: list[list[str]] = []

    def nvpmodel(argv: list[str]) -> tuple[int, str]:
        calls.append(argv)
        (tree / "var/lib/nvpmodel/status").write_text(f"pmode:{int(argv[2]):04d}\n")
        return 0, "NVPM WARN: fan mode is not set!"

    kind = NvpmodelMode(run=nvpmodel)
    kind.write(Root(tree), PATH, "0")
    assert calls == [["/usr/sbin/nvpmodel", "-m", "0"]]
    assert kind.read(Root(tree), PATH) == "0"
    kind.write(Root(tree), PATH, "0")  # already active: nothing runs
    assert len(calls) == 1


def test_nvpmodel_failures_are_errors(tmp_path: Path) -> None:
    tree = copy_board("jetson-orin-nano-jp6", tmp_path)
    with pytest.raises(OSError, match=r"/usr/sbin/nvpmodel -m 1 exited with status 255: "
                       "NVPM ERROR"):
        NvpmodelMode(run=lambda argv: (255, "NVPM ERROR: bad mode")).write(Root(tree), PATH, "1")
    with pytest.raises(OSError, match=r"returned, but /var/lib/nvpmodel/status shows mode 2"):
        NvpmodelMode(run=lambda argv: (0, "")).write(Root(tree), PATH, "1")
    with pytest.raises(OSError, match=r"allowed: 0 \(15W\), 1 \(25W\), 2 \(MAXN_SUPER\)"):
        NvpmodelMode().write(Root(tree), PATH, "7")


def test_run_command_uses_no_shell_and_a_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    def fake_run(argv: Any, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        seen.update(argv=argv, **kwargs)
        return subprocess.CompletedProcess(argv, 0, "ok\n", "")

    monkeypatch.setattr(nvpmodel_mode.subprocess, "run", fake_run)
    assert nvpmodel_mode.run_command(["/usr/sbin/nvpmodel", "-m", "1"]) == (0, "ok")
    assert seen["argv"] == ["/usr/sbin/nvpmodel", "-m", "1"]
    assert seen.get("shell", False) is False
    assert seen["stdin"] == subprocess.DEVNULL  # a reboot prompt reads EOF, never waits
    assert seen["timeout"] == nvpmodel_mode.TIMEOUT_S

    def slow(argv: Any, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        raise subprocess.TimeoutExpired(argv, kwargs["timeout"])

    monkeypatch.setattr(nvpmodel_mode.subprocess, "run", slow)
    with pytest.raises(OSError) as error:
        nvpmodel_mode.run_command(["/usr/sbin/nvpmodel", "-m", "1"])
    assert error.value.errno == errno.ETIMEDOUT


def test_a_mode_with_other_online_cpus_is_said_in_the_plan(tmp_path: Path) -> None:
    tree, engine = board_engine(tmp_path, "jetson-orin-nano-jp6", "nvpmodel: {mode: 15W}\n")
    assert not any("runs CPUs" in w for w in engine.plan("p").warnings)  # 0-5 in every mode
    conf = tree / "etc/nvpmodel/nvpmodel_p3767_0005_super.conf"
    text = conf.read_text()
    first = text.index("NAME=15W")
    conf.write_text(text[:first] + text[first:].replace("CORE_4 1", "CORE_4 0", 1)
                    .replace("CORE_5 1", "CORE_5 0", 1))
    warning = next(w for w in engine.plan("p").warnings if "runs CPUs" in w)
    assert warning.startswith("nvpmodel.mode: mode 0 (15W) runs CPUs 0-3, online now: 0-5")
