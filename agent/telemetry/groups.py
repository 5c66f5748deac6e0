"""The telemetry metric groups by name, in record order: one list for the collectors'
registry, the service and the config's ``telemetry.metrics``.  Importing it costs nothing,
so the config can check names without loading a collector."""

from __future__ import annotations

# One per collector of agent.telemetry.collectors.build_collectors, in its order.
COLLECTOR_GROUPS = ("cpu", "load", "memory", "swap", "psi", "cgroup", "thermal", "power",
                    "fans", "gpus", "npus", "block", "net", "thp")
# The service's own function collectors (agent.service.node.Service._collectors).
SERVICE_GROUPS = ("inference", "tuning", "outbox", "link", "control", "qos")
METRIC_GROUPS = COLLECTOR_GROUPS + SERVICE_GROUPS
