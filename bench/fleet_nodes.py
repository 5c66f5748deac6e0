"""The simulated nodes of ``bench/fleet.py``: many per worker process, driven over a pipe.

Each node is the tests' ``SimulatedNode`` (the agent's real link and controller) with the
real telemetry path: a ``Sampler`` numbering records (session, seq) into the node's outbox,
which its link publishes at QoS 1 and forgets only once acknowledged.  One thread per worker
calls every node's sampler in turn, evenly spread over the interval, in place of a sampler
thread per node (a thousand more threads would only measure the scheduler).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from control_helpers import SimulatedNode, raise_file_limit, trusted_keys

from agent import protocol
from agent.telemetry.sampler import FunctionCollector, Sampler

MAX_PAYLOAD = 64 * 1024


@dataclass(frozen=True)
class Spec:
    """What a worker builds: its nodes' names, the broker list and the telemetry rate."""

    names: tuple[str, ...]
    brokers: tuple[str, ...]
    protocol_version: str
    state: str
    key: bytes  # the operator's private key, raw: its public half is what nodes trust
    interval_s: float


@dataclass(frozen=True)
class Endpoint:
    """What ``SimulatedNode`` reads of a broker (its list replaces it)."""

    host: str
    port: int


def usage() -> tuple[float, float]:
    """This process's CPU seconds (all threads) and RSS in MB."""
    with open("/proc/self/status") as status:
        rss = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return time.process_time(), rss / 1024


def descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


class Worker:
    def __init__(self, spec: Spec) -> None:
        raise_file_limit()
        keys = trusted_keys(Ed25519PrivateKey.from_private_bytes(spec.key))
        first = spec.brokers[0].rpartition(":")
        endpoint = Endpoint(first[0], int(first[2]))
        self.spec = spec
        self.nodes = [SimulatedNode(name, endpoint, Path(spec.state), keys,  # type: ignore[arg-type]
                                    brokers=spec.brokers, birth=True,
                                    protocol_version=spec.protocol_version)
                      for name in spec.names]
        self.samplers = [Sampler([FunctionCollector("link", node.link.status.metrics)],
                                 node.outbox, node.link.sequence,
                                 node.link.topic(protocol.TELEMETRY), spec.interval_s,
                                 MAX_PAYLOAD) for node in self.nodes]
        self._sampling = threading.Event()
        self._driver: threading.Thread | None = None
        self.behind = 0  # rounds the driver could not keep on schedule

    def start(self) -> None:
        for node in self.nodes:
            node.start()

    def telemetry(self, on: bool) -> None:
        if on and self._driver is None:
            self._sampling.set()
            self._driver = threading.Thread(target=self._drive, name="samplers", daemon=True)
            self._driver.start()
        elif not on and self._driver is not None:
            self._sampling.clear()
            self._driver.join()
            self._driver = None

    def _drive(self) -> None:
        """Each node's sampler once per interval, the nodes evenly spaced within it."""
        step = self.spec.interval_s / len(self.samplers)
        due = time.monotonic()
        while self._sampling.is_set():
            for sampler in self.samplers:
                if not self._sampling.is_set():
                    return
                sampler.sample_once()
                due += step
                delay = due - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                elif delay < -self.spec.interval_s:  # a whole round late: start again
                    self.behind += 1
                    due = time.monotonic()

    def links(self) -> list[tuple[str, str, str, bool, int]]:
        """(node, state, broker, subscribed, failovers) of every node."""
        return [(node.link.settings.client_id, node.link.status.state, node.link.status.broker,
                 node.link.status.subscribed, node.link.status.failovers)
                for node in self.nodes]

    def waiting(self) -> int:
        """Telemetry records the nodes' outboxes still hold (not acknowledged)."""
        return sum(node.outbox.depth for node in self.nodes)

    def ledger(self) -> dict[str, dict[int, int]]:
        """node -> {session: records taken}: what a subscriber should have received."""
        found: dict[str, dict[int, int]] = {}
        for node, sampler in zip(self.nodes, self.samplers, strict=True):
            taken = {s: n for s, n in node.link.status.sessions_ended.items() if n}
            last = sampler.last
            if last is not None and last["session"] not in taken:
                taken[last["session"]] = last["seq"] + 1
            found[node.link.settings.client_id] = taken
        return found

    def stop(self) -> None:
        self.telemetry(False)
        for node in self.nodes:
            node.stop()


def serve(connection: Connection, spec: Spec) -> None:
    """A worker process: answers each request (a name and arguments) on ``connection``."""
    before = usage()
    worker = Worker(spec)
    requests: dict[str, Any] = {
        "start": worker.start, "telemetry": worker.telemetry, "links": worker.links,
        "waiting": worker.waiting, "ledger": worker.ledger, "usage": usage,
        "descriptors": descriptors, "behind": lambda: worker.behind}
    connection.send(before)
    while True:
        name, args = connection.recv()
        if name == "stop":
            worker.stop()
            connection.send(None)
            return
        connection.send(requests[name](*args))
