"""Home Assistant MQTT discovery (optional, off by default).

Retained config messages under ``<prefix>/sensor/<node>/<object>/config`` make each node show
up as a device whose sensors read the node's own telemetry topic; availability follows the
retained ``state`` topic, so a node that dies goes unavailable through its Last Will.
"""

from __future__ import annotations

import re
from typing import Any, Protocol

from agent import __version__, protocol
from agent.discovery.model import Topology
from agent.telemetry.records import encode


class Node(Protocol):
    """What discovery messages name of the node (the agent's Config has it), so the link
    layer does not depend on the config."""

    @property
    def node_id(self) -> str: ...

    @property
    def topic_root(self) -> str: ...

    @property
    def home_assistant_prefix(self) -> str: ...

# (object id, name, template over value_json.metrics, unit, device_class)
_SENSORS: list[tuple[str, str, str, str | None, str | None]] = [
    ("cpu_util", "CPU utilisation", "cpu.util_pct", "%", None),
    ("memory_used", "Memory used", "memory.used_pct", "%", None),
    ("load_avg1", "Load (1 min)", "load.avg1", None, None),
    ("inference_p99", "Inference p99", "inference.latency_ms.p99", "ms", "duration"),
    ("inference_rate", "Inference rate", "inference.throughput_per_s", "1/s", None),
    ("outbox_depth", "Outbox depth", "outbox.depth", None, None),
]


def _object_id(text: str) -> str:
    return re.sub(r"[^a-z0-9_]+", "_", text.lower()).strip("_")


def _sensor(config: Node, device: dict[str, Any], object_id: str, name: str,
            template: str, unit: str | None, device_class: str | None) -> tuple[str, bytes]:
    node = config.node_id
    payload: dict[str, Any] = {
        "name": name, "unique_id": f"edge_agent_{node}_{object_id}",
        "object_id": f"{node}_{object_id}",
        "state_topic": protocol.topic(config.topic_root, protocol.TELEMETRY),
        "value_template": "{{ " + template + " }}", "state_class": "measurement",
        "availability": [{"topic": protocol.topic(config.topic_root, protocol.STATE),
                          "value_template": "{{ value_json.state }}",
                          "payload_available": "online", "payload_not_available": "offline"}],
        "device": device,
    }
    if unit:
        payload["unit_of_measurement"] = unit
    if device_class:
        payload["device_class"] = device_class
    topic = f"{config.home_assistant_prefix}/sensor/{node}/{object_id}/config"
    return topic, encode(payload)


def discovery_messages(config: Node, topology: Topology) -> list[tuple[str, bytes]]:
    """One retained config message per sensor this node can report."""
    board = topology.board
    device = {"identifiers": [f"edge_agent_{config.node_id}"], "name": config.node_id,
              "model": board.model or board.family, "manufacturer": board.family,
              "sw_version": __version__}
    messages = [_sensor(config, device, object_id, name, f"value_json.metrics.{path}", unit,
                        device_class)
                for object_id, name, path, unit, device_class in _SENSORS]
    for zone in topology.thermal:
        zone_type = str(zone.type)
        messages.append(_sensor(
            config, device, f"temp_{_object_id(zone_type)}", f"Temperature {zone_type}",
            "(value_json.metrics.thermal | selectattr('type', 'eq', "
            f"'{zone_type}') | map(attribute='temp_c') | first)", "°C", "temperature"))
    for index, gpu in enumerate(topology.gpus):
        messages.append(_sensor(config, device, f"gpu{index}_util", f"GPU {gpu.name} load",
                                f"value_json.metrics.gpus[{index}].util_pct", "%", None))
    return messages
