"""Benchmark: telemetry sampling, the MQTT link and the agent's idle cost, in one run.

(1) CPU time of one full sample (every collector on this machine's /) against a psutil-only
    baseline doing the same reads (per-CPU times and frequencies, load, memory, swap,
    temperatures, fans, disks, network) plus the files psutil has no call for (PSI, cgroup,
    THP), interleaved;
(2) publish rate through the agent's link with the outbox on (put, commit, publish, PUBACK,
    delete) against a raw paho QoS 1 publish loop on the same Mosquitto, interleaved rounds;
(3) how long a record handed to the outbox waits before it is on disk (what a killed agent
    could lose), one put every 10 ms;
(4) CPU of `edge-agent run` sampling at 1 Hz with inference off, connected to the broker.

Targets (issue 5): a sample <= 2 ms CPU; link >= 0.8x raw paho; idle <= 1 % of one core.
Needs Mosquitto (installed by `./install.sh --dev`).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import paho.mqtt.client as mqtt
import psutil
import yaml
from paho.mqtt.enums import CallbackAPIVersion

from agent.discovery import discover
from agent.kernel.fsroot import Root
from agent.link.mqtt import MqttLink
from agent.link.settings import LinkSettings
from agent.telemetry.collectors import build_collectors
from agent.telemetry.outbox import Outbox
from agent.telemetry.records import Sequence
from agent.telemetry.sampler import Sampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from mqtt_helpers import Broker, wait_until  # the tests' broker, not a copy

PROTOCOLS = {"5": mqtt.MQTTv5, "3.1.1": mqtt.MQTTv311}


def cpu_ms(work: Callable[[], object], runs: int) -> float:
    samples = []
    for _ in range(runs):
        start = time.process_time()
        work()
        samples.append((time.process_time() - start) * 1000)
    return statistics.mean(samples)  # process_time ticks coarsely: the mean, not the median


def _read(path: str) -> str | None:
    try:
        with open(path) as handle:
            return handle.read()
    except OSError:
        return None


def psutil_sample() -> object:
    return (psutil.cpu_times(percpu=True), psutil.cpu_freq(percpu=True), psutil.getloadavg(),
            psutil.virtual_memory(), psutil.swap_memory(),
            getattr(psutil, "sensors_temperatures", dict)(),
            getattr(psutil, "sensors_fans", dict)(), psutil.disk_io_counters(perdisk=True),
            psutil.net_io_counters(pernic=True),
            [_read(f"/proc/pressure/{name}") for name in ("cpu", "memory", "io")],
            _read("/proc/self/cgroup"), _read("/proc/vmstat"),
            _read("/sys/kernel/mm/transparent_hugepage/enabled"))


def sample_cost(rounds: int) -> None:
    root = Root("/")
    collectors = build_collectors(root, discover(root))
    with tempfile.TemporaryDirectory() as scratch:
        outbox = Outbox(Path(scratch) / "o.sqlite", 1 << 30, 3600)
        sampler = Sampler(collectors, outbox, Sequence(1), "t", 1.0, 1 << 20)
        agent, baseline, queued = [], [], []
        for _ in range(rounds):
            agent.append(cpu_ms(sampler.collect, 50))
            baseline.append(cpu_ms(psutil_sample, 50))
            queued.append(cpu_ms(sampler.sample_once, 50))
        outbox.close()
    a, b, q = statistics.median(agent), statistics.median(baseline), statistics.median(queued)
    print(f"sample: agent collectors {a:.3f} ms CPU, psutil baseline {b:.3f} ms, ratio "
          f"{a / b:.2f}; with stamping, JSON and the outbox put {q:.3f} ms (<= 2 ms)")


def raw_paho(broker: Broker, payload: bytes, count: int, protocol: str) -> float:
    """Messages per second: publish QoS 1 as fast as paho takes them, wait for every ack."""
    acked = threading.Semaphore(0)
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="bench-raw",
                         protocol=PROTOCOLS[protocol])
    client.on_publish = lambda c, u, mid, code, props: acked.release()
    client.connect(broker.host, broker.port)
    client.loop_start()
    start = time.perf_counter()
    for _ in range(count):
        client.publish("bench/raw", payload, qos=1)
    for _ in range(count):
        acked.acquire()
    elapsed = time.perf_counter() - start
    client.loop_stop()
    client.disconnect()
    return count / elapsed


def agent_link(broker: Broker, payload: bytes, count: int, scratch: Path,
               protocol: str) -> float:
    """Messages per second through outbox put -> commit -> link publish -> PUBACK.  The ack
    batch's delete from the outbox follows within ACK_BATCH_S; it is checked, not timed."""
    outbox = Outbox(scratch / f"outbox-{time.monotonic_ns()}.sqlite", 1 << 30, 3600)
    link = MqttLink(LinkSettings(client_id="bench-agent", topic_root="bench/agent",
                                 host=broker.host, port=broker.port, protocol=protocol), outbox,
                    Sequence(outbox.bump("session")), lambda session: [])
    link.start()
    wait_until(lambda: link.status.state == "connected")
    start = time.perf_counter()
    for _ in range(count):
        outbox.put("bench/agent/telemetry", payload)
    wait_until(lambda: link.status.acked >= count, 120, 0.001)
    elapsed = time.perf_counter() - start
    if not wait_until(lambda: outbox.depth == 0, 10):
        raise RuntimeError(f"{outbox.depth} acknowledged records were not deleted")
    link.stop(flush_s=0)
    outbox.close()
    return count / elapsed


def link_rate(broker: Broker, rounds: int, count: int, protocol: str) -> None:
    payload = b'{"schema":"telemetry/1","metrics":' + b"1" * 1000 + b"}"  # ~1 KB, typical
    assert broker.process is not None
    mosquitto = psutil.Process(broker.process.pid)
    raw, agent, raw_broker, agent_broker = [], [], [], []

    def broker_us(run: Callable[[], float], rates: list[float], cpu: list[float]) -> None:
        before = sum(mosquitto.cpu_times()[:2])
        rates.append(run())
        cpu.append((sum(mosquitto.cpu_times()[:2]) - before) / count * 1e6)

    with tempfile.TemporaryDirectory() as scratch:
        for _ in range(rounds):
            broker_us(lambda: raw_paho(broker, payload, count, protocol), raw, raw_broker)
            broker_us(lambda: agent_link(broker, payload, count, Path(scratch), protocol),
                      agent, agent_broker)
    r, a = statistics.median(raw), statistics.median(agent)
    print(f"link, MQTT {protocol}: agent (outbox on) {a:.0f} msg/s, raw paho {r:.0f} msg/s, "
          f"ratio {a / r:.2f} (>= 0.8); the broker's CPU per message "
          f"{statistics.median(agent_broker):.0f} us (agent), "
          f"{statistics.median(raw_broker):.0f} us (raw); {rounds} rounds of {count} QoS 1 "
          f"messages of {len(payload)} bytes")


def write_lag(samples: int) -> None:
    payload = b'{"schema":"telemetry/1","metrics":' + b"1" * 1000 + b"}"
    lags = []
    with tempfile.TemporaryDirectory() as scratch:
        outbox = Outbox(Path(scratch) / "o.sqlite", 1 << 30, 3600)
        stored = threading.Event()
        outbox.listen(stored.set)  # called after the writer's round has committed
        for _ in range(samples):
            stored.clear()
            start = time.perf_counter()
            outbox.put("bench/agent/telemetry", payload)
            if not stored.wait(5):
                raise RuntimeError("the outbox writer did not store a record within 5 s")
            lags.append((time.perf_counter() - start) * 1000)
            time.sleep(0.01)
        outbox.close()
    lags.sort()
    print(f"outbox: a record is on disk {statistics.median(lags):.2f} ms after put (p99 "
          f"{lags[int(len(lags) * 0.99)]:.2f} ms, max {lags[-1]:.2f} ms; {samples} puts)")


def idle_cpu(broker: Broker, seconds: float) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        config = Path(scratch) / "agent.yaml"
        config.write_text(yaml.safe_dump({
            "node_id": "bench-idle", "state_dir": f"{scratch}/state",
            "mqtt": {"host": broker.host, "port": broker.port},
            "telemetry": {"interval_s": 1.0}, "inference": {"enabled": False}}))
        agent = subprocess.Popen([sys.executable, "-m", "agent", "run", "--config",
                                  str(config)], stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
        process = psutil.Process(agent.pid)
        time.sleep(5)  # start-up (imports, discovery) is not idle time
        before = process.cpu_times()
        time.sleep(seconds)
        after = process.cpu_times()
        agent.terminate()
        agent.wait(30)
    used = (after.user + after.system) - (before.user + before.system)
    print(f"idle: edge-agent run at 1 Hz, inference off, {used / seconds * 100:.2f} % of one "
          f"core over {seconds:.0f} s (<= 1 %)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--messages", type=int, default=3000)
    parser.add_argument("--idle-seconds", type=float, default=60.0)
    args = parser.parse_args()
    sample_cost(args.rounds)
    write_lag(300)
    with tempfile.TemporaryDirectory() as scratch:
        broker = Broker(Path(scratch) / "broker")
        broker.start()
        try:
            for protocol in PROTOCOLS:
                link_rate(broker, args.rounds, args.messages, protocol)
            idle_cpu(broker, args.idle_seconds)
        finally:
            broker.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
