"""Two agents with one client id (agent.link.takeover): the diagnosis in one log line and a
``degraded`` reason naming the node id, and backoff instead of a fight — the weighing with a
fake clock, then two real links against a real Mosquitto, MQTT 5 and 3.1.1."""

from __future__ import annotations

import logging
import re
import signal
import time
from pathlib import Path

import pytest
from agent_process import start_agent, status, write_config
from mqtt_helpers import Broker, Subscriber, wait_until
from test_link_mqtt import Agent

from agent.link import takeover
from agent.link.settings import LinkStatus
from agent.link.takeover import Takeover


def code(value: int, name: str) -> object:
    """A disconnect reason as paho's ReasonCode shows it: a value and its name."""
    return type("Code", (), {"value": value, "__str__": lambda self: name})()


TAKEN = code(0x8E, "Session taken over")
CLOSED = code(0x80, "Unspecified error")  # paho's word for a connection the broker closed
KEEPALIVE = code(0x8D, "Keep alive timeout")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def connection(diagnosis: Takeover, clock: Clock, held_s: float, reason: object) -> None:
    """One accepted connection (a new session) that ends after ``held_s`` with ``reason``;
    paho and the link report the end twice."""
    status = diagnosis.status
    status.session, status.state, status.since = status.session + 1, "connected", clock.now
    clock.now += held_s
    diagnosis.ended(reason)
    diagnosis.ended("socket closed")
    status.state = "disconnected"


def fresh() -> tuple[Takeover, Clock]:
    clock = Clock()
    return Takeover("node-7", LinkStatus(broker="b:1883"), clock), clock


def test_three_takeovers_are_one_diagnosis_naming_the_node(
        caplog: pytest.LogCaptureFixture) -> None:
    diagnosis, clock = fresh()
    for _ in range(2):
        connection(diagnosis, clock, 30.0, TAKEN)  # 0x8E counts however long it held
    assert diagnosis.problems() == [] and diagnosis.delay(0.5) == 0.5
    connection(diagnosis, clock, 30.0, TAKEN)
    (problem,) = diagnosis.problems()
    assert problem == ("mqtt: another client uses this node's id 'node-7' on b:1883: the "
                       "broker said another client took the session (0x8E), 3 times within "
                       "120 s; likely a cloned image: give each device its own node_id in "
                       "agent.yaml")
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == [f"{problem}; reconnecting after growing delays (up to 300 s) instead of "
                      "taking the session back at once"]
    # the link logs each lost connection (with the member it was on): not this too
    assert not [r for r in caplog.records if "lost" in r.getMessage()]
    connection(diagnosis, clock, 1.0, TAKEN)
    assert len([r for r in caplog.records if r.levelno == logging.ERROR]) == 1


def test_connections_the_broker_closes_soon_are_the_evidence_without_0x8e() -> None:
    diagnosis, clock = fresh()
    connection(diagnosis, clock, takeover.SHORT_S, CLOSED)  # held long enough: no evidence
    for _ in range(3):  # not ended by the broker: a network fault, an error of ours
        connection(diagnosis, clock, 1.0, KEEPALIVE)
        connection(diagnosis, clock, 1.0, "paho failed on the connection")
    assert diagnosis.problems() == []
    for _ in range(3):
        connection(diagnosis, clock, 20.0, CLOSED)
        clock.now += 2.0  # the reconnect delay
    (problem,) = diagnosis.problems()
    assert "the broker closed the connection right after accepting it, 3 times" in problem


def test_evidence_spread_beyond_the_window_is_no_diagnosis() -> None:
    diagnosis, clock = fresh()
    for _ in range(5):
        connection(diagnosis, clock, 1.0, CLOSED)
        clock.now += takeover.WINDOW_S / 2
    assert diagnosis.problems() == []


def test_an_end_before_any_accept_is_no_evidence() -> None:
    diagnosis, _clock = fresh()
    for _ in range(5):
        diagnosis.status.state = "connecting"
        diagnosis.ended("refused")
    assert diagnosis.problems() == [] and diagnosis.delay(1.0) == 1.0


def test_the_delay_grows_to_minutes_and_a_held_connection_clears_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("random.uniform", lambda low, high: high)  # the jitter's top
    diagnosis, clock = fresh()
    for _ in range(3):
        connection(diagnosis, clock, 0.5, TAKEN)
    delays = []
    for _ in range(8):
        delays.append(diagnosis.delay(0.5))
        connection(diagnosis, clock, 100.0, KEEPALIVE)  # did not hold: one more, whatever ended it
    assert delays == [10.0, 20.0, 40.0, 80.0, 160.0, 300.0, 300.0, 300.0]
    status = diagnosis.status
    status.session, status.state, status.since = status.session + 1, "connected", clock.now
    clock.now += takeover.HOLD_S - 1
    assert diagnosis.problems() != []
    clock.now += 1
    assert diagnosis.problems() == []  # holding now: no longer degraded
    diagnosis.ended(CLOSED)
    assert diagnosis.diagnosis is None and diagnosis.delay(0.5) == 0.5


# -- two real agents, one client id, one real Mosquitto --------------------------------------

CONNECTED = re.compile(r"New client connected from \S+ as node-1 ")
WATCH_S = 15.0


def connects(broker: Broker) -> int:
    """CONNECTs with the shared id the broker accepted, from its log (log_type notice)."""
    return len(CONNECTED.findall(broker.log()))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
def test_two_agents_with_one_id_diagnose_it_and_do_not_flood_the_broker(
        tmp_path: Path, broker: Broker, protocol: str,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="agent.link")
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    agents = [Agent(tmp_path / name, broker, protocol=protocol) for name in ("a", "b")]
    try:
        for agent in agents:
            agent.start()
        # both knock each other off at once (reconnect_min_s 0.1) until each diagnoses it
        assert wait_until(lambda: all(a.link.problems() for a in agents), 30), \
            [a.link.status.to_dict() for a in agents]
        for agent in agents:
            (problem,) = agent.link.problems()
            assert problem.startswith("mqtt: another client uses this node's id 'node-1' on "
                                      f"{broker.host}:{broker.port}: "), problem
        before, started = connects(broker), time.monotonic()
        deadline = started + WATCH_S
        while time.monotonic() < deadline:  # still diagnosed all along, never flooding
            assert all(a.link.problems() for a in agents)
            time.sleep(0.2)
        during = connects(broker) - before
        # each waits 5-10 s, then 10-20 s, ... between connects: at most 3 each in 15 s
        # (without the diagnosis: every 0.1-0.5 s, some 60 or more). Mosquitto 2.0.11 sends
        # no 0x8E: the broker's closes are the evidence, for MQTT 5 too
        assert during <= 6, (during, broker.log()[-3000:])
        diagnosed = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR
                     and "another client uses this node's id 'node-1'" in r.getMessage()]
        assert len(diagnosed) == 2, diagnosed  # one line per agent, however often kicked
    finally:
        for agent in agents:
            agent.stop()


@pytest.mark.timeout(180)
def test_two_running_agents_with_one_node_id_are_degraded_saying_so(
        tmp_path: Path, broker: Broker) -> None:
    """``edge-agent run`` twice with node_id orin-1: each one's status lists the diagnosis
    as a problem, and the node's retained state says ``degraded`` with it as the reason."""
    watcher = Subscriber(broker, ["edge/v1/lab/orin-1/state"])
    configs = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        configs.append(write_config(tmp_path / name, broker.port,
                                    inference={"enabled": False}))
    processes = [start_agent(config) for config in configs]
    try:
        def diagnosed(config: Path) -> bool:
            problems = status(config)[1].get("problems", [])
            return any("another client uses this node's id 'orin-1'" in p for p in problems)

        assert wait_until(lambda: all(diagnosed(c) for c in configs), 90), \
            [status(c)[1].get("link") for c in configs]
        assert wait_until(lambda: any(
            m["state"] == "degraded" and "another client uses this node's id 'orin-1'"
            in m.get("reason", "") for m in watcher.on("state")), 30), watcher.on("state")
    finally:
        watcher.close()
        for process in processes:
            process.send_signal(signal.SIGTERM)
        outputs = [process.communicate(timeout=60)[0] for process in processes]
    for output in outputs:  # the one line, once, in each agent's log
        assert output.count("another client uses this node's id 'orin-1'") == 1, output
