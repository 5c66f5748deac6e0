"""Load on a data plane and what it measured: an open loop at a rate (each request's latency
counts from when it was due, so a server that falls behind is charged for the wait: no
coordinated omission), or a closed loop of N clients each sending its next request when the
last is answered.  ``call(index)`` sends one request on client ``index``'s own connection."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from queue import SimpleQueue

Call = Callable[[int], None]
STOP = -1.0
# requests due and waiting for a client: past this many the load is far behind, and the
# requests falling due are counted as failed, not queued, so a rate far above what the data
# plane answers (--rate 1e9) costs neither memory nor minutes
MAX_BACKLOG = 100_000


@dataclass
class Sample:
    """Latencies (s) of the requests answered, the ones that failed or were never sent,
    and the seconds the load ran."""

    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    elapsed_s: float = 0.0
    first_error: str = ""  # what the first failed request was told, for the report

    def failed(self, why: str, count: int = 1) -> None:
        """Count ``count`` failed requests (under the caller's lock)."""
        self.errors += count
        self.first_error = self.first_error or why

    def joined(self, other: Sample) -> Sample:
        """This sample and ``other``, a second run of the same load, as one."""
        return Sample(self.latencies + other.latencies, self.errors + other.errors,
                      self.elapsed_s + other.elapsed_s, self.first_error or other.first_error)

    def p99_ms(self) -> float:
        """The 99th percentile (nearest rank) in ms; infinite when nothing was answered."""
        if not self.latencies:
            return float("inf")
        ordered = sorted(self.latencies)
        return ordered[max(0, -(-99 * len(ordered) // 100) - 1)] * 1000

    def throughput_rps(self) -> float:
        return len(self.latencies) / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def within_rps(self, limit_ms: float | None) -> float:
        """Requests per second answered within ``limit_ms`` (all answered: None)."""
        if limit_ms is None or self.elapsed_s <= 0:
            return self.throughput_rps()
        return sum(1 for x in self.latencies if x * 1000 <= limit_ms) / self.elapsed_s


def _guarded(call: Call, index: int) -> float | str:
    """The request's latency, or why it failed (a refusal costs that request)."""
    begin = time.perf_counter()
    try:
        call(index)
    except Exception as error:  # any failure of one request is that request's
        return str(error) or type(error).__name__
    return time.perf_counter() - begin


def closed_loop(call: Call, clients: int, seconds: float) -> Sample:
    sample = Sample()
    lock = threading.Lock()
    end = time.perf_counter() + seconds

    def client(index: int) -> None:
        while time.perf_counter() < end:
            latency = _guarded(call, index)
            with lock:
                if isinstance(latency, str):
                    sample.failed(latency)
                else:
                    sample.latencies.append(latency)

    began = time.perf_counter()
    _run_all([threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)])
    sample.elapsed_s = time.perf_counter() - began
    return sample


def open_loop(call: Call, rate: float, seconds: float, workers: int) -> Sample:
    """Requests due every 1/rate s for ``seconds``, sent by ``workers`` clients; once the
    load is a whole window past its end, the requests still waiting for a client are
    counted as failed, not sent (a candidate far too slow costs two windows, not minutes), as
    are the requests falling due while MAX_BACKLOG wait already."""
    sample = Sample()
    lock = threading.Lock()
    due: SimpleQueue[float] = SimpleQueue()
    began = time.perf_counter()
    end = began + seconds

    def client(index: int) -> None:
        while (when := due.get()) != STOP:
            if time.perf_counter() >= end + seconds:  # far behind: the rest are dropped
                with lock:
                    sample.failed("not sent: the load fell a whole window behind")
                continue
            answer = _guarded(call, index)
            latency = time.perf_counter() - when
            with lock:
                if isinstance(answer, str):
                    sample.failed(answer)
                else:
                    sample.latencies.append(latency)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(workers)]
    for thread in threads:
        thread.start()
    sent = 0
    while (now := time.perf_counter()) < end:
        wanted = int((now - began) * rate) + 1
        queued = min(wanted - sent, max(0, MAX_BACKLOG - due.qsize()))
        for number in range(sent, sent + queued):
            due.put(began + number / rate)
        if wanted - sent > queued:
            with lock:
                sample.failed(f"not sent: {MAX_BACKLOG} requests were already waiting",
                              wanted - sent - queued)
        sent = wanted
        time.sleep(min(0.001, max(0.0, began + sent / rate - time.perf_counter())))
    for _ in threads:
        due.put(STOP)
    for thread in threads:
        thread.join()
    sample.elapsed_s = time.perf_counter() - began
    return sample


def _run_all(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
