"""Benchmark: a fleet larger than one broker (issue 35).

(1) N simulated nodes (the agent's real link, controller and telemetry path; ``fleet_nodes``,
    many per worker process) on a three-member RabbitMQ cluster with the MQTT plugin
    (``tests/rabbit_cluster.py``), MQTT 3.1.1 (RabbitMQ 3.10 speaks no 5); each node's own
    order of the broker list spreads the fleet over the members;
(2) every node samples a telemetry record every ``--interval`` s into its outbox; a
    subscriber on a surviving member collects them; one member is killed with SIGKILL: the
    time until 99 % and 100 % of the nodes are connected (and subscribed) again, then per
    node and session, the (session, seq) the subscriber got against what the node took:
    lost (must be 0) and duplicated (QoS 1 resends what the killed member took but never
    acknowledged; a consumer drops them by (session, seq));
(3) an ``all`` ping broadcast after recovery: publish to the last final reply (<= 2 s);
(4) the 500-node broadcast on one Mosquitto (<= 2 s), the nodes and operator as in (3);
(5) CPU seconds and RSS per simulated node, per phase.

The nodes run ``--per-proc`` to a worker process: with 500 (two workers) a broadcast took
21-47 s, and ``perf`` put most of the workers' CPU in the kernel's futex and scheduler
paths (500 link and 500 controller threads queueing for one GIL: 14 s system to 4.5 s user
per worker); with 64 the same broadcast took 1.4-4 s.

Needs rabbitmq-server and Mosquitto (``./install.sh --dev``).  Takes a few minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import psutil
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat
from fleet_nodes import Spec, serve
from paho.mqtt.enums import CallbackAPIVersion

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from control_helpers import FLEET, Operator, raise_file_limit
from mqtt_helpers import Broker, wait_until
from rabbit_cluster import SCRIPTS, Member, RabbitCluster

from agent import protocol
from agent.control.collect import collect
from agent.control.resend import resender
from agent.link import probe

POLL_S = 0.05
IDLE_S = 5.0


def cpu_seconds(pids: list[int]) -> float:
    """CPU seconds of these processes and their children (a broker's beam under its
    start script) until now."""
    total = 0.0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            for process in [root, *root.children(recursive=True)]:
                times = process.cpu_times()
                total += times.user + times.system + times.children_user + \
                    times.children_system
        except psutil.Error:
            continue  # a killed member
    return total


class Fleet:
    """The worker processes and what they report, summed over them."""

    def __init__(self, specs: list[Spec]) -> None:
        context = multiprocessing.get_context("fork")  # before any thread of ours starts
        self.pipes: list[Connection] = []
        self.processes = []
        for spec in specs:
            ours, theirs = context.Pipe()
            process = context.Process(target=serve, args=(theirs, spec), daemon=True)
            process.start()
            self.pipes.append(ours)
            self.processes.append(process)
        self.baseline = [pipe.recv() for pipe in self.pipes]  # (cpu, rss) before the nodes
        self.count = sum(len(spec.names) for spec in specs)

    def ask(self, name: str, *args: Any) -> list[Any]:
        for pipe in self.pipes:
            pipe.send((name, args))
        return [pipe.recv() for pipe in self.pipes]

    def links(self) -> list[tuple[str, str, str, bool, int]]:
        return [link for part in self.ask("links") for link in part]

    def usage(self) -> tuple[float, float]:
        """CPU seconds and RSS MB of all workers, less what they had before the nodes."""
        now = self.ask("usage")
        return (sum(c for c, _ in now) - sum(c for c, _ in self.baseline),
                sum(r for _, r in now) - sum(r for _, r in self.baseline))

    def stop(self) -> None:
        self.ask("stop")
        for process in self.processes:
            process.join(30)


class Collector:
    """A QoS 1 subscriber to every node's telemetry on one member (3.1.1, clean session)."""

    def __init__(self, member: Member) -> None:
        self.received: list[tuple[str, int, int, bool]] = []  # node, session, seq, historical
        self.lock = threading.Lock()
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="fleet-bench-collector",
                                  protocol=mqtt.MQTTv311)
        subscribed = threading.Event()
        self.client.on_message = self._on_message
        self.client.on_subscribe = lambda *args: subscribed.set()
        self.client.connect(member.host, member.port, 30)
        self.client.subscribe(protocol.each_node(FLEET, protocol.TELEMETRY), qos=1)
        self.client.loop_start()
        if not subscribed.wait(30):
            raise RuntimeError(f"the collector could not subscribe on {member.address}")

    def _on_message(self, client: mqtt.Client, userdata: Any, message: mqtt.MQTTMessage) -> None:
        record = json.loads(message.payload)
        node = message.topic.split("/")[3]
        with self.lock:
            self.received.append((node, record["session"], record["seq"],
                                  bool(record.get("historical"))))

    def count(self) -> int:
        with self.lock:
            return len(self.received)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def audit(ledger: dict[str, dict[int, int]],
          received: list[tuple[str, int, int, bool]]) -> dict[str, int]:
    """What the nodes took against what arrived: per (node, session) the seqs 0..taken-1."""
    got: dict[tuple[str, int], Counter[int]] = defaultdict(Counter)
    for node, session, seq, _historical in received:
        got[node, session][seq] += 1
    expected = lost = duplicates = unexpected = gap_nodes = dup_nodes = 0
    for node, sessions in ledger.items():
        node_lost = node_dups = 0
        for session, taken in sessions.items():
            seqs = got.pop((node, session), Counter())
            expected += taken
            node_lost += sum(1 for seq in range(taken) if seq not in seqs)
            node_dups += sum(n - 1 for n in seqs.values())
            unexpected += sum(1 for seq in seqs if not 0 <= seq < taken)
        lost, duplicates = lost + node_lost, duplicates + node_dups
        gap_nodes += node_lost > 0
        dup_nodes += node_dups > 0
    unexpected += sum(sum(seqs.values()) for seqs in got.values())  # unknown node/session
    return {"expected": expected, "received": len(received), "lost": lost,
            "duplicates": duplicates, "nodes_with_gap": gap_nodes,
            "nodes_with_duplicate": dup_nodes, "unexpected": unexpected,
            "historical": sum(1 for r in received if r[3])}


def recovery(fleet: Fleet, seconds: float, start: float,
             gone: str = "") -> dict[str, float | None]:
    """Seconds from ``start`` until 99 % and 100 % of the nodes are connected, and
    subscribed (a command reaches them), polling each node's link status; a node still
    shown connected to ``gone`` (the killed member: its link has not noticed yet) is not."""
    marks: dict[str, float | None] = {"connected_99": None, "connected_100": None,
                                      "subscribed_99": None, "subscribed_100": None}
    deadline = start + seconds
    while time.monotonic() < deadline and marks["subscribed_100"] is None:
        links = fleet.links()
        now = time.monotonic() - start
        links = [link for link in links if link[2] != gone]
        connected = sum(1 for link in links if link[1] == "connected")
        subscribed = sum(1 for link in links if link[3])
        for kind, n in (("connected", connected), ("subscribed", subscribed)):
            for share, key in ((0.99, f"{kind}_99"), (1.0, f"{kind}_100")):
                if marks[key] is None and n >= share * fleet.count:
                    marks[key] = now
        time.sleep(POLL_S)
    return marks


def seconds(value: float | None) -> str:
    return "never" if value is None else f"{value:.2f} s"


def spread(fleet: Fleet) -> Counter[str]:
    return Counter(link[2] for link in fleet.links())


def alone(op: Operator, nodes: set[str]) -> int:
    """How many of ``nodes`` answer a command sent to each alone within 10 s (deaf to
    ``all`` only, or to their own topic too)."""
    sent_at, deadline = time.time(), time.monotonic() + 10  # one wait for them all
    ids = {node: op.send(node, "ping")["id"] for node in sorted(nodes)}
    return sum(collect(op.bus, command_id, {node}, sent_at,
                       max(0.0, deadline - time.monotonic()))[node].status ==
               protocol.SUCCEEDED for node, command_id in ids.items())


def noting(resend: Callable[[str | None], None],
           alone: set[str]) -> Callable[[str | None], None]:
    """``resend``, adding to ``alone`` each node it sends to on its own topic."""
    def again(node: str | None) -> None:
        alone.update([node] if node else [])
        resend(node)
    return again


def resent_broadcasts(op: Operator, fleet: Fleet, rounds: int,
                      brokers: list[int]) -> list[str]:
    """As bench/control.py's broadcasts, but collected as ``fleet send`` does (the
    product's ``collect``): published again when the operator's session moves to another
    member, which a 3.1.1 clean session on a cluster does when its member drops it.  Each
    round: until every node answered (or 60 s), and until 99 % had; and the first round's
    share of the machine's cores taken by the brokers, the nodes and the operator."""
    durations = []
    cores = psutil.cpu_count() or 1
    used = (cpu_seconds(brokers), fleet.usage()[0], time.process_time())
    count = fleet.count
    names = {f"sim-{i:04d}" for i in range(count)}
    for _ in range(rounds):
        start, sent_at = time.perf_counter(), time.time()
        envelope = op.send("all", "ping")
        alone_sent: set[str] = set()
        outcomes = collect(op.bus, envelope["id"], names, sent_at, 60, again=noting(
            resender(op.bus, op.key, "all", envelope), alone_sent))
        answered = sum(o.status == protocol.SUCCEEDED for o in outcomes.values())
        times = sorted(o.ms for o in outcomes.values() if o.ms is not None
                       and o.status == protocol.SUCCEEDED)
        most = -(-99 * count // 100)
        durations.append(f"{time.perf_counter() - start:.3f} (99 %: " + (
            f"{times[most - 1] / 1000:.3f}" if len(times) >= most else "never"))
        if alone_sent:  # deaf to ``all``, or back from another member: its own topic
            heard = [o.ms for o in outcomes.values() if o.node not in alone_sent and o.ms]
            durations[-1] += (f"; {len(alone_sent)} sent again alone, the others in "
                              f"{max(heard, default=0) / 1000:.3f}")
        durations[-1] += ")"
        if len(durations) == 1:
            wall = (time.perf_counter() - start) * cores / 100
            now = (cpu_seconds(brokers), fleet.usage()[0], time.process_time())
            durations[0] += " [{:.0f} / {:.0f} / {:.0f} % of {} cores]".format(
                *((b - a) / wall for a, b in zip(used, now, strict=True)), cores)
        if answered < count:  # said, not raised: the rest of the run is still measured
            silent = {n for n, o in outcomes.items() if o.status != protocol.SUCCEEDED}
            where = Counter((link[2], link[4]) for link in fleet.links() if link[0] in silent)
            print(f"broadcast: {answered} of {count} nodes answered within 60 s; the silent "
                  "ones by (member, failovers): " + ", ".join(
                      f"{m} {f}: {n}" for (m, f), n in sorted(where.items())) +
                  f"; answering a ping sent to each alone: {alone(op, silent)}", flush=True)
    return durations


def mirror_subscriptions(cluster: RabbitCluster) -> None:
    """A policy that mirrors the MQTT plugin's subscription queues on every member.

    RabbitMQ 3.10 declares each client's QoS 1 subscription queue durable (even for a clean
    session) on the member it connected to; when that member dies the queue's record stays,
    homed on the dead member, and the client's SUBSCRIBE on another member fails
    (``NOT_FOUND - home node ... is down``; the plugin closes the connection) until it comes
    back.  Mirrored, a surviving copy is promoted and the subscription moves with the node.
    The agent avoids it without a policy: on a broker list it subscribes at QoS 0
    (agent.link.client.subscribe), whose queues are not durable."""
    command = [str(SCRIPTS / "rabbitmqctl"), "-n", cluster.members[0].name, "-q",
               "set_policy", "--apply-to", "queues", "mqtt-subscriptions",
               "^mqtt-subscription-", json.dumps({"ha-mode": "all"})]
    subprocess.run(command, env=cluster.env(), check=True, capture_output=True, timeout=60)


def specs(args: argparse.Namespace, count: int, brokers: tuple[str, ...], version: str,
          key: Ed25519PrivateKey, state: Path) -> list[Spec]:
    """``count`` nodes on ``brokers`` (MQTT ``version``), ``args.per_proc`` to a worker."""
    raw = key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
    names = [f"sim-{i:04d}" for i in range(count)]
    procs = -(-count // args.per_proc)
    return [Spec(tuple(names[part::procs]), brokers, version, str(state), raw,
                 args.interval) for part in range(procs)]


def cluster_run(args: argparse.Namespace, scratch: Path, key: Ed25519PrivateKey,
                rows: list[tuple[str, str]]) -> None:
    cluster = RabbitCluster.create(scratch / "rabbit", size=3)
    victim, survivor = cluster.members[args.victim], cluster.members[(args.victim + 1) % 3]
    fleet = Fleet(specs(args, args.nodes, tuple(m.address for m in cluster.members), "3.1.1",
                        key, scratch / "nodes"))  # forked before any thread
    try:
        started = time.monotonic()
        cluster.boot()
        if args.mirror:
            mirror_subscriptions(cluster)
        rows.append((f"cluster boot (3 members; subscription queues "
                     f"{'' if args.mirror else 'not '}mirrored)",
                     f"{time.monotonic() - started:.1f} s"))
        collector = Collector(survivor)
        brokers = [cluster.pids[member.name] for member in cluster.members]
        started = time.monotonic()
        fleet.ask("start")
        up = recovery(fleet, 300, started)
        rows.append((f"{fleet.count} nodes connected / subscribed from start",
                     f"{seconds(up['connected_100'])} / {seconds(up['subscribed_100'])}"))
        if up["subscribed_100"] is None:
            raise RuntimeError("not every node connected and subscribed within 300 s")
        cpu0, rss0 = fleet.usage()
        before = spread(fleet)
        rows.append(("nodes per member before the kill",
                     ", ".join(f"{m.address}{' (killed)' if m is victim else ''}: "
                               f"{before[m.address]}" for m in cluster.members)))
        rows.append(("RSS per node (links connected, idle)",
                     f"{1024 * rss0 / fleet.count:.0f} KB"))
        rows.append(("CPU per node to connect", f"{1000 * cpu0 / fleet.count:.1f} ms"))
        counts = fleet.ask("descriptors")
        rows.append((f"descriptors per worker process ({len(counts)} workers)",
                     f"{min(counts)}-{max(counts)}"))
        operator = Operator(survivor, key, brokers=tuple(m.address for m in cluster.members),
                            protocol_version="3.1.1")
        first = resent_broadcasts(operator, fleet, 1, brokers)
        operator.close()
        rows.append((f"broadcast to {fleet.count} nodes before the kill", f"{first[0]} s"))
        cpu0, _ = fleet.usage()  # steady telemetry's CPU from here
        fleet.ask("telemetry", True)
        time.sleep(args.steady)  # the fleet's steady state, measured below
        cpu1, _ = fleet.usage()
        per_s = (cpu1 - cpu0) / args.steady
        rows.append((f"telemetry: 1 record / node / {args.interval:g} s "
                     f"({fleet.count / args.interval:.0f} records/s)",
                     f"{100 * per_s:.0f} % of a core for the fleet, "
                     f"{1000 * per_s / fleet.count:.2f} ms CPU per node per s"))
        print(f"killing {victim.name} ({victim.address}, {before[victim.address]} nodes)",
              flush=True)
        killed = time.monotonic()
        cluster.kill(victim)
        back = recovery(fleet, 120, killed, victim.address)
        cpu2, _ = fleet.usage()
        failover_s = time.monotonic() - killed
        rows.append(("after the kill: 99 % / 100 % connected",
                     f"{seconds(back['connected_99'])} / {seconds(back['connected_100'])}"))
        rows.append(("after the kill: 99 % / 100 % subscribed",
                     f"{seconds(back['subscribed_99'])} / {seconds(back['subscribed_100'])}"))
        after = spread(fleet)
        rows.append(("nodes per member after the kill", ", ".join(
            f"{m.address}: {after[m.address]}" for m in cluster.members)))
        back_links = [link[4] for link in fleet.links()]
        rows.append(("failovers counted by the nodes", str(sum(back_links))))
        time.sleep(args.after)  # telemetry goes on on the new members
        fleet.ask("telemetry", False)
        drained = wait_until(lambda: sum(fleet.ask("waiting")) == 0, 60, 0.2)
        ledger = {node: taken for part in fleet.ask("ledger") for node, taken in part.items()}
        total = sum(sum(taken.values()) for taken in ledger.values())
        wait_until(lambda: collector.count() >= total, 30, 0.2)
        time.sleep(1)  # late duplicates
        collector.close()
        result = audit(ledger, collector.received)
        rows.append(("records taken / received (outboxes drained)",
                     f"{result['expected']} / {result['received']} ({drained})"))
        rows.append(("records lost (must be 0) / nodes with a gap",
                     f"{result['lost']} / {result['nodes_with_gap']}"))
        rows.append(("QoS 1 duplicates / nodes with one (dropped by (session, seq))",
                     f"{result['duplicates']} / {result['nodes_with_duplicate']}"))
        rows.append(("replayed (historical) records / unexpected",
                     f"{result['historical']} / {result['unexpected']}"))
        rows.append(("sampler rounds behind schedule", str(sum(fleet.ask("behind")))))
        # the nodes' later delivery probes (AGAIN_S[0], stretched by up to SPREAD, after
        # subscribing) find what the survivors' clean-up of the dead member's queues took,
        # and those nodes reconnect
        later_s = probe.AGAIN_S[0] * (1 + probe.SPREAD) + probe.PROBE_S
        time.sleep(max(0.0, killed + later_s + 2 - time.monotonic()))
        connects = sum(link[4] for link in fleet.links())
        later = recovery(fleet, 120, killed, victim.address)
        rows.append((f"after the later delivery probes (kill + {later_s:g}"
                     " s): failovers since (a later probe lost) / 100 % subscribed",
                     f"{connects - sum(back_links)} / {seconds(later['subscribed_100'])}"))
        idle0, idle_at = fleet.usage()[0], time.monotonic()
        time.sleep(IDLE_S)  # the links alone, no telemetry: what the broadcasts add to
        idle_s = (fleet.usage()[0] - idle0) / (time.monotonic() - idle_at)
        rows.append(("CPU of idle links (telemetry off)",
                     f"{1000 * idle_s / fleet.count:.2f} ms per node per s"))
        operator = Operator(survivor, key, brokers=tuple(m.address for m in cluster.members),
                            protocol_version="3.1.1")
        cpu2b, started = fleet.usage()[0], time.monotonic()
        durations = resent_broadcasts(operator, fleet, args.rounds, brokers)
        broadcasts_s = fleet.usage()[0] - cpu2b - idle_s * (time.monotonic() - started)
        operator.close()
        rss3 = fleet.usage()[1]
        rows.append((f"broadcast to {fleet.count} nodes after recovery (<= 2 s)",
                     ", ".join(durations) + " s"))
        rows.append(("CPU per node beyond steady telemetry and idle links: failover / "
                     "each broadcast",
                     f"{1000 * (cpu2 - cpu1 - per_s * failover_s) / fleet.count:.1f} ms / "
                     f"{1000 * broadcasts_s / fleet.count / args.rounds:.2f} ms"))
        rows.append(("RSS per node at the end", f"{1024 * rss3 / fleet.count:.0f} KB"))
    finally:
        fleet.stop()
        cluster.stop(remove=not args.keep)


def mosquitto_run(args: argparse.Namespace, scratch: Path, key: Ed25519PrivateKey,
                  rows: list[tuple[str, str]]) -> None:
    broker = Broker(scratch / "mosquitto")
    fleet = Fleet(specs(args, args.mosquitto_nodes, (f"{broker.host}:{broker.port}",), "5",
                        key, scratch / "mosquitto-nodes"))  # forked before any thread
    broker.start()
    try:
        fleet.ask("start")
        if recovery(fleet, 120, time.monotonic())["subscribed_100"] is None:
            raise RuntimeError("not every node connected and subscribed within 120 s")
        operator = Operator(broker, key)
        durations = resent_broadcasts(operator, fleet, args.rounds, [broker.process.pid])
        operator.close()
    finally:
        fleet.stop()
        broker.stop()
    rows.append((f"broadcast to {args.mosquitto_nodes} nodes on one Mosquitto (<= 2 s)",
                 ", ".join(durations) + " s"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--per-proc", type=int, default=64,
                        help="simulated nodes per worker process (each node has a link and a "
                        "controller thread; hundreds of threads on one GIL measure its convoy, "
                        "not the nodes)")
    parser.add_argument("--interval", type=float, default=3.0, help="telemetry, s")
    parser.add_argument("--steady", type=float, default=15.0, help="s before the kill")
    parser.add_argument("--after", type=float, default=5.0, help="s of telemetry after")
    parser.add_argument("--victim", type=int, default=1, choices=(0, 1, 2))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mosquitto-nodes", type=int, default=500)
    parser.add_argument("--skip-cluster", action="store_true")
    parser.add_argument("--mirror", action="store_true",
                        help="a policy mirroring the subscription queues (not needed: on a "
                        "broker list the nodes subscribe at QoS 0, whose queues are not "
                        "durable; for comparison)")
    parser.add_argument("--keep", help="a directory to run in and keep (the brokers' logs)")
    parser.add_argument("--skip-mosquitto", action="store_true")
    args = parser.parse_args()
    raise_file_limit()
    key = Ed25519PrivateKey.generate()
    rows: list[tuple[str, str]] = []
    with contextlib.nullcontext(args.keep) if args.keep else \
            tempfile.TemporaryDirectory() as scratch:
        try:
            if not args.skip_cluster:
                cluster_run(args, Path(scratch), key, rows)
            if not args.skip_mosquitto:
                mosquitto_run(args, Path(scratch), key, rows)
        finally:
            width = max((len(name) for name, _ in rows), default=0)
            print("\n".join(f"{name:<{width}}  {value}" for name, value in rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
