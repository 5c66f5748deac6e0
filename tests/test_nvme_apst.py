"""NVMe APST: the profile's latency limit reaches the live controllers (their
pm_qos_latency_tolerance_us), the module parameter (controllers probed later) and the kernel
command line (reboots), and every piece rolls back byte for byte."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
from test_overlays import JETSON_EXTLINUX
from tuning_helpers import FIXTURES, copy_board, engine_for, snapshot, write_profile

from agent.kernel.fsroot import Root
from agent.tuning.errors import ProfileError

CONTROLLER = "sys/class/nvme/{}/power/pm_qos_latency_tolerance_us"
PARAMETER = "sys/module/nvme_core/parameters/default_ps_max_latency_us"
PROFILE = "nvme: {default_ps_max_latency_us: 5500}\n"


def test_the_committed_trees_show_the_probe_time_tolerance() -> None:
    """APST-capable controllers expose their tolerance, set from the parameter at probe
    (nvme_init_ctrl): it reads the parameter's default, 100000, not auto."""
    for board in ("jetson-orin-nano-jp6", "x86-server-nvidia"):
        tree = FIXTURES / board
        assert (tree / CONTROLLER.format("nvme0")).read_text() == "100000\n"
        assert (tree / PARAMETER).read_text() == "100000\n"
    assert not (FIXTURES / "x86-server-nvidia" / CONTROLLER.format("nvme1")).exists()


def test_the_live_controllers_the_parameter_and_the_boot_config(tmp_path: Path) -> None:
    tree = copy_board("jetson-orin-nano-jp6", tmp_path)
    extlinux = tree / "boot/extlinux/extlinux.conf"
    extlinux.parent.mkdir(parents=True, exist_ok=True)
    extlinux.write_text(JETSON_EXTLINUX)
    write_profile(tmp_path / "profiles", "apst", PROFILE)
    engine = engine_for(tree, tmp_path / "state", [tmp_path / "profiles"], persistent=True)
    before = snapshot(tree)
    plan = engine.plan("apst")
    assert [(c.tuner, c.path, c.current, c.desired) for c in plan.changes] == [
        ("nvme", "/sys/class/nvme/nvme0/power/pm_qos_latency_tolerance_us", "100000", "5500"),
        ("nvme", f"/{PARAMETER}", "100000", "5500"),
        ("cmdline", "cmdline:nvme_core.default_ps_max_latency_us", "",
         "nvme_core.default_ps_max_latency_us=5500")]
    engine.apply("apst")
    assert (tree / CONTROLLER.format("nvme0")).read_text() == "5500\n"
    assert "nvme_core.default_ps_max_latency_us=5500" in extlinux.read_text()
    assert engine.verify() == []
    engine.rollback()
    assert snapshot(tree) == before


def test_without_a_boot_config_the_live_value_is_set_and_the_reboot_named(
        tmp_path: Path) -> None:
    """x86-server-nvidia: two controllers, nvme1 without APST; no boot config to edit."""
    tree = copy_board("x86-server-nvidia", tmp_path)
    write_profile(tmp_path / "profiles", "apst", PROFILE)
    engine = engine_for(tree, tmp_path / "state", [tmp_path / "profiles"])
    plan = engine.plan("apst")
    assert [c.path for c in plan.changes] == [
        "/sys/class/nvme/nvme0/power/pm_qos_latency_tolerance_us", f"/{PARAMETER}"]
    assert any(w.startswith("nvme.default_ps_max_latency_us: nvme1 skipped: it does not "
                            "support APST") for w in plan.warnings)
    assert any("not kept across a reboot" in w for w in plan.warnings)


def test_the_fixture_kernel_refuses_what_the_tolerance_file_refuses(tmp_path: Path) -> None:
    tree = copy_board("x86-server-nvidia", tmp_path)
    path = "/" + CONTROLLER.format("nvme0")
    for bad in ("-1", "soon"):
        with pytest.raises(OSError) as caught:
            Root(tree).write_text(path, bad)
        assert caught.value.errno == errno.EINVAL
    Root(tree).write_text(path, "auto")
    assert (tree / CONTROLLER.format("nvme0")).read_text() == "auto\n"


def test_above_s32_max_is_refused_by_the_schema(tmp_path: Path) -> None:
    tree = copy_board("x86-server-nvidia", tmp_path)
    write_profile(tmp_path / "profiles", "apst", "nvme: {default_ps_max_latency_us: "
                  "2147483647}\n")
    with pytest.raises(ProfileError) as caught:
        engine_for(tree, tmp_path / "state", [tmp_path / "profiles"]).plan("apst")
    assert caught.value.key == "nvme.default_ps_max_latency_us"
    assert "2147483646" in caught.value.message  # S32_MAX would read back as "any"
