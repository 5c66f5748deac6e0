"""Settings that survive a reboot: kernel arguments in the boot config, irqbalance's banned
CPUs, LimitMEMLOCK drop-ins, and the persistent journal that keeps their originals.

Boot configs are the installer's real layouts (Armbian, Radxa extlinux, Jetson extlinux) on
copies of the fixture boards; arguments and overlays are installed and removed in every
order, and each ending is byte for byte the start.  A reboot is simulated by a new boot id.
"""

from __future__ import annotations

import itertools
import json
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from test_overlays import ARMBIAN_ENV, JETSON_EXTLINUX, RADXA_EXTLINUX, TEGRA
from tuning_helpers import copy_board, snapshot, write_profile

from agent.cli import main
from agent.discovery import discover
from agent.kernel.fsroot import Root
from agent.overlays import kargs
from agent.overlays.bootfs import BootFiles
from agent.overlays.layouts import Layout, detect
from agent.tuning.engine import Engine
from agent.tuning.errors import ProfileError
from agent.tuning.journal import Journal
from agent.tuning.kinds import ABSENT, KINDS
from agent.tuning.profiles import ProfileStore
from agent.tuning.schema import validate_profile

IRQBALANCE_DEFAULT = """\
# irqbalance is a daemon process that distributes interrupts across
# CPUs on SMP systems.
#
#IRQBALANCE_ONESHOT=
#
# IRQBALANCE_BANNED_CPULIST
#    The CPUs list which allows you to indicate which CPUs should
#    be skipped when reblancing IRQs.
#
#IRQBALANCE_BANNED_CPULIST=
#
#IRQBALANCE_ARGS=
"""
UNIT = "lib/systemd/system/irqbalance.service"


def _boot(tree: Path, files: dict[str, str]) -> Path:
    for path, text in files.items():
        (tree / path).parent.mkdir(parents=True, exist_ok=True)
        (tree / path).write_text(text)
    return tree


BOARDS: dict[str, tuple[str, dict[str, str]]] = {
    "armbian": ("rk3588-mainline", {"boot/armbianEnv.txt": ARMBIAN_ENV}),
    "radxa-extlinux": ("rk3588-vendor", {"boot/extlinux/extlinux.conf": RADXA_EXTLINUX,
                                         "etc/default/u-boot":
                                         'U_BOOT_FDT_OVERLAYS_DIR="/boot/dtbo/"\n'}),
    "jetson-extlinux": ("jetson-orin-nano-jp6", {"boot/extlinux/extlinux.conf":
                                                 JETSON_EXTLINUX}),
}


def board(layout: str, tmp_path: Path) -> Path:
    name, files = BOARDS[layout]
    return _boot(copy_board(name, tmp_path), files)


def engine(tree: Path, state: Path, profiles: Path, persistent: bool = True) -> Engine:
    root = Root(tree)
    return Engine(root, discover(root), Journal(state), ProfileStore(root, dirs=[profiles]),
                  persistent=persistent)


def reboot(tree: Path) -> None:
    (tree / "proc/sys/kernel/random/boot_id").write_text(f"{uuid.uuid4()}\n")


# -- tokens ---------------------------------------------------------------------------------

@pytest.mark.parametrize("token", ["isolcpus=4-7 init=/bin/sh", "a=\"x\"", "a=$(id)",
                                   "nohz_full=1\ninit=/x", "x=1;y", "x=`a`", "#x"])
def test_a_token_that_would_add_arguments_is_refused(token: str) -> None:
    with pytest.raises(ValueError, match="not a plain kernel argument"):
        kargs.set_token("root=/dev/x", kargs.name_of(token), token)


@pytest.mark.parametrize("value", ["4-7 init=/bin/sh", "cpus:4-7\n", "'4'", "$X"])
def test_the_schema_refuses_injection_in_argument_values(value: str) -> None:
    with pytest.raises(ProfileError, match="no spaces, quotes or"):
        validate_profile({"cmdline": {"nohz_full": value}}, "p.yaml")


def test_dashes_and_underscores_name_the_same_parameter() -> None:
    # kernel/params.c parameq(): '-' and '_' are equivalent in parameter names
    assert kargs.find("a nvme.poll-queues=2 b", "nvme.poll_queues") == "nvme.poll-queues=2"
    assert kargs.set_token("a nvme.poll-queues=2", "nvme.poll_queues", "nvme.poll_queues=4") \
        == "a nvme.poll_queues=4"


# -- the boot layouts: arguments and overlays in any order ----------------------------------

OVERLAY_PATHS = {"armbian": "ov", "radxa-extlinux": "x", "jetson-extlinux": "x"}


def _layout(layout: str, tmp_path: Path) -> tuple[Layout, str]:
    tree = board(layout, tmp_path)
    root = Root(tree)
    found = detect(root, BootFiles(root))
    return found, (tree / found.config.lstrip("/")).read_text()


def _steps(found: Layout) -> dict[str, tuple[Callable[[str], str], Callable[[str], str]]]:
    """name -> (install, remove) of two overlays and two arguments (one already present in
    the source entry with another value on extlinux: root=)."""
    return {
        "ov1": (lambda t: found.register(t, "one"), lambda t: found.unregister(t, "one")),
        "ov2": (lambda t: found.register(t, "two"), lambda t: found.unregister(t, "two")),
        "isol": (lambda t: found.set_argument(t, "isolcpus", "isolcpus=managed_irq,domain,4-7"),
                 lambda t: found.set_argument(t, "isolcpus", "")),
        "nohz": (lambda t: found.set_argument(t, "nohz_full", "nohz_full=4-7"),
                 lambda t: found.set_argument(t, "nohz_full", "")),
    }


@pytest.mark.parametrize("layout", list(BOARDS))
def test_arguments_and_overlays_install_and_remove_in_any_order_byte_for_byte(
        layout: str, tmp_path: Path) -> None:
    found, original = _layout(layout, tmp_path)
    steps = _steps(found)
    for installs in itertools.permutations(steps):
        text = original
        for name in installs:
            text = steps[name][0](text)
        assert found.argument(text, "isolcpus") == "isolcpus=managed_irq,domain,4-7"
        for removes in itertools.permutations(steps):
            undone = text
            for name in removes:
                undone = steps[name][1](undone)
            assert undone == original, (installs, removes)


@pytest.mark.parametrize("layout", ["radxa-extlinux", "jetson-extlinux"])
def test_extlinux_arguments_go_on_the_copy_never_the_booting_entry(
        layout: str, tmp_path: Path) -> None:
    found, original = _layout(layout, tmp_path)
    text = found.set_argument(original, "nohz_full", "nohz_full=4-7")
    lines = text.splitlines()
    copy = lines.index(next(line for line in lines if line.lower() == "label edge-agent"))
    source = next(i for i, line in enumerate(lines) if line.lower().startswith("label ")
                  and i != copy)
    assert "nohz_full=4-7" in "\n".join(lines[copy:source])
    assert "nohz_full" not in "\n".join(lines[source:])
    assert lines[copy - 1].startswith("# edge-agent settings: a copy of LABEL ")
    assert any(line.lower() == "default edge-agent" for line in lines)


def test_an_argument_already_in_the_source_entry_is_replaced_on_the_copy(tmp_path: Path) -> None:
    found, original = _layout("jetson-extlinux", tmp_path)
    source = original.replace("rootfstype=ext4", "rootfstype=ext4 isolcpus=2-3")
    assert found.argument(source, "isolcpus") == "isolcpus=2-3"
    text = found.set_argument(source, "isolcpus", "isolcpus=4-5")
    assert text.count("isolcpus=2-3") == 1 and text.count("isolcpus=4-5") == 1
    assert found.argument(text, "isolcpus") == "isolcpus=4-5"
    assert found.set_argument(text, "isolcpus", "isolcpus=2-3") == source


def test_armbian_adds_extraargs_and_keeps_an_existing_line(tmp_path: Path) -> None:
    found, original = _layout("armbian", tmp_path)
    text = found.set_argument(original, "nohz_full", "nohz_full=4-7")
    assert text == original + "extraargs=nohz_full=4-7\n"
    existing = original + "extraargs=usbcore.autosuspend=-1\n"
    text = found.set_argument(existing, "nohz_full", "nohz_full=4-7")
    assert text.endswith("extraargs=usbcore.autosuspend=-1 nohz_full=4-7\n")
    assert found.set_argument(text, "nohz_full", "") == existing


def test_jetpack5_takes_arguments_though_it_has_no_overlays(tmp_path: Path) -> None:
    tree = _boot(copy_board("jetson-xavier-nx-jp5-rt", tmp_path),
                 {"boot/extlinux/extlinux.conf": JETSON_EXTLINUX})
    root = Root(tree)
    found = detect(root, BootFiles(root), overlays=False)
    assert found.kind == "jetson" and found.notes == ()
    assert KINDS["cmdline"].read(root, "cmdline:isolcpus") == ""


# -- the engine: plan, apply, verify, reboot, rollback --------------------------------------

PROFILE = """
rt: {housekeeping_cpus: cpus:0-1}
cmdline:
  isolcpus: managed_irq,domain,cpus:4-5
  nohz_full: cpus:4-5
  rcu_nocbs: cpus:4-5
  irqaffinity: housekeeping
irqbalance: {banned_cpus: cpus:4-5}
sysctl: {vm.swappiness: 7}
"""


def _jetson(tmp_path: Path, irqbalance: str | None = IRQBALANCE_DEFAULT,
            version: str | None = "1.8.0-1build1") -> Path:
    """JetPack 6 (Ubuntu 22.04) with irqbalance ``version`` installed (None: not by dpkg)."""
    tree = board("jetson-extlinux", tmp_path)
    files = {UNIT: "[Service]\nEnvironmentFile=-/etc/default/irqbalance\n"}
    if version is not None:
        status = tree / "var/lib/dpkg/status"
        files["var/lib/dpkg/status"] = status.read_text() + (
            f"\nPackage: irqbalance\nStatus: install ok installed\nVersion: {version}\n")
    if irqbalance is not None:
        files["etc/default/irqbalance"] = irqbalance
    return _boot(tree, files)


def test_plan_marks_arguments_persistent_and_effective_after_reboot(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tree = _jetson(tmp_path)
    write_profile(tmp_path / "profiles", "lasting", PROFILE)
    plan = engine(tree, tmp_path / "state", tmp_path / "profiles").plan("lasting")
    by_path = {c.path: c for c in plan.changes}
    assert by_path["cmdline:isolcpus"].desired == "isolcpus=managed_irq,domain,4-5"
    assert by_path["cmdline:irqaffinity"].desired == "irqaffinity=0-1"  # rt's housekeeping
    assert by_path["cmdline:nohz_full"].note == "/boot/extlinux/extlinux.conf: takes effect " \
        "after reboot"
    assert by_path["/etc/default/irqbalance"].desired == \
        IRQBALANCE_DEFAULT + "IRQBALANCE_BANNED_CPULIST=4-5\n"  # the comments kept
    assert all(c.persistent for c in plan.changes if c.tuner != "sysctl")
    assert not by_path["/proc/sys/vm/swappiness"].persistent


def test_apply_survives_a_reboot_and_rollback_restores_byte_for_byte(tmp_path: Path) -> None:
    tree = _jetson(tmp_path)
    before = snapshot(tree)
    write_profile(tmp_path / "profiles", "lasting", PROFILE)
    cli = engine(tree, tmp_path / "state", tmp_path / "profiles")
    result = cli.apply("lasting")
    assert "not run below a fixture root: systemctl try-restart irqbalance.service" in \
        result.notes
    extlinux = (tree / "boot/extlinux/extlinux.conf").read_text()
    assert "isolcpus=managed_irq,domain,4-5 nohz_full=4-5 rcu_nocbs=4-5 irqaffinity=0-1" in \
        extlinux
    assert (tree / "etc/default/irqbalance").read_text().endswith(
        "IRQBALANCE_BANNED_CPULIST=4-5\n")
    assert cli.verify() == []
    lasting = json.loads((tmp_path / "state/tuning-persistent.json").read_text())
    assert {c["path"] for c in lasting["changes"]} == {
        "cmdline:isolcpus", "cmdline:nohz_full", "cmdline:rcu_nocbs", "cmdline:irqaffinity",
        "/etc/default/irqbalance"}

    reboot(tree)  # sysfs is fresh: the runtime journal is discarded, the persistent one kept
    (tree / "proc/sys/vm/swappiness").write_text("60\n")  # as the fresh boot has it
    after = engine(tree, tmp_path / "state", tmp_path / "profiles")
    profile, notes = after.rollback()
    assert profile == "lasting"
    assert any("is from another boot" in n for n in notes)
    assert not (tmp_path / "state/tuning-persistent.json").exists()
    assert snapshot(tree) == {**before, "proc/sys/kernel/random/boot_id":
                              snapshot(tree)["proc/sys/kernel/random/boot_id"]}


def test_the_service_writes_no_persistent_setting_and_says_which_are_pending(
        tmp_path: Path) -> None:
    tree = _jetson(tmp_path)
    before = snapshot(tree)
    write_profile(tmp_path / "profiles", "lasting", PROFILE)
    service = engine(tree, tmp_path / "state", tmp_path / "profiles", persistent=False)
    result = service.apply("lasting")
    assert {c.path for c in result.pending} == {
        "cmdline:isolcpus", "cmdline:nohz_full", "cmdline:rcu_nocbs", "cmdline:irqaffinity",
        "/etc/default/irqbalance"}
    assert any("`sudo edge-agent profile apply lasting` does" in n for n in result.notes)
    changed = {k for k, v in snapshot(tree).items() if before.get(k) != v}
    assert changed == {"proc/sys/vm/swappiness"}
    assert not (tmp_path / "state/tuning-persistent.json").exists()
    service.rollback()
    assert snapshot(tree) == before


def test_the_service_rollback_leaves_the_persistent_settings_and_names_the_command(
        tmp_path: Path) -> None:
    tree = _jetson(tmp_path)
    write_profile(tmp_path / "profiles", "lasting", PROFILE)
    engine(tree, tmp_path / "state", tmp_path / "profiles").apply("lasting")
    applied = (tree / "boot/extlinux/extlinux.conf").read_text()
    _, notes = engine(tree, tmp_path / "state", tmp_path / "profiles",
                      persistent=False).rollback()
    assert any("`sudo edge-agent profile rollback` restores them" in n for n in notes)
    assert (tree / "boot/extlinux/extlinux.conf").read_text() == applied
    assert (tmp_path / "state/tuning-persistent.json").exists()


def test_switching_profiles_keeps_the_true_originals_of_persistent_settings(
        tmp_path: Path) -> None:
    tree = _jetson(tmp_path)
    extlinux = tree / "boot/extlinux/extlinux.conf"
    extlinux.write_text(JETSON_EXTLINUX.replace("rootfstype=ext4", "rootfstype=ext4 "
                                                "nohz_full=3"))
    before = snapshot(tree)
    profiles = tmp_path / "profiles"
    write_profile(profiles, "first", "cmdline: {nohz_full: cpus:4-5, rcu_nocbs: cpus:4-5}\n")
    write_profile(profiles, "second", "cmdline: {nohz_full: cpus:2-5}\n"
                  "irqbalance: {banned_cpus: cpus:2-5}\n")
    cli = engine(tree, tmp_path / "state", profiles)
    cli.apply("first")
    reboot(tree)
    cli = engine(tree, tmp_path / "state", profiles)
    cli.apply("second")  # rcu_nocbs goes back to absent; nohz_full keeps its original 3
    text = extlinux.read_text()
    assert "rcu_nocbs" not in text and "nohz_full=2-5" in text
    kept = {c.path: c for c in Journal.persistent(tmp_path / "state").load().changes}
    assert kept["cmdline:nohz_full"].current == "nohz_full=3"
    assert kept["/etc/default/irqbalance"].current == IRQBALANCE_DEFAULT
    cli.rollback()
    assert snapshot(tree) == {**before, "proc/sys/kernel/random/boot_id":
                              snapshot(tree)["proc/sys/kernel/random/boot_id"]}


def test_irqbalance_config_that_did_not_exist_is_removed_again(tmp_path: Path) -> None:
    tree = _jetson(tmp_path, irqbalance=None)
    before = snapshot(tree)
    write_profile(tmp_path / "profiles", "ban", "irqbalance: {banned_cpus: cpus:2-5}\n")
    cli = engine(tree, tmp_path / "state", tmp_path / "profiles")
    [change] = cli.plan("ban").changes
    assert change.current is None and change.restore == ABSENT
    cli.apply("ban")
    assert (tree / "etc/default/irqbalance").read_text().startswith(
        "IRQBALANCE_BANNED_CPULIST=")
    cli.rollback()
    assert snapshot(tree) == before


def test_irq_affinity_without_a_ban_is_warned_about_where_irqbalance_is_installed(
        tmp_path: Path) -> None:
    tree = _jetson(tmp_path)
    (tree / "etc/systemd/system/multi-user.target.wants").mkdir(parents=True)
    (tree / "etc/systemd/system/multi-user.target.wants/irqbalance.service").symlink_to(
        "/" + UNIT)
    write_profile(tmp_path / "profiles", "irqs", "rt: {irq_affinity: {'*': cpus:0-1}}\n")
    plan = engine(tree, tmp_path / "state", tmp_path / "profiles").plan("irqs")
    assert any(w.startswith("rt.irq_affinity: irqbalance is enabled") for w in plan.warnings)


def test_memlock_drop_in_on_a_kernel_before_5_12_and_skipped_after(tmp_path: Path) -> None:
    old = copy_board("jetson-xavier-nx-jp5-rt", tmp_path)  # 5.10
    before = snapshot(old)
    text = "io_uring: {limit_memlock: {units: [edge-agent.service], value: 64M}}\n"
    write_profile(tmp_path / "profiles", "memlock", text)
    cli = engine(old, tmp_path / "state", tmp_path / "profiles")
    result = cli.apply("memlock")
    drop_in = old / "etc/systemd/system/edge-agent.service.d/edge-agent-memlock.conf"
    assert drop_in.read_text().endswith("[Service]\nLimitMEMLOCK=67108864\n")
    assert "not run below a fixture root: systemctl daemon-reload" in result.notes
    cli.rollback()
    assert snapshot(old) == before
    assert not drop_in.parent.exists()

    new = copy_board("jetson-orin-nano-jp6", tmp_path)  # 5.15
    plan = engine(new, tmp_path / "state2", tmp_path / "profiles").plan("memlock")
    assert plan.changes == []
    assert any("memory cgroup" in w for w in plan.warnings)


def test_the_file_kind_writes_only_its_allowlist_and_never_out_of_the_root(
        tmp_path: Path) -> None:
    tree = _jetson(tmp_path)
    root = Root(tree)
    with pytest.raises(OSError, match="edge-agent writes nothing outside"):
        KINDS["file"].write(root, "/etc/passwd", "x")
    with pytest.raises(OSError, match="edge-agent writes nothing outside"):
        KINDS["file"].write(root, "/etc/systemd/system/a.d/other.conf", "x")
    (tree / "etc/default/irqbalance").unlink()
    (tree / "etc/default/irqbalance").symlink_to("/etc/shadow")
    with pytest.raises(OSError, match="irqbalance: a link to /etc/shadow, which leaves"):
        KINDS["file"].write(root, "/etc/default/irqbalance", "x")


def test_a_journal_written_before_the_persistent_field_still_loads(tmp_path: Path) -> None:
    (tmp_path / "tuning-journal.json").write_text(json.dumps({
        "schema": "tuning-journal/1", "profile": "old", "boot_id": "b", "root": "/",
        "status": "applied", "created_ms": 1, "runtime": {}, "changes": [
            {"tuner": "sysctl", "path": "/proc/sys/vm/swappiness", "current": "60",
             "desired": "10", "key": "sysctl.vm.swappiness", "compare": "value",
             "write": None, "restore": None, "note": None}]}))
    [change] = Journal(tmp_path).load().changes
    assert change.persistent is False


def test_cli_plan_apply_status_and_after_failure_rollback(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    tree = _jetson(tmp_path)
    profiles = tree / "etc/edge-agent/profiles"
    write_profile(profiles, "lasting", "cmdline: {nohz_full: cpus:4-5}\n")
    state = ["--root", str(tree), "--state-dir", str(tmp_path / "state")]
    assert main(["profile", "plan", "lasting", *state]) == 0
    out = capsys.readouterr().out
    assert "takes effect after reboot" in out and "sudo edge-agent profile apply lasting" in out
    assert main(["profile", "apply", "lasting", *state]) == 0
    capsys.readouterr()
    assert main(["profile", "status", *state]) == 0
    out = capsys.readouterr().out
    assert "cmdline:nohz_full: in the boot config; takes effect after reboot" in out
    monkeypatch.setenv("SERVICE_RESULT", "exit-code")
    assert main(["profile", "rollback", "--after-failure", *state]) == 0
    assert "nohz_full=4-5" in (tree / "boot/extlinux/extlinux.conf").read_text()
    assert main(["profile", "rollback", *state]) == 0
    assert (tree / "boot/extlinux/extlinux.conf").read_text() == JETSON_EXTLINUX


@pytest.mark.parametrize(("text", "message"), [
    ("cmdline: {transparent_hugepage: sometimes}", "allowed: always, madvise, never"),
    ("cmdline: {nvme.poll_queues: many}", "allowed: an integer >= 0"),
    ("cmdline: {nohz_full: cpus:40-47}", "names CPUs this device does not have"),
    ("cmdline: {init: /bin/sh}", "one of isolcpus, nohz_full"),
])
def test_bad_argument_values_name_the_key_and_what_is_allowed(
        text: str, message: str, tmp_path: Path) -> None:
    tree = _jetson(tmp_path)
    write_profile(tmp_path / "profiles", "bad", text + "\n")
    with pytest.raises(ProfileError, match=message):
        engine(tree, tmp_path / "state", tmp_path / "profiles").plan("bad")


def test_arguments_without_an_editable_boot_config_are_an_error_unless_optional(
        tmp_path: Path) -> None:
    tree = copy_board("x86-server-nvidia", tmp_path)  # GRUB: no layout edge-agent edits
    profiles = tmp_path / "profiles"
    write_profile(profiles, "args", "cmdline: {nohz_full: cpus:1}\n")
    write_profile(profiles, "maybe", "cmdline: {nohz_full: cpus:1}\noptional: [cmdline]\n")
    cli = engine(tree, tmp_path / "state", profiles)
    with pytest.raises(ProfileError, match="no boot config edge-agent can edit"):
        cli.plan("args")
    assert any(w.startswith("cmdline: skipped: no boot config") for w in
               cli.plan("maybe").warnings)


def test_the_service_logs_pending_persistent_settings_with_the_command(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from agent.service.tuning import Tuning

    tree = _jetson(tmp_path)
    profiles = tree / "etc/edge-agent/profiles"
    write_profile(profiles, "lasting", PROFILE)
    before = (tree / "boot/extlinux/extlinux.conf").read_bytes()
    root = Root(tree)
    tuning = Tuning(root, discover(root), tmp_path / "state", "lasting", True,
                    lambda *a, **k: None)
    with caplog.at_level("WARNING"):
        tuning.start()
    assert tuning.applied and tuning.error is None
    assert "5 persistent setting(s) of lasting pending" in caplog.text
    assert "run `sudo edge-agent profile apply lasting`" in caplog.text
    assert (tree / "boot/extlinux/extlinux.conf").read_bytes() == before
    tuning.rollback()


@pytest.mark.parametrize("overlay_last", [False, True])
def test_the_overlay_installer_and_the_engine_share_the_copy_in_either_order(
        overlay_last: bool, tmp_path: Path) -> None:
    from agent.overlays import build, installer

    tree = _jetson(tmp_path)
    dt = tree / "sys/firmware/devicetree/base"  # /proc/device-tree, as check_board reads it
    (dt / "compatible").write_text(TEGRA)
    (dt / "__symbols__").mkdir(exist_ok=True)
    (dt / "thermal-zones/cpu-thermal").mkdir(parents=True, exist_ok=True)
    before = snapshot(tree)
    write_profile(tmp_path / "profiles", "args", "cmdline: {nohz_full: cpus:4-5}\n")
    cli = engine(tree, tmp_path / "state", tmp_path / "profiles")
    root = Root(tree)
    overlay = build.from_entry("jetson-orin-cpu-alert")
    installer.install(root, overlay)
    cli.apply("args")
    text = (tree / "boot/extlinux/extlinux.conf").read_text()
    assert text.count("LABEL edge-agent") == 1 and "nohz_full=4-5" in text
    assert "OVERLAYS /boot/jetson-orin-cpu-alert.dtbo" in text
    if overlay_last:
        cli.rollback()
        installer.remove(root, "jetson-orin-cpu-alert")
    else:
        installer.remove(root, "jetson-orin-cpu-alert")
        assert "nohz_full=4-5" in (tree / "boot/extlinux/extlinux.conf").read_text()
        cli.rollback()
    assert snapshot(tree) == before


@pytest.mark.parametrize(("version", "lines"), [
    ("1.8.0-1build1", ["IRQBALANCE_BANNED_CPULIST=4-5"]),
    ("1.6.0-3ubuntu1", ["IRQBALANCE_BANNED_CPUS=30"]),  # JetPack 5: only the hex mask
    (None, ["IRQBALANCE_BANNED_CPULIST=4-5", "IRQBALANCE_BANNED_CPUS=30"])])  # unknown: both
def test_irqbalance_gets_the_variable_its_version_reads(
        version: str | None, lines: list[str], tmp_path: Path) -> None:
    tree = _jetson(tmp_path, version=version)
    write_profile(tmp_path / "profiles", "ban", "irqbalance: {banned_cpus: cpus:4-5}\n")
    cli = engine(tree, tmp_path / "state", tmp_path / "profiles")
    (change,) = cli.plan("ban").changes
    assert change.desired == IRQBALANCE_DEFAULT + "".join(f"{line}\n" for line in lines)
    before = snapshot(tree)
    cli.apply("ban")
    assert cli.verify() == []
    cli.rollback()
    assert snapshot(tree) == before
