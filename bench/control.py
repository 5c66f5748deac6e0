"""Benchmark: fleet control through a real Mosquitto on loopback.

(1) ``ping`` round trip, operator to node and back (sign, publish, check, run, final reply),
    p50 and p99 over sequential pings to one node (the real link and controller);
(2) the time from publishing one ``all`` broadcast until every one of N simulated nodes
    (the real link and controller each, in this process) has sent its final reply.

(3) a junk flood against a real ``edge-agent run`` process (link, controller, service): 5,000
    forged messages (unsigned, malformed, nested past the recursion limit, bad signature,
    unknown key) published as fast as one client can while another sends 200 signed pings,
    paced: the fraction of pings answered, junk replies published per junk message, the
    agent's CPU during the flood, its RSS at idle and at peak (sampled from /proc).

Targets: ping p99 <= 20 ms; 500 nodes answer within 2 s (issue 6); during the flood
>= 99.9 % of the signed pings answered and RSS within 20 MB of idle (issue 15).
Needs Mosquitto (installed by `./install.sh --dev`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import yaml
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from agent_process import FIXTURES
from control_helpers import (  # the tests' parts, not copies
    FLEET,
    Operator,
    node_config,
    simulated_fleet,
    trusted_keys,
)
from hostile_helpers import RawClient, junk
from mqtt_helpers import Broker, wait_until

from agent import protocol


def ping_round_trips(broker: Broker, scratch: Path, key: Ed25519PrivateKey,
                     count: int) -> None:
    operator = Operator(broker, key)
    keys = trusted_keys(key)
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


def timed_broadcasts(operator: Operator, count: int, rounds: int) -> list[float]:
    """Seconds from publishing an ``all`` ping to the last of ``count`` final replies, for
    each of ``rounds`` broadcasts one after the other."""
    durations = []
    for _ in range(rounds):
        start = time.perf_counter()
        finals = operator.wait_finals(operator.send("all", "ping")["id"], count, 60)
        if list(finals.values()).count("succeeded") < count:
            raise RuntimeError(f"{len(finals)} of {count} nodes answered")
        durations.append(time.perf_counter() - start)
    return durations


def broadcast(broker: Broker, scratch: Path, key: Ed25519PrivateKey, count: int,
              rounds: int) -> list[float]:
    operator = Operator(broker, key)
    keys = trusted_keys(key)
    with simulated_fleet(broker, scratch / f"fleet-{count}", keys, count):
        durations = timed_broadcasts(operator, count, rounds)
    operator.close()
    print(f"broadcast to {count} nodes: all answered in median {statistics.median(durations):.3f}"
          f" s, worst {max(durations):.3f} s over {rounds} broadcasts (500 within 2 s)")
    return durations


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        line = next(x for x in status if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def flood(broker: Broker, scratch: Path, key: Ed25519PrivateKey, count: int,
          pings: int) -> None:
    scratch.mkdir(parents=True, exist_ok=True)
    config = node_config(scratch, FIXTURES / "jetson-agx-orin-jp6", broker, key, allow=["ping"])
    config["inference"] = {"enabled": False}  # the agent's CPU is the link's and control's
    path = scratch / "agent.yaml"
    path.write_text(yaml.safe_dump(config))
    log = (scratch / "agent.log").open("w")  # a pipe nobody reads would block its logging
    agent = subprocess.Popen([sys.executable, "-m", "agent", "run", "--config", str(path)],
                             stdout=log, stderr=subprocess.STDOUT)
    operator = Operator(broker, key)
    raw = RawClient(broker, "attacker")
    node = "orin-1"
    try:
        if not wait_until(lambda: _final(operator, operator.send(node, "ping")["id"], 2),
                          30, 0.5):
            raise RuntimeError("the agent did not answer a ping")
        idle = max(_rss_mb(agent.pid) for _ in range(20) if time.sleep(0.1) is None)
        peak, done = [idle], threading.Event()

        def watch() -> None:
            while not done.wait(0.02):
                peak.append(_rss_mb(agent.pid))

        sent: list[str] = []

        def ping() -> None:
            for _ in range(pings):
                sent.append(operator.send(node, "ping")["id"])
                time.sleep(0.01)

        topic = protocol.topic(protocol.node_root(FLEET, node), protocol.command_suffix("ping"))
        payloads = [payload for _kind, payload in junk(key, f"node:{node}", count)]
        threading.Thread(target=watch, daemon=True).start()
        cpu0, start = _cpu_s(agent.pid), time.monotonic()
        pinger = threading.Thread(target=ping)
        pinger.start()
        for payload in payloads:
            raw.publish(topic, payload)
        raw.drain(120)
        pinger.join()
        deadline = time.monotonic() + 60  # for all of them together, then count
        answered = sum(1 for command_id in sent
                       if _final(operator, command_id, max(0.1, deadline - time.monotonic())))
        elapsed, cpu = time.monotonic() - start, _cpu_s(agent.pid) - cpu0
        done.set()
        link = json.loads((Path(config["state_dir"]) / "status.json").read_text())["link"]
        junk_ids = {f"junk-{n}" for n in range(count)}
        replies = [r for r in operator.replies if r.get("id") in junk_ids or r.get("id") is None]
        print(f"flood of {count} junk messages with {pings} signed pings: "
              f"{answered}/{pings} pings answered ({100 * answered / pings:.2f} %, >= 99.9 %); "
              f"{len(replies)} junk replies for {count} junk messages; agent CPU "
              f"{100 * cpu / elapsed:.0f} % over {elapsed:.1f} s; RSS idle {idle:.1f} MB, "
              f"peak {max(peak):.1f} MB (+{max(peak) - idle:.1f} MB, within 20 MB); "
              f"{len(sent)} pings sent; link faults {link['faults']}; broker log lines on "
              f"dropped messages: {broker.log().count('dropped')}")
    finally:
        raw.close()
        operator.close()
        agent.send_signal(signal.SIGTERM)
        agent.wait(30)
        log.close()


def _final(operator: Operator, command_id: str, seconds: float = 60) -> bool:
    try:
        return operator.final(command_id, seconds=seconds)["status"] == "succeeded"
    except AssertionError:
        return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pings", type=int, default=205)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--junk", type=int, default=5000)
    parser.add_argument("--flood-pings", type=int, default=200)
    parser.add_argument("--only-flood", action="store_true")
    args = parser.parse_args()
    key = Ed25519PrivateKey.generate()
    with tempfile.TemporaryDirectory() as scratch:
        broker = Broker(Path(scratch) / "broker")
        broker.start()
        try:
            if not args.only_flood:
                ping_round_trips(broker, Path(scratch), key, args.pings)
                for count in (200, 500):
                    broadcast(broker, Path(scratch), key, count, args.rounds)
            flood(broker, Path(scratch), key, args.junk, args.flood_pings)
        finally:
            broker.stop()
        # Mosquitto queues at most 1000 messages per client by default and drops the rest (a
        # fast publisher outruns any subscriber): the same flood with room for it, to show
        # what the agent itself loses
        print("again, with Mosquitto's max_queued_messages 20000:")
        broker = Broker(Path(scratch) / "roomy-broker")
        broker.config.write_text(broker.config.read_text() + "max_queued_messages 20000\n")
        broker.start()
        try:
            flood(broker, Path(scratch) / "roomy", key, args.junk, args.flood_pings)
        finally:
            broker.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
