"""Benchmark: fleet control through a real Mosquitto on loopback.

(1) ``ping`` round trip, operator to node and back (sign, publish, check, run, final reply),
    p50 and p99 over sequential pings to one node (the real link and controller);
(2) the time from publishing one ``all`` broadcast until every one of N simulated nodes
    (the real link and controller each, in this process) has sent its final reply.

Targets (issue 6): ping p99 <= 20 ms; 500 nodes answer within 2 s.
Needs Mosquitto (installed by `./install.sh --dev`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from control_helpers import Operator, simulated_fleet, trusted  # the tests' parts, not copies
from mqtt_helpers import Broker

from agent.control.envelope import TrustedKeys


def ping_round_trips(broker: Broker, scratch: Path, key: Ed25519PrivateKey,
                     count: int) -> None:
    operator = Operator(broker, key)
    keys = TrustedKeys.from_config(trusted(key))
    with simulated_fleet(broker, scratch / "ping", keys, 1) as nodes:
        name = nodes[0].controller.identity.node_id
        samples = []
        for _ in range(count):
            start = time.perf_counter()
            envelope = operator.send(name, "ping")
            operator.final(envelope["id"], seconds=10)
            samples.append((time.perf_counter() - start) * 1000)
    operator.close()
    ms = np.array(samples[5:])  # the first few warm the broker's and the nodes' paths
    print(f"ping round trip over {len(ms)} sequential pings: p50 {np.percentile(ms, 50):.2f} "
          f"ms, p99 {np.percentile(ms, 99):.2f} ms, max {ms.max():.2f} ms (p99 <= 20 ms)")


def broadcast(broker: Broker, scratch: Path, key: Ed25519PrivateKey, count: int,
              rounds: int) -> None:
    operator = Operator(broker, key)
    keys = TrustedKeys.from_config(trusted(key))
    durations = []
    with simulated_fleet(broker, scratch / f"fleet-{count}", keys, count):
        for _ in range(rounds):
            start = time.perf_counter()
            finals = operator.wait_finals(operator.send("all", "ping")["id"], count, 60)
            if list(finals.values()).count("succeeded") < count:
                raise RuntimeError(f"{len(finals)} of {count} nodes answered")
            durations.append(time.perf_counter() - start)
    operator.close()
    print(f"broadcast to {count} nodes: all answered in median {statistics.median(durations):.3f}"
          f" s, worst {max(durations):.3f} s over {rounds} broadcasts (500 within 2 s)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pings", type=int, default=205)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    key = Ed25519PrivateKey.generate()
    with tempfile.TemporaryDirectory() as scratch:
        broker = Broker(Path(scratch) / "broker")
        broker.start()
        try:
            ping_round_trips(broker, Path(scratch), key, args.pings)
            for count in (200, 500):
                broadcast(broker, Path(scratch), key, count, args.rounds)
        finally:
            broker.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
