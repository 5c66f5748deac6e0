"""``edge-agent infer --url``: drive a running data plane over HTTP, gRPC or its local
socket, as an application would, and print the same statistics as the local benchmark.

``--concurrency`` clients each send one request after another (``--rate`` is split between
them); every call is measured on the client, from request to decoded answer.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from agent.cli.common import UsageError
from agent.inference.stats import LatencyStats, Window


def _client(url: str, token: str | None, timeout_s: float) -> Any:
    """An HTTP or gRPC client of our own, by the URL's scheme."""
    if url.startswith("grpc://"):
        from agent.serving.grpc_client import GrpcClient

        return GrpcClient(url.removeprefix("grpc://"), token=token, timeout_s=timeout_s)
    if url.startswith(("http://", "https://")):
        from agent.serving.http_client import HttpClient

        return HttpClient(url, token=token, timeout_s=timeout_s)
    if url.startswith("unix://"):
        from agent.cli.infer_local import LocalClient

        return LocalClient(url.removeprefix("unix://"), token, timeout_s)
    raise UsageError(f"--url {url}: expected http://HOST:PORT, grpc://HOST:PORT or "
                     "unix:///PATH (the data plane's serve.local.socket)")


def merged(windows: list[Window]) -> Window:
    """One window of several clients' calls (their histograms added up)."""
    first = windows[0]
    starts = [w.first_start_ns for w in windows if w.first_start_ns is not None]
    ends = [w.last_end_ns for w in windows if w.last_end_ns is not None]
    return replace(first, count=sum(w.count for w in windows),
                   errors=sum(w.errors for w in windows),
                   deadline_misses=sum(w.deadline_misses for w in windows),
                   sum_ns=sum(w.sum_ns for w in windows), max_ns=max(w.max_ns for w in windows),
                   first_start_ns=min(starts, default=None), last_end_ns=max(ends, default=None),
                   buckets=tuple(map(sum, zip(*(w.buckets for w in windows), strict=True))))


def priority_mix(text: str) -> dict[int, float]:
    """``--priority-mix 1:0.2,2:0.8`` as {priority: fraction}; the fractions are shares, so
    they need not add up to 1."""
    mix: dict[int, float] = {}
    for item in text.split(","):
        priority, _, share = item.partition(":")
        try:
            mix[int(priority)] = float(share)
        except ValueError:
            raise UsageError(f"--priority-mix {text}: expected PRIORITY:FRACTION,... "
                             "(e.g. 1:0.2,2:0.8)") from None
    if any(p < 0 for p in mix) or any(not f > 0 for f in mix.values()):
        raise UsageError(f"--priority-mix {text}: priorities are 0 or above, fractions "
                         "above 0")
    return mix


class PriorityMix:
    """Hands out priorities in proportion, deterministically and shared by every client:
    each request takes the priority furthest behind its share, so after n requests each
    priority's count is within one of n x its fraction."""

    def __init__(self, mix: dict[int, float]) -> None:
        total = sum(mix.values())
        self.shares = {priority: share / total for priority, share in mix.items()}
        self.sent = dict.fromkeys(mix, 0)
        self._lock = threading.Lock()

    def next(self) -> int:
        with self._lock:
            due = sum(self.sent.values()) + 1
            priority = max(self.shares, key=lambda p: self.shares[p] * due - self.sent[p])
            self.sent[priority] += 1
            return priority


class ClientRegion:
    """``--shm``: one client's POSIX shared memory object holding its inputs and room for
    its outputs, registered with the server (which needs the token) for the run.  The
    server attaches only memory the token file's owner may open (shm.register): a caller
    who is not that owner shares the object with the token file's group, read and write."""

    def __init__(self, client: Any, name: str, feeds: dict[str, np.ndarray],
                 outputs: dict[str, int], token_file: Path) -> None:
        from multiprocessing import shared_memory

        from agent.serving.core import datatype_of
        from agent.serving.shm_tensors import RegionInput, RegionRef

        sizes = [array.nbytes for array in feeds.values()] + list(outputs.values())
        self.memory = shared_memory.SharedMemory(name=name, create=True, size=sum(sizes))
        holder = token_file.stat()
        if holder.st_uid != os.geteuid():
            os.chown(f"/dev/shm/{name}", -1, holder.st_gid)
            os.chmod(f"/dev/shm/{name}", 0o660)
        self.client, self.name = client, name
        self.feeds: dict[str, Any] = {}
        self.outputs: dict[str, Any] = {}
        offset = 0
        buffer = self.memory.buf
        assert buffer is not None  # open until close()
        for key, array in feeds.items():
            buffer[offset:offset + array.nbytes] = array.tobytes()
            self.feeds[key] = RegionInput(datatype_of(array), tuple(array.shape),
                                          RegionRef(name, array.nbytes, offset))
            offset += array.nbytes
        for key, size in outputs.items():
            self.outputs[key] = RegionRef(name, size, offset)
            offset += size
        client.register_shm(name, f"/{name}", sum(sizes))

    def close(self) -> None:
        from agent.serving.errors import ServeError

        with contextlib.suppress(ServeError):  # a server gone: the object goes all the same
            self.client.unregister_shm(self.name)
        self.memory.close()
        self.memory.unlink()


def output_bytes(metadata: Any) -> dict[str, int]:
    """Room for each output at batch 1 (a dynamic dimension counted as 1)."""
    from agent.serving.core import DATATYPES

    return {spec.name: int(np.prod([d if d > 0 else 1 for d in spec.shape]))
            * DATATYPES[spec.datatype].itemsize for spec in metadata.outputs}


def run_remote(args: argparse.Namespace, model: str,
               stop: threading.Event) -> dict[str, Any]:
    from agent.service.loaddriver import synthetic_feeds
    from agent.serving.errors import ServeError

    mix = PriorityMix(priority_mix(args.priority_mix)) if args.priority_mix else None
    token = Path(args.token_file).read_text().strip() if args.token_file else None
    probe = _client(args.url, token, 10.0)
    try:
        metadata = probe.model_metadata(model)
    except ServeError as error:
        raise UsageError(f"--url {args.url}: {error}") from None
    feeds = synthetic_feeds(metadata, {})
    if args.shm and args.url.startswith("unix://"):
        raise UsageError("--shm is for HTTP and gRPC: unix:// shares memory by itself")
    if args.shm and token is None:
        raise UsageError("--shm needs --token-file: registering a region, and naming one in "
                         "a request, need the server's token")
    period_ns = int(1e9 * args.concurrency / args.rate) if args.rate else 0
    end_ns = time.monotonic_ns() + int(args.seconds * 1e9)
    # per client, per priority sent (None: no priority parameter): LatencyStats has one writer
    stats: list[dict[int | None, LatencyStats]] = [{} for _ in range(args.concurrency)]
    errors: list[str] = []

    def client_loop(index: int, mine: dict[int | None, LatencyStats]) -> None:
        client = _client(args.url, token, 10.0)
        region = ClientRegion(client, f"{args.shm_prefix}infer-{os.getpid()}-{index}", feeds,
                              output_bytes(metadata), Path(args.token_file)) if args.shm \
            else None
        try:
            send(client, region, mine)
        finally:
            if region is not None:
                region.close()

    def send(client: Any, region: ClientRegion | None,
             mine: dict[int | None, LatencyStats]) -> None:
        inputs = region.feeds if region is not None else feeds
        targets = region.outputs if region is not None else None
        due = time.monotonic_ns()
        while not stop.is_set() and (start := time.monotonic_ns()) < end_ns:
            priority = mix.next() if mix is not None else None
            recorder = mine.setdefault(priority, LatencyStats())
            recorder.call_started(start)
            try:
                client.infer(model, inputs, regions=targets, parameters=None
                             if priority is None else {"priority": priority})
                ok = True
            except ServeError as error:
                ok = False
                errors.append(str(error))
            recorder.record(time.monotonic_ns() - start, ok)
            if period_ns:
                due += period_ns
                if stop.wait(max(0, due - time.monotonic_ns()) / 1e9):
                    break

    threads = [threading.Thread(target=client_loop, args=(i, s), daemon=True)
               for i, s in enumerate(stats)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    windows: dict[int | None, list[Window]] = {}
    for mine in stats:
        for priority, recorder in mine.items():
            windows.setdefault(priority, []).append(recorder.window())
    every = [w for found in windows.values() for w in found] or [LatencyStats().window()]
    result = {"url": args.url, "model": model, "versions": list(metadata.versions),
              "concurrency": args.concurrency, "shared_memory": bool(args.shm),
              **merged(every).snapshot(),
              "last_error": errors[-1] if errors else None}
    if mix is not None:
        result["by_priority"] = {str(p): merged(windows[p]).snapshot() if p in windows
                                 else LatencyStats().snapshot() for p in sorted(mix.shares)}
    return result


def print_remote(result: dict[str, Any]) -> None:
    latency = result["latency_ms"]
    print(f"{result['model']} at {result['url']} ({result['concurrency']} client(s)): "
          f"{result['count']} calls, {result['errors']} errors, "
          f"{result['throughput_per_s']:.1f}/s, latency ms p50 {latency['p50']:.3f} "
          f"p95 {latency['p95']:.3f} p99 {latency['p99']:.3f} max {latency['max']:.3f}")
    for priority, figures in result.get("by_priority", {}).items():
        latency = figures["latency_ms"]
        print(f"  priority {priority}: {figures['count']} calls, {figures['errors']} errors, "
              f"{figures['throughput_per_s']:.1f}/s, latency ms p50 {latency['p50']:.3f} "
              f"p95 {latency['p95']:.3f} p99 {latency['p99']:.3f}")
    if result["last_error"]:
        print(f"last error: {result['last_error']}")
