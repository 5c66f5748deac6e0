"""An optional Prometheus ``/metrics`` endpoint with the same metrics as MQTT telemetry.

A scrape reads the latest sample the sampler took; it never touches the hardware, so a
scraper polling every second costs the device nothing extra.  Nested groups become metric
names (``edge_agent_inference_latency_ms_p95``), list items become labels
(``edge_agent_gpus_util_pct{name="L4"}``), and strings become a label on a gauge of 1.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric

Sample = tuple[str, dict[str, str], float]
_LABEL_KEYS = ("cpu", "zone", "name", "id", "type", "index")


def _name(text: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", text)


def flatten(value: Any, name: str = "edge_agent",
            labels: dict[str, str] | None = None) -> Iterator[Sample]:
    """(metric name, labels, value) for every number in a metrics document."""
    labels = labels or {}
    if isinstance(value, int | float):  # bool included: 0 or 1
        yield name, labels, float(value)
    elif isinstance(value, str):
        yield name, {**labels, "value": value}, 1.0
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from flatten(item, f"{name}_{_name(str(key))}", labels)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            if isinstance(item, dict):
                yield from _flatten_item(item, name, labels, index)
            else:
                yield from flatten(item, name, {**labels, "index": str(index)})


def _flatten_item(item: dict[str, Any], name: str, labels: dict[str, str],
                  index: int) -> Iterator[Sample]:
    """A list entry: its identifying fields and strings label its numbers."""
    own = {key: str(item[key]) for key in _LABEL_KEYS
           if isinstance(item.get(key), str | int) and not isinstance(item.get(key), bool)}
    own.update({key: value for key, value in item.items() if isinstance(value, str)})
    if not own:
        own = {"index": str(index)}
    for key, value in item.items():
        if key not in own and value is not None:
            yield from flatten(value, f"{name}_{_name(key)}", {**labels, **own})


class _LatestSample:
    """A prometheus_client collector over the sampler's latest record."""

    def __init__(self, latest: Callable[[], dict[str, Any] | None]) -> None:
        self.latest = latest

    def collect(self) -> Iterator[Metric]:
        record = self.latest()
        if not record:
            return
        families: dict[tuple[str, tuple[str, ...]], GaugeMetricFamily] = {}
        for name, labels, value in flatten(record.get("metrics", {})):
            keys = tuple(sorted(labels))
            family = families.get((name, keys))
            if family is None:
                family = GaugeMetricFamily(name, f"edge-agent telemetry {name}",
                                           labels=list(keys))
                families[(name, keys)] = family
            family.add_metric([labels[k] for k in keys], value)
        seen: set[str] = set()
        for (name, _), family in families.items():
            if name not in seen:  # one label set per name: the first shape wins
                seen.add(name)
                yield family


class PrometheusExporter:
    def __init__(self, listen: str, latest: Callable[[], dict[str, Any] | None]) -> None:
        host, _, port = listen.rpartition(":")
        self.host, self.port = host.strip("[]"), int(port)
        self.registry = CollectorRegistry()
        self.registry.register(_LatestSample(latest))
        self._server: Any = None

    def start(self) -> None:
        self._server, _thread = start_http_server(self.port, addr=self.host,
                                                  registry=self.registry)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
