"""Which backend, device and precision each model instance runs, for telemetry.

The data plane's statistics entry for a model version (Triton's model_stats entry plus
``edge_agent``) is the source.  The hook is ``edge_agent.backends``: one
``Backend.describe()`` dict per instance, in instance order (``backend``, ``device``,
``precision``, ``providers``).  Until the data plane sends it, each instance is reported
from what it does send: ``edge_agent.providers`` (the instances' ORT providers) and
``edge_agent.instances`` (one entry per instance), with backend ``onnxruntime`` and the
device and precision unknown (None) rather than guessed.
"""

from __future__ import annotations

from typing import Any

BACKENDS_KEY = "backends"  # edge_agent.<this>: [Backend.describe(), ...] per instance
FIELDS = ("instance", "backend", "device", "precision", "providers")


def _row(index: int, described: dict[str, Any]) -> dict[str, Any]:
    providers = described.get("providers")
    return {"instance": index, "backend": described.get("backend"),
            "device": described.get("device"), "precision": described.get("precision"),
            "providers": list(providers) if isinstance(providers, list) else None}


def instance_backends(entry: dict[str, Any]) -> list[dict[str, Any]] | None:
    """One row per instance of a statistics entry; None when the entry says nothing."""
    ours = entry.get("edge_agent")
    if not isinstance(ours, dict):
        return None
    described = ours.get(BACKENDS_KEY)
    if isinstance(described, list):
        return [_row(index, item if isinstance(item, dict) else {})
                for index, item in enumerate(described)]
    providers = ours.get("providers")
    instances = ours.get("instances")
    if not isinstance(providers, list) or not isinstance(instances, list):
        return None
    return [_row(index, {"backend": "onnxruntime", "providers": providers})
            for index in range(len(instances))]
