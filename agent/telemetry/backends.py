"""Which backend, device and precision each model instance runs, for telemetry.

The data plane's statistics entry for a model version (Triton's model_stats entry plus
``edge_agent``) is the source: ``edge_agent.instances`` has one entry per instance, in
instance order, carrying its ``backend``, ``device``, ``precision`` and ``providers`` (from
the instance's ``Backend.describe()``).  An entry from a data plane that sent only the
figures reports what it does say, ``edge_agent.providers``, and leaves the rest unknown
(None) rather than guessed.
"""

from __future__ import annotations

from typing import Any

FIELDS = ("instance", "backend", "device", "precision", "providers")


def _row(index: int, described: dict[str, Any], providers: Any) -> dict[str, Any]:
    providers = described.get("providers", providers)
    return {"instance": index, "backend": described.get("backend"),
            "device": described.get("device"), "precision": described.get("precision"),
            "providers": list(providers) if isinstance(providers, list) else None}


def instance_backends(entry: dict[str, Any]) -> list[dict[str, Any]] | None:
    """One row per instance of a statistics entry; None when the entry says nothing."""
    ours = entry.get("edge_agent")
    if not isinstance(ours, dict):
        return None
    instances = ours.get("instances")
    if not isinstance(instances, list):
        return None
    return [_row(index, item if isinstance(item, dict) else {}, ours.get("providers"))
            for index, item in enumerate(instances)]
