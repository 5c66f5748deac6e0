"""The data plane's sockets against any local process: its descriptor limit, a full
descriptor table, the metrics endpoint's connections, the supervisor's health check, an
address already taken, and ``selftest`` beside a running data plane.

Real ``edge-agent serve`` and ``run`` processes on free loopback ports, real sockets, a real
Mosquitto."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import yaml

from agent.config import from_dict
from agent.service.dataplane import Supervisor
from agent.serving.access import Access
from agent.serving.errors import ServeError
from agent.serving.http_client import HttpClient
from tests.agent_process import agent_config, start_agent, status, with_nofile
from tests.cli_helpers import edge_agent
from tests.http_helpers import HttpServer, token_file
from tests.mqtt_helpers import Broker, Subscriber, free_port, wait_until
from tests.serving_helpers import DemoModels
from tests.test_serve_metrics import scrape, value
from tests.test_serve_process import serve_process


def descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def accepted(pid: int, port: int) -> int:
    """The connections ``pid`` has accepted on its listening ``port``, still open."""
    import psutil

    return sum(1 for connection in psutil.Process(pid).net_connections(kind="tcp")
               if connection.laddr and connection.laddr.port == port
               and connection.status == psutil.CONN_ESTABLISHED)


def threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def soft_nofile(pid: int) -> int:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    raise AssertionError("no Max open files line")


@contextlib.contextmanager
def connections(address: str, count: int, send: bytes = b"") -> Iterator[list[socket.socket]]:
    """``count`` connections to ``address`` (each sends ``send``), closed on exit."""
    host, _, port = address.rpartition(":")
    made: list[socket.socket] = []
    try:
        for _ in range(count):
            made.append(socket.create_connection((host, int(port)), timeout=10))
            if send:
                made[-1].sendall(send)
        yield made
    finally:
        for sock in made:
            sock.close()


# -- descriptors -------------------------------------------------------------------------------


def test_serve_raises_its_soft_descriptor_limit_to_the_hard_one(tmp_path: Path) -> None:
    hard = min(4096, resource.getrlimit(resource.RLIMIT_NOFILE)[1])

    log = tmp_path / "serve.log"  # a soft limit as systemd's default unit's, 1024, or lower
    with log.open("w") as stderr, serve_process(
            tmp_path, popen={"stderr": stderr}, wrapper=with_nofile(256, hard=hard)) as plane:
        assert soft_nofile(plane["process"].pid) == hard
    assert f"descriptors: soft limit {hard} (was 256), hard limit {hard}" in log.read_text()


def test_a_full_descriptor_table_is_one_log_line_a_listener_and_counted(
        tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    with log.open("w") as stderr, serve_process(tmp_path, popen={"stderr": stderr}) as plane:
        pid = plane["process"].pid
        limit = descriptors(pid) + 16  # room for 16 connections, then the table is full
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (limit, limit))
        with connections(plane["http"], 60):
            # asyncio tries the listener again every second: each try fails while the
            # connections stay; over 4 s, several failed accepts and still one line
            assert wait_until(lambda: "not accepted" in log.read_text(), 30), log.read_text()
            time.sleep(4)
            text = log.read_text()
        lines = [line for line in text.splitlines() if "not accepted" in line]
        listener = f"serve.http {plane['http']}"
        assert len(lines) == 1 and lines[0].startswith(
            f"ERROR agent.serving.connections: {listener}: 1 connection(s) not accepted"), lines
        assert "Too many open files" in lines[0] and f"descriptor limit {limit}" in lines[0]
        assert "Traceback" not in text and "socket.accept() out of system resource" not in text
        # the connections gone, the endpoint answers and counts what was refused
        assert wait_until(lambda: descriptors(pid) < limit - 8, 30)
        counted = value(scrape(plane["metrics"]), "edge_agent_serve_accept_errors_total",
                        listener=listener)
        assert counted >= 2


def test_the_metrics_endpoint_holds_no_thread_per_connection(tmp_path: Path) -> None:
    with serve_process(tmp_path) as plane:
        pid = plane["process"].pid
        scrape(plane["metrics"])  # whatever starts on a first scrape has started
        before_threads = threads(pid)
        port = int(plane["metrics"].rpartition(":")[2])
        # 50 scrapers that never finish their request, each held open by the server (counted
        # as its accepted connections: its descriptor count also moves with the models'
        # files as they load)
        with connections(plane["metrics"], 50, b"GET /metrics HTTP/1.1\r\n"):
            assert wait_until(lambda: accepted(pid, port) >= 50, 30), accepted(pid, port)
            assert threads(pid) <= before_threads + 2
            assert "edge_agent_model_ready" in str(scrape(plane["metrics"]))


# -- the supervisor's health check ---------------------------------------------------------------


def test_the_supervisor_is_not_ready_when_a_new_client_cannot_get_in(tmp_path: Path) -> None:
    """A kept-alive connection still answers after the listener is gone (as with a full
    descriptor table): the health check opens a fresh one each round, so it says so."""
    models = DemoModels()
    server = HttpServer(models, Access((token_file(tmp_path),), everything=False))
    config = from_dict(agent_config(tmp_path, 1883))
    supervisor = Supervisor(config, tmp_path / "state", lambda *a, **k: None)
    client = HttpClient(f"http://{server.url}", timeout_s=2)
    try:
        assert supervisor._poll(client) and supervisor.ready
        async def stop_listening() -> None:  # the listener closes, connections stay
            assert server.listener._server is not None
            server.listener._server.close()

        server._call(stop_listening())
        assert client.live()  # an old connection still gets in
        assert not supervisor._poll(client)
        assert supervisor.reason is not None and "does not answer" in supervisor.reason
    finally:
        client.close()
        server.stop()
        models.stop()


# -- an address already taken ------------------------------------------------------------------


@contextlib.contextmanager
def taken_port() -> Iterator[str]:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield f"127.0.0.1:{holder.getsockname()[1]}"


@pytest.mark.parametrize("key", ["http", "grpc", "metrics"])
def test_serve_says_which_address_is_in_use_in_one_line(tmp_path: Path, key: str) -> None:
    config = agent_config(tmp_path, 1883)
    with taken_port() as address:
        config["serve"][key] = address
        path = tmp_path / "serve.yaml"
        path.write_text(yaml.safe_dump(config))
        result = subprocess.run([sys.executable, "-m", "agent", "serve", "--config",
                                 str(path)], capture_output=True, text=True, timeout=120,
                                check=False)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    said = [line for line in result.stderr.splitlines() if address in line]
    assert said == [f"edge-agent serve: serve.{key} {address}: address already in use"]


@pytest.mark.parametrize("key", ["http", "grpc", "metrics"])
def test_run_names_the_address_in_use_in_its_degraded_reason(tmp_path: Path, broker: Broker,
                                                             key: str) -> None:
    watcher = Subscriber(broker, ["edge/v1/lab/orin-1/state"])
    with taken_port() as address:
        config = agent_config(tmp_path, broker.port)
        config["serve"][key] = address
        path = tmp_path / "agent.yaml"
        path.write_text(yaml.safe_dump(config))
        agent = start_agent(path)
        try:
            expected = f"data plane: serve.{key} {address}: address already in use"
            # at every restart: the first exit, and again after the backoff
            assert wait_until(lambda: _restarts(path) >= 2, 60), status(path)
            problems = status(path)[1].get("problems") or []
            assert any(p.startswith(expected) for p in problems), problems
            assert wait_until(lambda: any(s.get("reason", "").startswith(expected)
                                          for s in watcher.on("state")), 30)
        finally:
            agent.terminate()
            output, _ = agent.communicate(timeout=60)
            watcher.close()
    assert "Traceback" not in output, output


def _restarts(config: Path) -> int:
    inference = (status(config)[1].get("last_sample") or {}).get("metrics", {}).get(
        "inference") or {}
    return int((inference.get("data_plane") or {}).get("restarts") or 0)


# -- selftest beside a running data plane ---------------------------------------------------------


def test_selftest_beside_a_running_data_plane_passes_and_leaves_nothing_retained(
        tmp_path: Path, broker: Broker) -> None:
    """The running data plane holds the config's fixed ports (as 8000/8001/8002 by
    default); the probe takes free ones of its own and retains nothing on the broker."""
    fixed = {"http": f"127.0.0.1:{free_port()}", "grpc": f"127.0.0.1:{free_port()}",
             "metrics": f"127.0.0.1:{free_port()}"}
    live = Subscriber(broker, ["edge/v1/lab/orin-1-selftest/#"], client_id="live")
    with serve_process(tmp_path, **fixed) as plane:
        assert {k: plane[k] for k in fixed} == fixed
        config = agent_config(tmp_path, broker.port)
        config["serve"].update(fixed)
        path = tmp_path / "selftest.yaml"
        path.write_text(yaml.safe_dump(config))
        result = edge_agent("selftest", "--config", path, "--seconds", "90", "--json")
    report = json.loads(result.stdout)
    checks = {check["name"]: check for check in report["checks"]}
    assert checks["inference"]["status"] == "pass", report
    assert checks["mqtt"]["status"] == "pass", report
    assert any(topic.endswith("/state") for topic, _, _ in live.messages)  # it was there
    live.close()
    assert _retained(broker, "edge/v1/lab/orin-1-selftest") == []


def _retained(broker: Broker, root: str) -> list[str]:
    """The topics under ``root`` the broker retains: a marker retained last comes with
    them on subscribing, so once it arrived every other one has too."""
    import paho.mqtt.publish as publish

    marker = f"{root}/zz-test-marker"
    publish.single(marker, b"{}", qos=1, retain=True, hostname=broker.host, port=broker.port)
    reader = Subscriber(broker, [f"{root}/#"], client_id="retained-reader")
    try:
        assert wait_until(lambda: any(t == marker for t, _, _ in reader.messages), 10)
        return [topic for topic, _, retained in reader.messages
                if retained and topic != marker]
    finally:
        reader.close()
        publish.single(marker, b"", qos=1, retain=True, hostname=broker.host,
                       port=broker.port)



def test_failed_accepts_between_two_lines_are_summed_in_the_second(
        caplog: pytest.LogCaptureFixture) -> None:
    """Five failures within one interval: the first logged at once, the other four in one
    line when the interval ends; a context of another kind keeps asyncio's own handling."""
    import asyncio
    import errno

    from agent.serving.connections import AcceptErrors

    errors = AcceptErrors(interval_s=0.2)
    loop = asyncio.new_event_loop()
    errors.install(loop)
    full = OSError(errno.EMFILE, os.strerror(errno.EMFILE))
    with socket.socket() as listener, caplog.at_level("INFO"):
        listener.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        errors.listeners[address] = "serve.http"
        context = {"message": "socket.accept() out of system resource", "exception": full,
                   "socket": listener}
        for _ in range(5):
            loop.call_exception_handler(context)
        loop.call_exception_handler({"message": "something else went wrong"})
        loop.run_until_complete(asyncio.sleep(0.5))
    loop.close()
    ours = [r.getMessage() for r in caplog.records if r.name == "agent.serving.connections"]
    assert [line.split(" in the last")[0] for line in ours] == [
        f"serve.http {address}: 1 connection(s) not accepted",
        f"serve.http {address}: 4 connection(s) not accepted"]
    assert errors.totals == {f"serve.http {address}": 5}
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == [
        "something else went wrong"]


def test_the_memory_budget_is_on_the_metrics_endpoint(tmp_path: Path) -> None:
    """serve.max_inflight_mb as configured, a request held and given back, one refused."""
    with serve_process(tmp_path, max_request_mb=1, max_inflight_mb=1) as plane:
        assert value(scrape(plane["metrics"]), "edge_agent_serve_inflight_limit_bytes") == (
            1 << 20)
        client = HttpClient(f"http://{plane['http']}", timeout_s=10)
        try:
            client.infer("demo", {"image": np.zeros((1, 3, 64, 64), np.float32)})
            # 24,576 JSON values: what they parse into does not fit 1 MB
            pair = np.zeros((2, 3, 64, 64), np.float32)
            with pytest.raises(ServeError) as refused:
                client.infer("demo", {"image": pair}, binary=False)
            assert "memory budget" in refused.value.message
        finally:
            client.close()
        metrics = scrape(plane["metrics"])
        assert value(metrics, "edge_agent_serve_inflight_refused_total") == 1
        assert value(metrics, "edge_agent_serve_inflight_in_use_bytes") == 0
        assert value(metrics, "edge_agent_serve_inflight_peak_bytes") >= 64 * 64 * 3 * 4
