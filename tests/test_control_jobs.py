"""Long commands as jobs beside the controller's worker (agent/control/running.py): their
progress and final replies, a slot held one job at a time, failures that end only their own
command, and a stop that cancels them and never waits without bound."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from control_helpers import FLEET, sign, trusted_keys
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent import protocol
from agent.control.controller import Controller, Identity, Incoming
from agent.control.running import CommandFailed, Job, Progress
from agent.control.store import CommandStore

# Commands whose args are {} stand for the tests' long ones (a command needs a schema).
LONG, OTHER = "selftest", "rebirth"


class Replies:
    """Every reply the controller publishes; waits are woken by each one."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.arrived = threading.Condition()

    def __call__(self, topic: str, body: dict[str, Any], response: str | None,
                 correlation: bytes | None, droppable: bool = False) -> None:
        with self.arrived:
            self.bodies.append(body)
            self.arrived.notify_all()

    def of(self, command_id: str) -> list[dict[str, Any]]:
        with self.arrived:
            return [b for b in self.bodies if b["id"] == command_id]

    def wait(self, predicate: Callable[[], bool], seconds: float = 10) -> None:
        with self.arrived:
            assert self.arrived.wait_for(predicate, seconds), self.bodies[-5:]

    def final(self, command_id: str) -> dict[str, Any]:
        def found() -> list[dict[str, Any]]:
            return [b for b in self.bodies if b["id"] == command_id
                    and b["status"] in protocol.FINAL]

        self.wait(lambda: bool(found()))
        with self.arrived:
            return found()[0]

    def steps(self, command_id: str) -> list[str]:
        return [b["step"] for b in self.of(command_id) if b["status"] == protocol.IN_PROGRESS]


class Node:
    """A controller with ping and the jobs a test gives, fed signed envelopes directly."""

    def __init__(self, tmp_path: Path, key: Ed25519PrivateKey,
                 handlers: dict[str, Callable[[dict[str, Any], Progress], Any]]) -> None:
        self.key = key
        self.replies = Replies()
        self.store = CommandStore(tmp_path / "commands.sqlite")
        self.controller = Controller(
            Identity(FLEET, "orin-1"), trusted_keys(key), {"ping", *handlers}, self.store,
            {"ping": lambda args, progress: {"pong": True}, **handlers}, self.replies)

    def send(self, command: str) -> str:
        envelope = sign(self.key, command, "node:orin-1", {})
        self.controller.on_message(Incoming(f"edge/v1/{FLEET}/orin-1/cmd/{command}",
                                            json.dumps(envelope).encode()))
        return str(envelope["id"])


@pytest.fixture()
def gates() -> Iterator[dict[str, threading.Event]]:
    """Events the tests' jobs wait on; all set at the end, so no job thread is left waiting."""
    events: dict[str, threading.Event] = {}
    yield events
    for event in events.values():
        event.set()


def gate(events: dict[str, threading.Event], name: str) -> threading.Event:
    return events.setdefault(name, threading.Event())


def test_a_job_runs_beside_the_worker_reports_in_order_and_holds_its_slot(
        tmp_path: Path, key: Ed25519PrivateKey, gates: dict[str, threading.Event]) -> None:
    started, release = gate(gates, "started"), gate(gates, "release")

    def long(args: dict[str, Any], progress: Progress) -> Job:
        def run(step: Progress, cancel: threading.Event) -> dict[str, Any]:
            step("one")
            started.set()
            release.wait()
            step("two")
            return {"built": True}

        progress("checked")  # on the worker, before the job
        return Job("build", run)

    node = Node(tmp_path, key, {LONG: long})
    node.controller.start()
    try:
        first = node.send(LONG)
        assert started.wait(10)
        held = node.controller.long_jobs.running()
        assert set(held) == {"build"} and held["build"]["running_s"] >= 0
        assert {k: v for k, v in held["build"].items() if k != "running_s"} == {
            "id": first, "command": LONG, "step": "one"}
        assert node.controller.metrics()["jobs_running"] == 1
        ping = node.send("ping")
        assert node.replies.final(ping)["status"] == "succeeded"
        second = node.send(LONG)
        busy = node.replies.final(second)
        assert (busy["status"], busy["code"]) == ("failed", "busy")
        assert busy["result"] == {"running": first} and first in busy["message"]
        assert not [b for b in node.replies.of(first) if b["status"] in protocol.FINAL]
        release.set()
        done = node.replies.final(first)
        assert (done["status"], done["code"], done["result"]) == ("succeeded", "ok",
                                                                   {"built": True})
        assert [b["status"] for b in node.replies.of(first)] == [
            "accepted", "in_progress", "in_progress", "in_progress", "succeeded"]
        assert node.replies.steps(first) == ["checked", "one", "two"]
        assert node.store.get(first) == done  # a replay gets the job's outcome
        assert node.controller.long_jobs.running() == {}
        assert node.controller.metrics()["jobs_running"] == 0
        third = node.send(LONG)  # the slot is free once the final reply is out
        release.set()
        assert node.replies.final(third)["status"] == "succeeded"
    finally:
        node.controller.stop()
        node.store.close()


def test_a_job_that_raises_fails_its_command_alone(tmp_path: Path,
                                                   key: Ed25519PrivateKey) -> None:
    outcomes: list[Callable[[], dict[str, Any]]] = []

    def long(args: dict[str, Any], progress: Progress) -> Job:
        return Job("build", lambda step, cancel: outcomes.pop(0)())

    def crash() -> dict[str, Any]:
        raise RuntimeError("the builder fell over")

    def refuse() -> dict[str, Any]:
        raise CommandFailed("gate_failed", "cosine 0.9 below 0.999", {"report": {"x": 1}})

    outcomes += [crash, refuse, lambda: {"built": True}]
    node = Node(tmp_path, key, {LONG: long})
    node.controller.start()
    try:
        crashed = node.replies.final(node.send(LONG))
        assert (crashed["status"], crashed["code"]) == ("failed", "error")
        assert crashed["message"] == "the builder fell over"
        refused = node.replies.final(node.send(LONG))
        assert (refused["code"], refused["result"]) == ("gate_failed", {"report": {"x": 1}})
        assert node.replies.final(node.send("ping"))["status"] == "succeeded"
        assert node.replies.final(node.send(LONG))["status"] == "succeeded"
    finally:
        node.controller.stop()
        node.store.close()


def test_a_stop_cancels_jobs_and_gives_up_on_one_that_does_not_end_in_time(
        tmp_path: Path, key: Ed25519PrivateKey, gates: dict[str, threading.Event]) -> None:
    running = {"polite": gate(gates, "polite"), "stubborn": gate(gates, "stubborn")}
    never = gate(gates, "never")  # set only by the fixture, after the test
    late: list[str] = []
    ended = gate(gates, "ended")

    def polite(args: dict[str, Any], progress: Progress) -> Job:
        def run(step: Progress, cancel: threading.Event) -> dict[str, Any]:
            running["polite"].set()
            cancel.wait()  # a subprocess would be killed here
            step("after the cancel")  # raises: the agent is stopping
            late.append("polite")
            return {}

        return Job("a", run)

    def stubborn(args: dict[str, Any], progress: Progress) -> Job:
        def run(step: Progress, cancel: threading.Event) -> dict[str, Any]:
            running["stubborn"].set()
            never.wait()
            late.append("stubborn")
            ended.set()
            return {"too": "late"}

        return Job("b", run)

    node = Node(tmp_path, key, {LONG: polite, OTHER: stubborn})
    node.controller.long_jobs.grace_s = 0.5
    node.controller.start()
    try:
        first, second = node.send(LONG), node.send(OTHER)
        assert running["polite"].wait(10) and running["stubborn"].wait(10)
        began = time.monotonic()
        node.controller.stop()
        assert time.monotonic() - began < 5  # bounded: the stubborn job is left behind
        for command_id, message in ((first, "the job was cancelled"),
                                    (second, "did not end within 0.5 s")):
            final = node.replies.final(command_id)
            assert (final["status"], final["code"]) == ("failed", "cancelled")
            assert message in final["message"]
            assert node.store.get(command_id) == final
        never.set()  # the stubborn job ends after all: what it says is dropped
        assert ended.wait(10)
        for thread in [t for t in threading.enumerate() if t.name == "job-b"]:
            thread.join(10)  # its end has run: answered or dropped
        assert late == ["stubborn"]
        assert len([b for b in node.replies.of(second) if b["status"] in protocol.FINAL]) == 1
    finally:
        never.set()
        node.store.close()
