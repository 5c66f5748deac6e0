"""Hot-plug in ``edge-agent run``: a device added or removed while the agent runs leads to a
rediscovery, a new birth, an ``event`` and a re-plan of the active profile.

This machine has no accelerator, DRM, NVMe or USB device to plug, so the watched
subsystems are set to ``block`` and real loop devices cause real kernel uevents.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

from agent_process import start_agent, status, write_config
from loop_devices import LoopDevices
from mqtt_helpers import Broker, Subscriber, wait_until

from agent.config import from_dict

TOPIC = "edge/v1/lab/orin-1"


def _hotplug_events(watcher: Subscriber, action: str, name: str) -> list[dict[str, Any]]:
    return [e for e in watcher.on("event") if e["type"] == "hotplug" and any(
        (d["action"], d["name"]) == (action, name) for d in e["devices"])]


def test_a_device_added_and_removed_while_running_is_rediscovered(
        tmp_path: Path, broker: Broker, loops: LoopDevices) -> None:
    watcher = Subscriber(broker, [f"{TOPIC}/#"])
    config = write_config(tmp_path, broker.port,
                          hotplug={"enabled": True, "subsystems": ["block"]})
    agent = start_agent(config)
    try:
        assert wait_until(lambda: status(config)[0] == 0, 60), agent.stdout
        assert wait_until(lambda: len(watcher.on("birth")) >= 1, 30)
        births = len(watcher.on("birth"))
        name = loops.add()
        assert wait_until(lambda: _hotplug_events(watcher, "add", name), 30), watcher.messages
        added = _hotplug_events(watcher, "add", name)[0]
        assert added["plan"]["profile"] == "jetson-orin" and added["plan"]["error"] is None
        assert added["plan"]["applied"] is False  # tuning.apply is off: planned, reported
        assert next(d for d in added["devices"] if d["name"] == name)["subsystem"] == "block"
        assert wait_until(lambda: len(watcher.on("birth")) > births, 30)  # announced again
        births = len(watcher.on("birth"))
        loops.remove(name)
        assert wait_until(lambda: _hotplug_events(watcher, "remove", name), 30)
        assert wait_until(lambda: len(watcher.on("birth")) > births, 30)
        assert agent.poll() is None
    finally:
        agent.send_signal(signal.SIGTERM)
        output, _ = agent.communicate(timeout=30)
        watcher.close()
    assert agent.returncode == 0, output


def test_hotplug_is_on_for_the_real_root_only_unless_set(tmp_path: Path) -> None:
    assert from_dict({}).hotplug.enabled is True
    assert from_dict({"root": str(tmp_path)}).hotplug.enabled is False
    forced = from_dict({"root": str(tmp_path), "hotplug": {"enabled": True,
                                                           "subsystems": ["block"]}})
    assert forced.hotplug.enabled is True and forced.hotplug.subsystems == ("block",)
    assert from_dict({}).hotplug.subsystems == ("accel", "drm", "nvme", "usb", "cpu")
