"""The data plane as a process: ``edge-agent serve`` alone, and supervised by ``run``.

Real processes, real tritonclient over real sockets on free loopback ports, a real broker:
a version loaded under load fails no request; ``kill -9`` of the data plane under load is
an event and a restart, while the control plane stays online and keeps the watchdog fed.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import yaml

from agent.inference.demo_model import DEMO_INPUT, DEMO_MODEL_PATH, DEMO_OUTPUT
from tests.agent_process import agent_config, serving_addresses, start_agent
from tests.mqtt_helpers import Broker, Subscriber, wait_until
from tests.onnx_models import conv_net

TOKEN = "test-token"


def server_ready(address: str, tls: bool = False) -> bool:
    """Whether the server at ``address`` says it is ready (its first load round done); with
    the token, which a server beyond loopback asks for on every call."""
    port = address.rpartition(":")[2]
    scheme, context = ("https", ssl._create_unverified_context()) if tls else ("http", None)
    request = urllib.request.Request(f"{scheme}://127.0.0.1:{port}/v2/health/ready",
                                     headers={"Authorization": f"Bearer {TOKEN}"})
    try:
        with urllib.request.urlopen(request, timeout=5, context=context) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


@contextlib.contextmanager
def serve_process(tmp_path: Path, ready: Path | None = None, args: Sequence[str] = (),
                  loaded: bool = True, popen: Mapping[str, Any] | None = None,
                  wrapper: Sequence[str] = (), **serve: Any) -> Iterator[dict[str, Any]]:
    """``edge-agent serve`` on free ports (more command-line ``args``, the ready file at
    ``ready``, more Popen arguments in ``popen``, run through the command ``wrapper``);
    yields the ready file's addresses, the process, the repository and the config file
    once it listens and (``loaded``) its models loaded."""
    config = agent_config(tmp_path, 1883)
    config["serve"].update(serve)
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    ready = ready or tmp_path / "ready.json"
    process = subprocess.Popen([*wrapper, sys.executable, "-m", "agent", "serve", "--config",
                                str(path), "--ready-file", str(ready), *args], **(popen or {}))
    try:
        assert wait_until(lambda: ready.exists() or process.poll() is not None, 120)
        assert process.poll() is None, "serve exited before it was ready"
        address = json.loads(ready.read_text())["http"]
        tls = bool(serve.get("tls"))
        assert not loaded or wait_until(lambda: server_ready(address, tls), 120)
        yield {**json.loads(ready.read_text()), "process": process,
               "repository": Path(config["state_dir"]) / "repository", "config": path}
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def demo_input(batch: int = 1, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random((batch, 3, 64, 64), dtype=np.float32)


def http_infer(client: httpclient.InferenceServerClient, model: str,
               x: np.ndarray) -> tuple[np.ndarray, str]:
    given = httpclient.InferInput(DEMO_INPUT, list(x.shape), "FP32")
    given.set_data_from_numpy(x)
    result = client.infer(model, [given])
    return result.as_numpy(DEMO_OUTPUT), result.get_response()["model_version"]


def test_serve_alone_answers_both_protocols_and_stops_on_sigterm(tmp_path: Path) -> None:
    import onnxruntime as ort

    expected = ort.InferenceSession(str(DEMO_MODEL_PATH), providers=[
        "CPUExecutionProvider"]).run(None, {DEMO_INPUT: demo_input(2)})[0]
    with serve_process(tmp_path) as plane:
        http = httpclient.InferenceServerClient(plane["http"])
        assert http.is_server_ready() and http.is_model_ready("demo")
        got, version = http_infer(http, "demo", demo_input(2))
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
        assert version == "1"
        grpc = grpcclient.InferenceServerClient(plane["grpc"])
        given = grpcclient.InferInput(DEMO_INPUT, [2, 3, 64, 64], "FP32")
        given.set_data_from_numpy(demo_input(2))
        result = grpc.infer("demo", [given], request_id="r-7")
        np.testing.assert_allclose(result.as_numpy(DEMO_OUTPUT), expected, rtol=1e-5,
                                   atol=1e-6)
        assert result.get_response().id == "r-7"
        names = {m["name"] for m in http.get_model_repository_index()}
        assert names == {"demo"}


def test_infer_url_drives_a_running_server_over_http_and_grpc(tmp_path: Path) -> None:
    with serve_process(tmp_path) as plane:
        for url in (f"http://{plane['http']}", f"grpc://{plane['grpc']}"):
            result = subprocess.run(
                [sys.executable, "-m", "agent", "infer", "--url", url, "--seconds", "1",
                 "--concurrency", "2", "--json"], capture_output=True, text=True,
                timeout=120, check=False)
            assert result.returncode == 0, result.stderr
            report = json.loads(result.stdout)
            assert report["model"] == "demo" and report["versions"] == ["1"]
            assert report["concurrency"] == 2 and report["errors"] == 0
            assert report["count"] > 2 and report["latency_ms"]["p99"] > 0
        for url in (f"http://{plane['http']}", f"grpc://{plane['grpc']}"):
            shared = subprocess.run(
                [sys.executable, "-m", "agent", "infer", "--url", url, "--seconds", "1",
                 "--concurrency", "2", "--shm", "--token-file", str(tmp_path / "serve-token"),
                 "--json"], capture_output=True, text=True, timeout=120, check=False)
            assert shared.returncode == 0, shared.stderr
            report = json.loads(shared.stdout)
            assert report["shared_memory"] and report["errors"] == 0 and report["count"] > 2
        assert not list(Path("/dev/shm").glob("edge-agent-infer-*"))  # each client's removed
        no_token = subprocess.run(
            [sys.executable, "-m", "agent", "infer", "--url", f"http://{plane['http']}",
             "--seconds", "1", "--shm"], capture_output=True, text=True, timeout=120,
            check=False)
        assert no_token.returncode == 2 and "--shm needs --token-file" in no_token.stderr
        missing = subprocess.run(
            [sys.executable, "-m", "agent", "infer", "--url", f"http://{plane['http']}",
             "--model", "nosuch", "--seconds", "1"], capture_output=True, text=True,
            timeout=120, check=False)
        assert missing.returncode == 2 and "unknown model 'nosuch'" in missing.stderr


def test_a_version_loaded_under_load_fails_no_request(tmp_path: Path) -> None:
    with serve_process(tmp_path) as plane:
        version2 = plane["repository"] / "demo" / "2"
        version2.mkdir(parents=True)
        shutil.copy(conv_net(tmp_path / "net.onnx"), version2 / "model.onnx")
        failures: list[str] = []
        versions: list[str] = []
        stop = threading.Event()

        by_client: dict[int, list[str]] = {}

        def client_loop(seed: int) -> None:
            client = httpclient.InferenceServerClient(plane["http"])
            mine = by_client.setdefault(seed, [])
            while not stop.is_set():
                try:
                    version = http_infer(client, "demo", demo_input(1, seed))[1]
                except Exception as error:
                    failures.append(repr(error))
                    continue
                mine.append(version)
                versions.append(version)

        threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(3)]
        for thread in threads:
            thread.start()
        assert wait_until(lambda: len(versions) > 20, 30)
        control = httpclient.InferenceServerClient(plane["http"])
        with pytest.raises(Exception, match="token"):
            control.load_model("demo")
        control.load_model("demo", headers={"Authorization": f"Bearer {TOKEN}"})
        seen = len(versions)
        assert wait_until(lambda: "2" in versions[seen:] and len(versions) > seen + 20, 30)
        stop.set()
        for thread in threads:
            thread.join(30)
        assert failures == []
        for seen in by_client.values():  # each client's requests are sequential: once one
            if "2" in seen:  # answered on 2, every later one starts after the switch
                assert set(seen[seen.index("2"):]) == {"2"}  # (latest: 1: 1 serves no more)
        assert control.get_model_metadata("demo")["versions"] == ["2"]


def watchdog_listener(path: Path) -> tuple[socket.socket, list[tuple[float, str]]]:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(path))
    listener.settimeout(0.2)
    return listener, []


def test_kill_9_of_the_data_plane_under_load_is_an_event_and_a_restart(
        tmp_path: Path, broker: Broker) -> None:
    config = tmp_path / "agent.yaml"
    config.write_text(yaml.safe_dump(agent_config(tmp_path, broker.port)))
    state_dir = tmp_path / "state"
    listener, notes = watchdog_listener(tmp_path / "notify.sock")
    subscriber = Subscriber(broker, ["edge/v1/lab/orin-1/#"])
    agent = start_agent(config, NOTIFY_SOCKET=str(tmp_path / "notify.sock"),
                        WATCHDOG_USEC="1000000")
    done = threading.Event()

    def read_notes() -> None:
        while not done.is_set():
            with contextlib.suppress(TimeoutError, OSError):
                for line in listener.recv(4096).decode().splitlines():
                    notes.append((time.monotonic(), line))

    reader = threading.Thread(target=read_notes)
    reader.start()
    outcomes: list[tuple[float, bool]] = []
    try:
        assert wait_until(lambda: serving_addresses(state_dir).get("http"), 120)
        first = serving_addresses(state_dir)
        client = httpclient.InferenceServerClient(first["http"])
        assert wait_until(client.is_server_ready, 60)
        assert wait_until(lambda: [s for s in subscriber.on("state")
                                   if s["state"] == "online"], 60)  # the agent is up

        def load() -> None:
            while not done.is_set():
                address = serving_addresses(state_dir).get("http") or first["http"]
                try:
                    http_infer(httpclient.InferenceServerClient(address), "demo",
                               demo_input())
                    outcomes.append((time.monotonic(), True))
                except Exception:
                    outcomes.append((time.monotonic(), False))
                    done.wait(0.05)

        driver = threading.Thread(target=load)
        driver.start()
        assert wait_until(lambda: sum(ok for _t, ok in outcomes) > 10, 30)
        killed_at = time.monotonic()
        os.kill(first["pid"], signal.SIGKILL)
        assert wait_until(lambda: serving_addresses(state_dir).get("pid") not in (
            None, first["pid"]), 60)
        assert wait_until(lambda: any(ok and t > killed_at for t, ok in outcomes), 60)
        events = [e for e in subscriber.on("event") if e.get("type") == "data_plane_exited"]
        assert wait_until(lambda: [e for e in subscriber.on("event")
                                   if e.get("type") == "data_plane_exited"], 30)
        events = [e for e in subscriber.on("event") if e.get("type") == "data_plane_exited"]
        assert events[0]["signal"] == "SIGKILL" and events[0]["pid"] == first["pid"]
        assert events[0]["restarts"] == 1
        assert wait_until(lambda: any(
            (t.get("metrics", {}).get("inference") or {}).get("data_plane", {}).get(
                "restarts") == 1 for t in subscriber.on("telemetry")), 30)
        recovered = min(t for t, ok in outcomes if ok and t > killed_at)
        done.set()
        driver.join(30)
        assert agent.poll() is None  # the control plane never went down
        assert wait_until(lambda: subscriber.on("state")[-1]["state"] == "online", 30)
        states = [s.get("state") for s in subscriber.on("state")]
        assert "offline" not in states and "degraded" in states and states[-1] == "online", \
            [(s["state"], s.get("reason")) for s in subscriber.on("state")]
        pings = [t for t, line in notes if line == "WATCHDOG=1"]
        assert any(killed_at < t < recovered for t in pings) or recovered - killed_at < 0.6
        gaps = [b - a for a, b in itertools.pairwise(pings) if a > killed_at - 2]
        assert gaps and max(gaps) < 1.5, gaps  # pinged every 0.5 s throughout
    finally:
        done.set()
        agent.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            agent.wait(30)
        agent.kill()
        reader.join(5)
        listener.close()
        subscriber.close()


def test_beyond_loopback_it_needs_tls_and_the_token_for_every_call(tmp_path: Path) -> None:
    import urllib.error
    import urllib.request

    from tests.mqtt_helpers import make_test_ca

    files = make_test_ca(tmp_path / "tls")
    tls = {"cert": str(files.server_cert), "key": str(files.server_key)}
    with serve_process(tmp_path, http="0.0.0.0:0", grpc="0.0.0.0:0", tls=tls) as plane:
        port = plane["http"].rpartition(":")[2]
        context = ssl.create_default_context(cafile=str(files.ca))
        url = f"https://127.0.0.1:{port}/v2/models/demo"
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(url, context=context, timeout=10)
        assert refused.value.code == 401
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(request, context=context, timeout=10) as answer:
            assert json.loads(answer.read())["name"] == "demo"
        # no plain HTTP on that port: the TLS listener hangs up on it
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/live", timeout=10)
        grpc = grpcclient.InferenceServerClient(
            f"127.0.0.1:{plane['grpc'].rpartition(':')[2]}", ssl=True,
            root_certificates=str(files.ca))
        with pytest.raises(Exception, match="token"):
            grpc.is_server_live()
        assert grpc.is_server_live(headers={"authorization": f"Bearer {TOKEN}"})


def _affinities(pid: int, prefix: str) -> set[frozenset[int]]:
    """The distinct CPU sets of the process's threads whose name starts with ``prefix`` (how
    many such threads a front end's pool has started depends on how calls overlapped)."""
    found = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        if (task / "comm").read_text().startswith(prefix):
            found.add(frozenset(os.sched_getaffinity(int(task.name))))
    return found


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to move between")
def test_the_inference_threads_take_the_profiles_scheduling_and_a_new_one_on_sighup(
        tmp_path: Path) -> None:
    from agent.kernel.sched import ThreadSched
    from agent.serving.threads import write_sched_file

    cpus = sorted(os.sched_getaffinity(0))
    sched_file = tmp_path / "sched.json"
    write_sched_file(sched_file, ThreadSched("other", 0, cpus[:1]))
    config = agent_config(tmp_path, 1883)
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    ready = tmp_path / "ready.json"
    process = subprocess.Popen([sys.executable, "-m", "agent", "serve", "--config", str(path),
                                "--ready-file", str(ready), "--sched-file", str(sched_file)])
    try:
        assert wait_until(lambda: ready.exists() or process.poll() is not None, 120)
        plane = json.loads(ready.read_text())
        assert wait_until(lambda: server_ready(plane["http"]), 120)  # the models loaded
        http_infer(httpclient.InferenceServerClient(plane["http"]), "demo", demo_input())
        assert _affinities(process.pid, "infer-http") == {frozenset(cpus[:1])}
        assert set(os.sched_getaffinity(process.pid)) == set(cpus)  # the main thread: not
        write_sched_file(sched_file, ThreadSched("other", 0, cpus[1:2]))
        process.send_signal(signal.SIGHUP)
        assert wait_until(lambda: _affinities(process.pid, "infer-http")
                          == {frozenset(cpus[1:2])}, 10)
        write_sched_file(sched_file, None)  # a rollback: what the threads had before
        process.send_signal(signal.SIGHUP)
        assert wait_until(lambda: _affinities(process.pid, "infer-http") == {frozenset(cpus)},
                          10)
    finally:
        process.terminate()
        process.wait(30)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving the token file away needs root")
def test_infer_url_shm_shares_its_memory_with_the_token_files_group(tmp_path: Path) -> None:
    """A caller who is not the token file's owner (a member of its group, as a device's
    users are) shares each region with that group: the server attaches nothing else."""
    with serve_process(tmp_path) as plane:
        token = tmp_path / "serve-token"
        os.chown(token, 54321, os.getegid())
        shared = subprocess.run(
            [sys.executable, "-m", "agent", "infer", "--url", f"grpc://{plane['grpc']}",
             "--seconds", "1", "--shm", "--token-file", str(token), "--json"],
            capture_output=True, text=True, timeout=120, check=False)
        assert shared.returncode == 0, shared.stderr
        report = json.loads(shared.stdout)
        assert report["shared_memory"] and report["errors"] == 0 and report["count"] > 2
