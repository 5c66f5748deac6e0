"""Issue 30's findings against a real ``edge-agent run``: each flood of tests/hostile_serve.py
beside a legit client (tritonclient, gRPC and HTTP in turn, checked against a local ONNX
Runtime session), then what the data plane must have held to:

- every legit call (but the warming ones) answered correctly within 1 s;
- the data plane's resident memory grew by less than RSS_GROWTH_MB during the flood;
- the data plane's pid is the one before (nobody killed or restarted it);
- no hostile request was answered 500 (or gRPC INTERNAL/UNKNOWN);
- no traceback in the agent's output (the data plane's included) while it ran.

The floods are scaled down from the issue's figures to run in seconds on two cores, each
still past what the server bounded before issue 30 (each test failed then).  The agent runs
under the systemd unit's default soft descriptor limit (1024), as on a device, with a memory
budget (serve.max_inflight_mb) that the growth bound is set by.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hostile_serve as hostile
import pytest
import yaml
from agent_process import agent_config, serving_addresses, sigint_at_default, with_nofile
from mqtt_helpers import Broker, wait_until

INFLIGHT_MB = 160  # serve.max_inflight_mb of the agent under attack: two 60 MB bodies at once
# what one flood may add to the data plane while it runs: the budget, and what the runtime
# and the allocator hold beside it
RSS_GROWTH_MB = 256
UNIT_NOFILE = 1024  # systemd's default soft RLIMIT_NOFILE for a service
TOKEN = "test-token"  # agent_process.agent_config's


def unit_limits(*argv: str) -> list[str]:
    """``argv`` with what the unit gives the agent (and its data plane) by default."""
    return with_nofile(UNIT_NOFILE, *sigint_at_default(*argv))


@dataclass
class Agent:
    """The running agent, every line of its output, and where its data plane serves."""

    process: subprocess.Popen[str]
    state_dir: Path
    output: list[str] = field(default_factory=list)

    def read_output(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.output.append(line)

    def data_plane(self) -> dict[str, Any]:
        return serving_addresses(self.state_dir)

    def serving(self) -> dict[str, Any]:
        """The data plane's addresses once it answers a demo call (a flood before may have
        had it killed: it is given the time its restart takes)."""
        def answers() -> bool:
            found = self.data_plane()
            return bool(found.get("http")) and hostile.get(
                found["http"], "/v2/models/demo/ready", 2.0)[0] == "200" and hostile.get(
                found["http"], f"/v2/models/{hostile.QUEUED}/ready", 2.0)[0] == "200"

        assert wait_until(lambda: answers() or self.process.poll() is not None, 120, 0.2)
        assert answers(), "".join(self.output[-40:])
        return self.data_plane()


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    base = tmp_path_factory.mktemp("hostile-serve")
    broker = Broker(base / "broker")
    broker.start()
    config = agent_config(base, broker.port)
    config["serve"]["repository"] = str(hostile.repository(base / "repository"))
    config["serve"]["max_inflight_mb"] = INFLIGHT_MB
    path = base / "agent.yaml"
    path.write_text(yaml.safe_dump(config))
    process = subprocess.Popen(unit_limits(sys.executable, "-m", "agent", "run", "--config",
                                           str(path)),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    running = Agent(process, base / "state")
    reader = threading.Thread(target=running.read_output, daemon=True)
    reader.start()
    try:
        running.serving()
        yield running
    finally:
        process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(30)
        process.kill()
        reader.join(10)
        broker.stop()


@dataclass
class Held:
    """What one flood left: its answers, the legit client's calls, the data plane's peak."""

    flood: hostile.Flood
    legit: hostile.LegitClient
    growth_mb: float
    pid_before: int
    pid_after: int | None
    output: str


def beside_legit(agent: Agent, attack: Callable[[dict[str, Any]], hostile.Flood]) -> Held:
    """``attack`` run against the data plane while the legit client calls it; the client
    warms first, and keeps calling for a second after the flood ends."""
    addresses = agent.serving()
    pid = int(addresses["pid"])
    seen = len(agent.output)
    with hostile.LegitClient(addresses["grpc"], addresses["http"]) as legit:
        assert wait_until(lambda: len(legit.calls) >= legit.WARM, 30)
        with hostile.PeakRss(pid) as peak:
            flood = attack(addresses)
            end = len(legit.calls)
            wait_until(lambda: len(legit.calls) >= end + 5, 10, 0.05)
    # a data plane killed during the flood may not have been replaced yet: gone is None
    after = agent.data_plane().get("pid") if Path(f"/proc/{pid}").exists() else None
    return Held(flood, legit, peak.growth_mb, pid, after, "".join(agent.output[seen:]))


def assert_held(held: Held) -> None:
    slow = held.legit.failures(within_s=1.0)
    assert not slow, f"legit calls failed or took over 1 s: {slow[:5]} ({held.flood})"
    assert held.pid_after == held.pid_before, f"the data plane was restarted:\n{held.output}"
    assert held.flood.server_errors == 0, held.flood
    assert held.growth_mb < RSS_GROWTH_MB, \
        f"the data plane grew by {held.growth_mb:.0f} MB ({held.flood})"
    assert "Traceback" not in held.output, held.output[-3000:]


# -- finding 1 ----------------------------------------------------------------------------

def test_gzip_bombs_cost_one_refusal_each(agent: Agent) -> None:
    held = beside_legit(agent, lambda a: hostile.gzip_bombs(a["http"], count=3,
                                                            inflated_mb=1024))
    assert_held(held)
    # refused before a byte of the body is read, and the connection closed without reading
    # it: a client still sending its body may see the reset before the 415
    assert set(held.flood.answers) <= {"415", "reset"}, held.flood


# -- finding 2 ----------------------------------------------------------------------------

def test_a_slow_valid_request_is_its_own_problem(agent: Agent) -> None:
    held = beside_legit(agent, lambda a: hostile.slow_request(a["http"], side=2000))
    assert_held(held)
    # refused before decoding (an element cap) or cancelled past its deadline
    assert set(held.flood.answers) <= {"200", "400", "413", "504"}, held.flood


# -- finding 4 ----------------------------------------------------------------------------

AMPLIFICATION: dict[str, Callable[[dict[str, Any]], hostile.Flood]] = {
    "json_empty_objects": lambda a: hostile.json_empty_objects(a["http"], mb=20),
    "json_huge_data": lambda a: hostile.json_huge_data(a["http"], mb=40),
    "grpc_empty_inputs": lambda a: hostile.grpc_empty_inputs(a["grpc"], mb=6),
    "grpc_unknown_fields": lambda a: hostile.grpc_unknown_fields(a["grpc"], mb=12),
    "parallel_binary": lambda a: hostile.parallel_binary(a["http"], count=8, mb=60),
}


@pytest.mark.parametrize("kind", [
    "json_empty_objects",
    "json_huge_data",
    "grpc_empty_inputs",
    "grpc_unknown_fields",
    "parallel_binary",
])
def test_amplification_stays_within_the_budget(agent: Agent, kind: str) -> None:
    held = beside_legit(agent, AMPLIFICATION[kind])
    assert_held(held)
    assert "200" not in held.flood.answers, held.flood  # none of them is a valid request


# -- finding 5 ----------------------------------------------------------------------------

def test_idle_connections_leave_room_for_new_clients(agent: Agent) -> None:
    refused: list[str] = []

    def attack(addresses: dict[str, Any]) -> hostile.Flood:
        flood, shut_out = hostile.fresh_clients_get_in(
            addresses, lambda opened: hostile.idle_connections(
                addresses["http"], count=1100, hold_s=5.0, opened=opened))
        refused.extend(shut_out)
        return flood

    held = beside_legit(agent, attack)
    assert not refused, f"new {', '.join(refused)} clients could not get in ({held.flood})"
    assert_held(held)


def test_slowloris_is_closed_in_seconds(agent: Agent) -> None:
    refused: list[str] = []

    def attack(addresses: dict[str, Any]) -> hostile.Flood:
        flood, shut_out = hostile.fresh_clients_get_in(
            addresses, lambda opened: hostile.slowloris(
                addresses["http"], count=1010, seconds=8.0, opened=opened))
        refused.extend(shut_out)
        return flood

    held = beside_legit(agent, attack)
    assert not refused, f"new {', '.join(refused)} clients could not get in ({held.flood})"
    assert_held(held)
    # a header timeout of a few seconds closes every one before the eight seconds are out
    assert held.flood.notes["closed_by_server"] == held.flood.notes["opened"], held.flood


# -- finding 6 ----------------------------------------------------------------------------

def test_the_highest_priority_is_not_starved(agent: Agent) -> None:
    held = beside_legit(agent, lambda a: hostile.priority_starvation(
        a["http"], low_clients=40, high_requests=12, token=TOKEN))
    assert held.flood.notes["low"].get("503"), held.flood  # the queue was full
    assert held.flood.answers == {"200": 12}, held.flood
    assert_held(held)


def test_any_local_process_cannot_jump_the_queue(agent: Agent) -> None:
    """Level 1 is serve.privileged_priority's by default: without the token it is refused."""
    held = beside_legit(agent, lambda a: hostile.priority_starvation(
        a["http"], low_clients=40, high_requests=3))
    assert held.flood.answers == {"403": 3}, held.flood
    assert_held(held)


# -- finding 8 ----------------------------------------------------------------------------

# what each must be answered, and the word the message must name
REFUSALS: dict[str, tuple[set[str], str]] = {
    "version_5000_digits": ({"400", "404"}, "version"),
    "version_01": ({"400", "404"}, "version"),
    "shape_2e62_binary": ({"400"}, "shape"),
    "shape_2e62_grpc_raw": ({"INVALID_ARGUMENT"}, ""),
    "timeout_9e15": ({"400"}, "timeout"),
    "json_1e999": ({"400"}, "image"),
    "name_trailing_newline": ({"400", "404"}, "demo"),
    "unauthorized_load": ({"401"}, "token"),
}


@pytest.mark.parametrize("case", [
    "version_5000_digits",
    "version_01",
    "shape_2e62_binary",
    "shape_2e62_grpc_raw",
    "timeout_9e15",
    "json_1e999",
    "name_trailing_newline",  # refused today: no model has that name
    "unauthorized_load",
])
def test_odd_inputs_are_refused_by_name(agent: Agent, case: str) -> None:
    answers: list[hostile.Answer] = []

    def attack(addresses: dict[str, Any]) -> hostile.Flood:
        flood = hostile.Flood(case)
        answers.append(hostile.odd_input(case, addresses["http"], addresses["grpc"],
                                         TOKEN))
        flood.count(answers[0].status)
        return flood

    held = beside_legit(agent, attack)
    allowed, word = REFUSALS[case]
    assert answers[0].status in allowed, answers[0]
    assert word.lower() in answers[0].message.lower(), answers[0]
    assert "/" not in answers[0].message or case != "unauthorized_load", answers[0]
    assert_held(held)


# -- the unit's limits --------------------------------------------------------------------

def test_serve_under_the_units_limits(tmp_path: Path) -> None:
    """``edge-agent serve`` as the unit starts it: soft RLIMIT_NOFILE 1024, working directory
    ``/``.  It serves, and 1,100 idle connections leave room for new clients."""
    config = agent_config(tmp_path, 1)
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(config))
    ready = tmp_path / "state" / "serve" / "ready.json"
    ready.parent.mkdir(parents=True)
    root = str(Path(__file__).resolve().parents[1])
    process = subprocess.Popen(unit_limits(sys.executable, "-m", "agent", "serve", "--config",
                                           str(path), "--ready-file", str(ready)),
                               cwd="/", stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                   filter(None, (root, os.environ.get("PYTHONPATH"))))})
    try:
        assert wait_until(lambda: serving_addresses(tmp_path / "state").get("http"), 120)
        addresses = serving_addresses(tmp_path / "state")
        assert wait_until(lambda: hostile.get(addresses["http"], "/v2/health/ready",
                                              2.0)[0] == "200", 60)
        assert addresses["pid"] == process.pid
        with hostile.LegitClient(addresses["grpc"], addresses["http"]) as legit:
            assert wait_until(lambda: len(legit.calls) >= legit.WARM, 30)
            flood, refused = hostile.fresh_clients_get_in(
                addresses, lambda opened: hostile.idle_connections(
                    addresses["http"], count=1100, hold_s=5.0, opened=opened))
        assert not refused, f"new {', '.join(refused)} clients could not get in ({flood})"
        assert not legit.failures(within_s=1.0), legit.calls
        assert process.poll() is None
    finally:
        process.terminate()
        output, _ = process.communicate(timeout=30)
    assert "Traceback" not in output, output[-3000:]
