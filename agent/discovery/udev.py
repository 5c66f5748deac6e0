"""Device discovery and hot-plug watch through udev (pyudev).

udev is preferred over bare sysfs on a real machine where the daemon runs: its database adds
properties sysfs lacks, and its monitor tells us when accelerators come and go (Hailo, Coral
and Intel NPU nodes vanish on runtime PM or driver reload).  The caller decides between this
module and sysfs (always sysfs for a fixture ``--root``); this module only looks at the live
system.  pyudev is imported inside the functions that need it, so the CLI starts fast and a
machine without pyudev or libudev can still import this module.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import socket
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pyudev

logger = logging.getLogger(__name__)

WATCHED_SUBSYSTEMS = ("accel", "drm", "nvme", "usb")
# Hot-plug watches CPUs too: a CPU taken offline or brought back (CPU hot-plug, an nvpmodel
# mode) sends an offline/online uevent (drivers/base/core.c device_offline/device_online),
# and the service plans the profile again, whose RT threads use online CPUs only.
HOTPLUG_SUBSYSTEMS = (*WATCHED_SUBSYSTEMS, "cpu")
HOTPLUG_ACTIONS = frozenset({"add", "remove", "change", "bind", "unbind", "online", "offline"})


class UdevUnavailable(Exception):
    """pyudev or libudev cannot be used here; the caller falls back to sysfs with a warning."""


@dataclass(frozen=True)
class UdevDevice:
    """One device as udev sees it.

    ``driver``, ``vendor_id`` and ``model_id`` come from the device or, when it has none, from
    its nearest ancestor that has them: class devices such as accel0, card0 or nvme0 never
    carry a driver or ids themselves, their PCI or USB parent does.  Ids are taken from udev's
    ID_VENDOR_ID/ID_MODEL_ID, the kernel's PCI_ID, or a USB device's PRODUCT, and are written
    like sysfs's PCI ``vendor`` file (``0x8086``) so both discovery paths agree.
    """

    subsystem: str
    sys_name: str
    sys_path: str
    devnode: str | None
    driver: str | None
    vendor_id: str | None
    model_id: str | None


@dataclass(frozen=True)
class HotplugEvent:
    """A device event the watch delivers: ``action`` is add, remove, change, bind, unbind,
    online or offline."""

    action: str
    device: UdevDevice


def udev_running(run_dir: str = "/run/udev") -> bool:
    """Whether udevd runs, judged by its control socket: cheap, no pyudev import needed."""
    return Path(run_dir, "control").exists()


def _open_context() -> pyudev.Context:
    """Load pyudev and libudev, turning the absence of either into UdevUnavailable."""
    try:
        import pyudev
    except ImportError as exc:
        raise UdevUnavailable(f"pyudev is not installed: {exc}") from exc
    try:
        return pyudev.Context()
    except (ImportError, OSError) as exc:
        raise UdevUnavailable(f"libudev cannot be loaded: {exc}") from exc


def _is_watched(device: pyudev.Device, subsystems: Iterable[str]) -> bool:
    """Whether ``device`` is one we report: USB only as whole devices, never interfaces."""
    subsystem: str = device.subsystem
    devtype: str | None = device.device_type
    return subsystem in subsystems and (subsystem != "usb" or devtype == "usb_device")


def _hex_id(value: str) -> str:
    return f"0x{int(value, 16):04x}"


def _ids(device: pyudev.Device) -> tuple[str, str] | None:
    """Vendor and model id carried by ``device`` itself, if any."""
    props = device.properties
    if "ID_VENDOR_ID" in props and "ID_MODEL_ID" in props:
        return _hex_id(props["ID_VENDOR_ID"]), _hex_id(props["ID_MODEL_ID"])
    if "PCI_ID" in props:
        vendor, _, model = props["PCI_ID"].partition(":")
        return _hex_id(vendor), _hex_id(model)
    if device.subsystem == "usb" and "PRODUCT" in props:
        vendor, model, _ = props["PRODUCT"].split("/", 2)
        return _hex_id(vendor), _hex_id(model)
    return None


def _to_udev_device(device: pyudev.Device) -> UdevDevice:
    lineage = [device, *device.ancestors]
    driver = next((d.driver for d in lineage if d.driver), None)
    vendor_id, model_id = next((ids for d in lineage if (ids := _ids(d)) is not None), (None, None))
    return UdevDevice(
        subsystem=device.subsystem,
        sys_name=device.sys_name,
        sys_path=device.sys_path,
        devnode=device.device_node,
        driver=driver,
        vendor_id=vendor_id,
        model_id=model_id,
    )


def enumerate_devices(subsystems: Iterable[str] = WATCHED_SUBSYSTEMS) -> list[UdevDevice]:
    """Every present device of ``subsystems``, sorted by subsystem then sysfs path.

    Raises UdevUnavailable when pyudev or libudev cannot be loaded.
    """
    context = _open_context()
    wanted = tuple(subsystems)
    devices = [
        _to_udev_device(device)
        for subsystem in wanted
        for device in context.list_devices(subsystem=subsystem)
        if _is_watched(device, wanted)
    ]
    return sorted(devices, key=lambda d: (d.subsystem, d.sys_path))


class HotplugWatcher:
    """Calls ``callback(HotplugEvent)`` on a daemon thread for each event of ``subsystems``.

    ``source="udev"`` gets events after udevd has processed them (device nodes exist);
    ``source="kernel"`` reads the kernel's netlink uevents directly, which works without udevd
    (and without root, in the initial network namespace).

    The thread runs its own poll loop on the monitor's fileno plus a wake-up pipe rather than
    pyudev.MonitorObserver, because the observer's thread dies on the first exception from the
    callback and on a netlink receive-buffer overflow (pyudev raises OSError on POLLERR), and
    its stop() fails when called twice.  Here stop() wakes the loop at once and is idempotent,
    a failing callback is logged and the event skipped, and an overflow is logged as lost
    events while the watch goes on.
    """

    def __init__(
        self,
        callback: Callable[[HotplugEvent], None],
        subsystems: Iterable[str] = WATCHED_SUBSYSTEMS,
        source: str = "udev",
    ) -> None:
        if source not in ("udev", "kernel"):
            raise ValueError(f"source must be 'udev' or 'kernel', not {source!r}")
        self._callback = callback
        self._subsystems = tuple(subsystems)
        self._source = source
        self._lock = threading.Lock()
        # Kept for inspection: the overflow test shrinks this socket's receive buffer.
        self._monitor: pyudev.Monitor | None = None
        self._thread: threading.Thread | None = None
        self._wake_w: int | None = None

    @property
    def running(self) -> bool:
        """Whether the watch thread is alive (it ends on stop() or a dead monitor socket)."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start watching; events that happen once this returns are delivered.

        The monitor socket is bound here, before the thread starts, so a caller can start the
        watch and then run discovery without missing a change in between.  Raises
        UdevUnavailable when pyudev, libudev or the netlink socket cannot be had, and
        RuntimeError when called a second time.
        """
        with self._lock:
            if self._thread is not None:
                raise RuntimeError("a HotplugWatcher can only be started once")
            context = _open_context()
            from pyudev import Monitor

            try:
                monitor = Monitor.from_netlink(context, source=self._source)
                for subsystem in self._subsystems:
                    monitor.filter_by(subsystem)
                monitor.start()
            except OSError as exc:
                raise UdevUnavailable(f"cannot listen to {self._source} uevents: {exc}") from exc
            wake_r, self._wake_w = os.pipe()
            self._monitor = monitor
            self._thread = threading.Thread(
                target=self._run, args=(monitor, wake_r), name="udev-hotplug", daemon=True
            )
            self._thread.start()

    def stop(self) -> None:
        """Stop the watch and wait for its thread; safe to call repeatedly or from the callback.

        Once it returns (outside the callback), the callback is not called again.
        """
        with self._lock:
            thread, wake_w = self._thread, self._wake_w
            self._wake_w = None
        if wake_w is not None:
            os.close(wake_w)  # the loop sees POLLHUP on the read end and returns
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _run(self, monitor: pyudev.Monitor, wake_r: int) -> None:
        monitor_fd = monitor.fileno()
        poller = select.poll()
        poller.register(monitor_fd, select.POLLIN)
        poller.register(wake_r, select.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if wake_r in ready:
                    return
                mask = ready[monitor_fd]
                if mask & (select.POLLHUP | select.POLLNVAL):
                    logger.error("uevent socket closed; hot-plug watch stopped")
                    return
                if mask & select.POLLERR:
                    _report_socket_error(monitor_fd)
                self._drain(monitor)
        finally:
            os.close(wake_r)

    def _drain(self, monitor: pyudev.Monitor) -> None:
        """Deliver every queued event without blocking, until stop() is called."""
        while self._wake_w is not None:
            try:
                device = monitor.poll(timeout=0)
            except OSError as exc:
                # A receive that returned ENOBUFS consumed the overflow, so report it here; an
                # error pyudev's own poll saw is still pending and the main loop reports it.
                if exc.errno == errno.ENOBUFS:
                    _log_lost_events(os.strerror(exc.errno))
                return
            if device is None:
                return
            if device.action in HOTPLUG_ACTIONS and _is_watched(device, self._subsystems):
                self._deliver(device)

    def _deliver(self, device: pyudev.Device) -> None:
        try:
            self._callback(HotplugEvent(device.action, _to_udev_device(device)))
        except Exception:
            logger.exception("hot-plug callback failed for %s %s", device.action, device.sys_path)


def _report_socket_error(fd: int) -> None:
    """Fetch and clear the socket's pending error (ENOBUFS after an overflow) and log it."""
    with socket.fromfd(fd, socket.AF_NETLINK, socket.SOCK_RAW) as sock:
        code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    if code:
        _log_lost_events(os.strerror(code))


def _log_lost_events(reason: str) -> None:
    logger.warning("uevent socket error (%s): hot-plug events were lost; rediscover", reason)
