"""udev discovery and hot-plug watch against the real machine: real libudev, real uevents.

Enumeration is checked against an independent source, the sysfs tree itself.  The watch
tests make the kernel emit real uevents for a loop device they create with LOOP_CTL_ADD on
/dev/loop-control and remove afterwards, so nothing that exists on the host is touched;
they use ``source="kernel"`` because it works without udevd.  They need root and
/dev/loop-control, and skip without them.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from loop_devices import TIMEOUT_S, LoopDevices

from agent.discovery.udev import (
    HOTPLUG_ACTIONS,
    HotplugEvent,
    HotplugWatcher,
    UdevUnavailable,
    enumerate_devices,
    udev_running,
)

UDEV_LOGGER = "agent.discovery.udev"
REPO = Path(__file__).resolve().parent.parent


def run_python(code: str, *flags: str) -> str:
    """Run ``code`` in a fresh interpreter that can import ``agent`` from this checkout."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, *flags, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


def test_import_does_not_load_pyudev() -> None:
    """The CLI must start fast: pyudev (and libudev) load only when udev is actually used."""
    code = "import sys, agent.discovery.udev; print('pyudev' in sys.modules)"
    assert run_python(code) == "False"


def test_missing_pyudev_raises_udev_unavailable() -> None:
    """Without site-packages (-S) pyudev is really absent; both entry points say so."""
    code = """
from agent.discovery.udev import HotplugWatcher, UdevUnavailable, enumerate_devices
for attempt in (enumerate_devices, HotplugWatcher(print).start):
    try:
        attempt()
    except UdevUnavailable as exc:
        print(exc)
"""
    lines = run_python(code, "-S").splitlines()
    assert lines == ["pyudev is not installed: No module named 'pyudev'"] * 2


# --- udev_running -----------------------------------------------------------------------------


def test_udev_running_follows_the_control_socket(tmp_path: Path) -> None:
    assert not udev_running(str(tmp_path))
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as control:
        control.bind(str(tmp_path / "control"))
        assert udev_running(str(tmp_path))


def test_udev_running_false_without_run_dir(tmp_path: Path) -> None:
    assert not udev_running(str(tmp_path / "missing"))


# --- enumeration ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def libudev() -> None:
    """Skip when pyudev or libudev cannot be loaded (nothing here can run without them)."""
    try:
        enumerate_devices(())
    except UdevUnavailable as exc:
        pytest.skip(f"udev unavailable: {exc}")


def sysfs_class(subsystem: str) -> set[str]:
    """Device names in /sys/class/<subsystem>; devices are symlinks, plain files are not."""
    root = Path("/sys/class", subsystem)
    return (
        {entry.name for entry in root.iterdir() if entry.is_symlink()} if root.is_dir() else set()
    )


@pytest.mark.usefixtures("libudev")
@pytest.mark.parametrize("subsystem", ["block", "net", "accel", "drm", "nvme"])
def test_enumerate_matches_sysfs_class(subsystem: str) -> None:
    devices = enumerate_devices((subsystem,))
    assert {d.sys_name for d in devices} == sysfs_class(subsystem)
    assert all(d.subsystem == subsystem for d in devices)


@pytest.mark.usefixtures("libudev")
def test_enumerate_usb_lists_whole_devices_only() -> None:
    # In /sys/bus/usb/devices interfaces are named "<port>:<config>.<interface>".
    bus = Path("/sys/bus/usb/devices")
    expected = {e.name for e in bus.iterdir() if ":" not in e.name} if bus.is_dir() else set()
    assert {d.sys_name for d in enumerate_devices(("usb",))} == expected


@pytest.mark.usefixtures("libudev")
def test_enumerate_several_subsystems_sorted() -> None:
    devices = enumerate_devices(("net", "block"))
    assert {(d.subsystem, d.sys_name) for d in devices} == {
        ("block", n) for n in sysfs_class("block")
    } | {("net", n) for n in sysfs_class("net")}
    assert devices == sorted(devices, key=lambda d: (d.subsystem, d.sys_path))


def sysfs_lineage(sys_path: str) -> list[Path]:
    """The device directory and its ancestor devices (directories with a uevent file)."""
    path, lineage = Path(sys_path), []
    while path != Path("/sys/devices") and path != path.parent:
        if (path / "uevent").exists():
            lineage.append(path)
        path = path.parent
    return lineage


def sysfs_ids(lineage: list[Path]) -> tuple[str | None, str | None]:
    for path in lineage:
        subsystem = (path / "subsystem").resolve().name
        if subsystem == "pci":
            return (path / "vendor").read_text().strip(), (path / "device").read_text().strip()
        if subsystem == "usb" and (path / "idVendor").exists():
            vendor, model = (path / "idVendor").read_text(), (path / "idProduct").read_text()
            return f"0x{vendor.strip()}", f"0x{model.strip()}"
    return None, None


def sysfs_devnode(path: Path) -> str | None:
    for line in (path / "uevent").read_text().splitlines():
        key, _, value = line.partition("=")
        if key == "DEVNAME":
            return f"/dev/{value}"
    return None


@pytest.mark.usefixtures("libudev")
@pytest.mark.parametrize("subsystem", ["block", "net"])
def test_device_fields_match_sysfs(subsystem: str) -> None:
    for device in enumerate_devices((subsystem,)):
        real = os.path.realpath(f"/sys/class/{subsystem}/{device.sys_name}")
        lineage = sysfs_lineage(real)
        driver = next((p / "driver" for p in lineage if (p / "driver").is_symlink()), None)
        assert device.sys_path == real
        assert device.devnode == sysfs_devnode(lineage[0])
        assert device.driver == (driver.resolve().name if driver else None)
        assert (device.vendor_id, device.model_id) == sysfs_ids(lineage)


# --- hot-plug watch ---------------------------------------------------------------------------


@pytest.fixture
def watch() -> Iterator[list[HotplugWatcher]]:
    """Collects the watchers a test starts and stops them all, even when the test fails."""
    watchers: list[HotplugWatcher] = []
    yield watchers
    for watcher in watchers:
        watcher.stop()


def kernel_watch(
    watchers: list[HotplugWatcher], callback: Callable[[HotplugEvent], None]
) -> HotplugWatcher:
    """A started watch on "block" kernel uevents, stopped by the ``watch`` fixture."""
    watcher = HotplugWatcher(callback, subsystems=("block",), source="kernel")
    watchers.append(watcher)
    watcher.start()
    return watcher


def wait_for(events: queue.Queue[HotplugEvent], action: str, sys_name: str) -> HotplugEvent:
    """The next event with ``action`` on ``sys_name``; other devices' events are skipped."""
    deadline, seen = time.monotonic() + TIMEOUT_S, []
    while (left := deadline - time.monotonic()) > 0:
        try:
            event = events.get(timeout=left)
        except queue.Empty:
            break
        if (event.action, event.device.sys_name) == (action, sys_name):
            return event
        seen.append((event.action, event.device.sys_name))
    pytest.fail(f"no {action!r} event for {sys_name} within {TIMEOUT_S}s; saw {seen}")


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.mark.usefixtures("libudev")
def test_kernel_watch_sees_add_change_remove(
    loops: LoopDevices, watch: list[HotplugWatcher]
) -> None:
    delivered: list[HotplugEvent] = []
    events: queue.Queue[HotplugEvent] = queue.Queue()

    def record(event: HotplugEvent) -> None:
        delivered.append(event)
        events.put(event)

    watcher = kernel_watch(watch, record)
    # A second watch on "bdi": adding a loop device also adds its backing_dev_info device,
    # which the "block" watch must not deliver.
    bdi_events: queue.Queue[HotplugEvent] = queue.Queue()
    bdi_watcher = HotplugWatcher(bdi_events.put, subsystems=("bdi",), source="kernel")
    watch.append(bdi_watcher)
    bdi_watcher.start()
    assert watcher.running

    name = loops.add()
    added = wait_for(events, "add", name)
    assert added.device.subsystem == "block"
    assert added.device.sys_path == f"/sys/devices/virtual/block/{name}"
    assert added.device.devnode == f"/dev/{name}"
    wait_for(bdi_events, "add", Path("/sys/class/block", name, "dev").read_text().strip())
    loops.change(name)
    wait_for(events, "change", name)
    loops.remove(name)
    removed = wait_for(events, "remove", name)
    assert removed.device.sys_name == name

    watcher.stop()
    assert not watcher.running
    watcher.stop()  # idempotent
    assert all(e.device.subsystem == "block" for e in delivered)
    assert all(e.action in HOTPLUG_ACTIONS for e in delivered)


@pytest.mark.usefixtures("libudev")
def test_callback_exception_does_not_stop_the_watch(
    loops: LoopDevices, watch: list[HotplugWatcher], caplog: pytest.LogCaptureFixture
) -> None:
    events: queue.Queue[HotplugEvent] = queue.Queue()

    def failing(event: HotplugEvent) -> None:
        events.put(event)
        raise RuntimeError("callback bug")

    with caplog.at_level(logging.ERROR, logger=UDEV_LOGGER):
        watcher = kernel_watch(watch, failing)
        name = loops.add()
        wait_for(events, "add", name)
        loops.change(name)
        wait_for(events, "change", name)
        loops.remove(name)
        wait_for(events, "remove", name)
        assert watcher.running
    failures = [r for r in caplog.records if "callback failed" in r.getMessage()]
    assert len(failures) >= 3
    assert all(r.exc_info and r.exc_info[0] is RuntimeError for r in failures)


@pytest.mark.usefixtures("libudev")
def test_watch_survives_receive_buffer_overflow(
    loops: LoopDevices, watch: list[HotplugWatcher], caplog: pytest.LogCaptureFixture
) -> None:
    """A netlink overflow (ENOBUFS) is logged as lost events and later events still arrive.

    The socket's receive buffer is shrunk to the kernel minimum and the callback held on the
    first event while more uevents are emitted, so the kernel drops some and flags ENOBUFS.
    """
    events: queue.Queue[HotplugEvent] = queue.Queue()
    release = threading.Event()

    def held(event: HotplugEvent) -> None:
        events.put(event)
        release.wait(TIMEOUT_S)

    with caplog.at_level(logging.WARNING, logger=UDEV_LOGGER):
        watcher = kernel_watch(watch, held)
        assert watcher._monitor is not None
        fd = watcher._monitor.fileno()
        with socket.fromfd(fd, socket.AF_NETLINK, socket.SOCK_RAW) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1)
        try:
            name = loops.add()
            wait_for(events, "add", name)  # the watch thread now sits in the callback
            for _ in range(20):
                loops.change(name)
        finally:
            release.set()
        wait_until(
            lambda: any("events were lost" in r.getMessage() for r in caplog.records),
            "the lost-events warning",
        )
        loops.remove(name)
        wait_for(events, "remove", name)
        assert watcher.running


@pytest.mark.usefixtures("libudev")
def test_stop_from_the_callback_ends_the_thread(
    loops: LoopDevices, watch: list[HotplugWatcher]
) -> None:
    calls: list[HotplugEvent] = []

    def stop_on_first(event: HotplugEvent) -> None:
        calls.append(event)
        watcher.stop()

    watcher = kernel_watch(watch, stop_on_first)
    loops.add()
    wait_until(lambda: not watcher.running, "the watch thread to end")
    assert len(calls) == 1


# --- watcher lifecycle without uevents ---------------------------------------------------------


def test_invalid_source_rejected() -> None:
    with pytest.raises(ValueError, match="source"):
        HotplugWatcher(lambda event: None, source="netlink")


def test_stop_before_start_is_a_no_op() -> None:
    watcher = HotplugWatcher(lambda event: None)
    watcher.stop()
    assert not watcher.running


@pytest.mark.usefixtures("libudev")
def test_start_twice_rejected(watch: list[HotplugWatcher]) -> None:
    watcher = kernel_watch(watch, lambda event: None)
    with pytest.raises(RuntimeError, match="once"):
        watcher.start()
    watcher.stop()
    assert not watcher.running
