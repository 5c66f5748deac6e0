"""The data plane's Prometheus endpoint (``serve.metrics``, as Triton's :8002).

Nothing here sits on the hot path: a scrape reads the statistics extension's entries (the
same ones ``/v2/models/stats`` answers) and turns each version's fixed-memory latency
histogram into Prometheus buckets then, so serving pays nothing more per call.  Its own
``CollectorRegistry``, no global state: two data planes in one process (the tests) do not
share metrics.

Per version (labels ``model``, ``version``): latency and queue-time histograms in seconds
(from ``edge_agent.window`` and ``edge_agent.queue.window``), Triton's counters under
``edge_agent_inference_*`` and ``edge_agent_model_ready``; per instance (``model_instance``:
Prometheus keeps ``instance`` for the scraped target, plus the instance's ``device``,
``backend`` and ``precision``) the same two histograms.  An entry that
cannot be read is logged and left out; the rest of the scrape goes on.
"""

from __future__ import annotations

import gzip
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import choose_encoder, gzip_accepted

from agent.inference.stats import Window
from agent.serving.budget import MemoryBudget
from agent.serving.core import Models
from agent.serving.http_listener import ConnectionLimits, HttpListener, in_request

logger = logging.getLogger(__name__)

# Prometheus bucket bounds (s): 50 us to 10 s, about three per decade.
BUCKETS_S = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
             0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_BOUNDS_NS = tuple(round(b * 1e9) for b in BUCKETS_S)
_LABELS = ["model", "version"]
_INSTANCE_LABELS = ["model_instance", "device", "backend", "precision"]
# (metric name without _total, help, how to read it from a statistics entry)
_COUNTERS: tuple[tuple[str, str, Callable[[Mapping[str, Any]], int]], ...] = (
    ("edge_agent_inference_request_success", "Successful inference requests",
     lambda s: s["inference_stats"]["success"]["count"]),
    ("edge_agent_inference_request_failure", "Failed inference requests",
     lambda s: s["inference_stats"]["fail"]["count"]),
    ("edge_agent_inference_count", "Inferences performed (a batch of n counts n)",
     lambda s: s["inference_count"]),
    ("edge_agent_inference_exec_count", "Model executions (a batch counts once)",
     lambda s: s["execution_count"]),
    ("edge_agent_inference_request_duration_us", "Request duration, successes and failures",
     lambda s: (s["inference_stats"]["success"]["ns"] + s["inference_stats"]["fail"]["ns"])
     // 1000),
    ("edge_agent_inference_queue_duration_us", "Time requests waited in a queue",
     lambda s: s["inference_stats"]["queue"]["ns"] // 1000),
    ("edge_agent_inference_compute_input_duration_us", "Time spent preparing inputs",
     lambda s: s["inference_stats"]["compute_input"]["ns"] // 1000),
    ("edge_agent_inference_compute_infer_duration_us", "Time spent running the model",
     lambda s: s["inference_stats"]["compute_infer"]["ns"] // 1000),
    ("edge_agent_inference_compute_output_duration_us", "Time spent producing outputs",
     lambda s: s["inference_stats"]["compute_output"]["ns"] // 1000),
)


def histogram_buckets(window: Window) -> list[tuple[str, float]]:
    """Cumulative Prometheus buckets of a window's successful calls, ``+Inf`` last."""
    counts = window.cumulative(_BOUNDS_NS)
    return [*((repr(b), float(n)) for b, n in zip(BUCKETS_S, counts, strict=True)),
            ("+Inf", float(window.count))]


class _Families:
    """The families of one scrape, filled entry by entry."""

    def __init__(self) -> None:
        instance = [*_LABELS, *_INSTANCE_LABELS]
        self.latency = HistogramMetricFamily(
            "edge_agent_request_duration_seconds",
            "Latency of successful inference requests", labels=_LABELS)
        self.queue = HistogramMetricFamily(
            "edge_agent_queue_duration_seconds", "Time requests waited before running",
            labels=_LABELS)
        self.instance_latency = HistogramMetricFamily(
            "edge_agent_instance_request_duration_seconds",
            "Latency of successful inference requests per model instance", labels=instance)
        self.instance_queue = HistogramMetricFamily(
            "edge_agent_instance_queue_duration_seconds",
            "Time requests waited before running per model instance", labels=instance)
        self.counters = [CounterMetricFamily(name, text, labels=_LABELS)
                         for name, text, _ in _COUNTERS]
        self.ready = GaugeMetricFamily("edge_agent_model_ready",
                                       "1 while the version serves and its probe passes",
                                       labels=_LABELS)

    def add(self, entry: Mapping[str, Any], ready: bool) -> None:
        """One version's figures; every read happens before the first family is touched, so
        a bad entry adds nothing rather than half of itself."""
        labels = [str(entry["name"]), str(entry["version"])]
        ours = entry["edge_agent"]
        latency = Window.from_dict(ours["window"])
        queue = Window.from_dict(ours["queue"]["window"])
        counts = [float(read(entry)) for _, _, read in _COUNTERS]
        instances = [([str(i["index"]), *(str(i.get(key) or "") for key in
                                          _INSTANCE_LABELS[1:])],
                      Window.from_dict(i["window"]), Window.from_dict(i["queue"]))
                     for i in ours["instances"]]
        self.latency.add_metric(labels, histogram_buckets(latency), latency.sum_ns / 1e9)
        self.queue.add_metric(labels, histogram_buckets(queue), queue.sum_ns / 1e9)
        for counter, count in zip(self.counters, counts, strict=True):
            counter.add_metric(labels, count)
        self.ready.add_metric(labels, float(ready))
        for named, window, waited in instances:
            for family, found in ((self.instance_latency, window),
                                  (self.instance_queue, waited)):
                family.add_metric([*labels, *named], histogram_buckets(found),
                                  found.sum_ns / 1e9)

    def all(self) -> Iterator[Metric]:
        yield self.latency
        yield self.queue
        yield self.instance_latency
        yield self.instance_queue
        yield from self.counters
        yield self.ready


class ServingCollector:
    """A prometheus_client collector over a registry's statistics, read at each scrape."""

    def __init__(self, models: Models) -> None:
        self.models = models

    def collect(self) -> Iterator[Metric]:
        families = _Families()
        for entry in self.models.statistics("", ""):
            try:
                ready = self.models.model_ready(str(entry["name"]), str(entry["version"]))
                families.add(entry, ready)
            except Exception as error:  # one odd entry (or a version unloaded meanwhile)
                logger.warning("metrics: %s version %s left out: %s: %s", entry.get("name"),
                               entry.get("version"), type(error).__name__, error)
        yield from families.all()


class AcceptErrorCollector:
    """``edge_agent_serve_accept_errors_total`` per listener: connections the data plane
    could not accept (its descriptor table full), which its log only summarises."""

    def __init__(self, totals: Mapping[str, int]) -> None:
        self.totals = totals

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "edge_agent_serve_accept_errors",
            "Connections not accepted for lack of descriptors or memory", labels=["listener"])
        for listener, count in sorted(self.totals.items()):
            family.add_metric([listener], float(count))
        yield family


class BudgetCollector:
    """The memory budget (budget.MemoryBudget): its limit, what requests hold now, the peak
    since start and the requests refused for want of room; the figures an operator sizes
    ``serve.max_inflight_mb`` by."""

    def __init__(self, budget: MemoryBudget) -> None:
        self.budget = budget

    def collect(self) -> Iterator[Metric]:
        figures = self.budget.snapshot()
        for key, text in (("limit_bytes", "serve.max_inflight_mb in bytes"),
                          ("in_use_bytes", "Bytes requests hold now"),
                          ("peak_bytes", "The most bytes requests held at once")):
            yield GaugeMetricFamily(f"edge_agent_serve_inflight_{key}", text,
                                    value=float(figures[key]))
        yield CounterMetricFamily("edge_agent_serve_inflight_refused",
                                  "Requests refused for want of room in the budget",
                                  value=float(figures["refused"]))


class MetricsServer:
    """``/metrics`` (any path, as prometheus_client's own server) on host:port, served by the
    data plane's event loop: no thread per connection, so a scraper that never finishes
    its request costs a descriptor, not a thread (port 0: a free one, then ``address``
    says which).  Output as prometheus_client's server gives it: the format the Accept
    header asks for, ``name[]`` filters, gzip when accepted."""

    # a scraper comes back every few seconds or not at all; a few at once; the HTTP front
    # end's listener, so that idle or slow connections cannot lock a new scraper out
    LIMITS = ConnectionLimits(max_connections=64, header_timeout_s=5.0, idle_timeout_s=15.0)

    def __init__(self, models: Models, accept_errors: Mapping[str, int] | None = None,
                 budget: MemoryBudget | None = None) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(ServingCollector(models))
        if accept_errors is not None:
            self.registry.register(AcceptErrorCollector(accept_errors))
        if budget is not None:
            self.registry.register(BudgetCollector(budget))
        self.address = ""
        self._listener: HttpListener | None = None

    async def start(self, host: str, port: int) -> None:
        """Listen (OSError as the bind's: the caller names the key)."""
        app = web.Application(middlewares=[_tracked])
        app.router.add_route("*", "/{tail:.*}", self._answer)
        listener = HttpListener(app, self.LIMITS)
        try:
            bound = await listener.start(host, port)
        except BaseException:
            await listener.stop()
            raise
        self._listener = listener
        self.address = f"{host}:{bound}"

    @property
    def sockets(self) -> list[str]:
        """``host:port`` of each listening socket, as the kernel names it."""
        return [] if self._listener is None else [
            f"{a[0]}:{a[1]}" for a in self._listener.addresses]

    async def _answer(self, request: Any) -> Any:
        if request.method == "OPTIONS":
            return web.Response(headers={"Allow": "OPTIONS,GET"})
        if request.method != "GET":
            return web.Response(status=405, headers={"Allow": "OPTIONS,GET"},
                                text=f"# HTTP 405 Method Not Allowed: {request.method}; "
                                "use OPTIONS or GET\n")
        if request.path == "/favicon.ico":
            return web.Response()
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        names = request.query.getall("name[]", [])
        registry = self.registry.restricted_registry(names) if names else self.registry
        body = encoder(registry)
        headers = {"Content-Type": content_type}
        if gzip_accepted(request.headers.get("Accept-Encoding", "")):
            body = gzip.compress(body)
            headers["Content-Encoding"] = "gzip"
        return web.Response(body=body, headers=headers)

    async def stop(self) -> None:
        if self._listener is not None:
            await self._listener.stop()


@web.middleware
async def _tracked(request: web.Request, handler: Any) -> web.StreamResponse:
    with in_request(request):
        return await handler(request)  # type: ignore[no-any-return]
