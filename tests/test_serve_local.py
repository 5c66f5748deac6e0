"""The local front end (``serve.local``) and ``edge_agent_client`` against a real
``edge-agent serve``: real sockets, real memfds, real ONNX Runtime sessions."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from agent.inference.demo_model import DEMO_INPUT, DEMO_MODEL_PATH, DEMO_OUTPUT
from agent.serving import local_wire
from agent.serving.core import DATATYPES
from tests.mqtt_helpers import wait_until
from tests.onnx_models import conv_net
from tests.test_serve_process import demo_input, serve_process

CLIENT = Path(__file__).resolve().parents[1] / "clients" / "python"
if str(CLIENT) not in sys.path:  # the checkout's copy, where the venv does not install it
    sys.path.insert(0, str(CLIENT))

import edge_agent_client  # noqa: E402
from edge_agent_client import _wire  # noqa: E402
from edge_agent_client._session import Region  # noqa: E402

NOBODY = 65534


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A directory anyone may enter (tmp_path is its owner's only), so that what keeps
    another user out is the socket's own mode."""
    made = Path(tempfile.mkdtemp(prefix="ea-"))
    made.chmod(0o755)
    try:
        yield made / "run"
    finally:
        subprocess.run(["rm", "-rf", str(made)], check=False)


def reference(x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(str(DEMO_MODEL_PATH), providers=["CPUExecutionProvider"])
    return np.asarray(session.run([DEMO_OUTPUT], {DEMO_INPUT: x})[0])


def raw_hello(path: str, fds: list[int], message: dict[str, Any] | None = None
              ) -> tuple[socket.socket, dict[str, Any]]:
    """A connection that sent a hello with ``fds``, and the server's reply."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    connection.settimeout(30)
    connection.connect(path)
    socket.send_fds(connection, [json.dumps(message or {"op": "hello"}).encode()], fds)
    return connection, json.loads(connection.recv(local_wire.MAX_MESSAGE))


def ask(connection: socket.socket, message: dict[str, Any]) -> dict[str, Any]:
    connection.sendall(json.dumps(message).encode())
    return json.loads(connection.recv(local_wire.MAX_MESSAGE))  # type: ignore[no-any-return]


def region_fds(server_pid: int, marker: str) -> list[str]:
    """The server's descriptors and mappings of memfds named ``marker``."""
    found = []
    with contextlib.suppress(FileNotFoundError):
        for fd in os.listdir(f"/proc/{server_pid}/fd"):
            with contextlib.suppress(OSError):
                if marker in os.readlink(f"/proc/{server_pid}/fd/{fd}"):
                    found.append(f"fd {fd}")
    maps = Path(f"/proc/{server_pid}/maps").read_text()
    return found + [line for line in maps.splitlines() if marker in line]


def test_the_wire_constants_agree_between_server_and_client() -> None:
    assert (_wire.PROTOCOL, _wire.MAX_MESSAGE, _wire.ALIGNMENT) == (
        local_wire.PROTOCOL, local_wire.MAX_MESSAGE, local_wire.ALIGNMENT)
    assert {name: np.dtype(spelled) for name, spelled in _wire.DATATYPES.items()} == DATATYPES


def test_the_client_parses_as_python_3_9() -> None:
    """It installs on Python 3.9 without the agent: no syntax of a later Python (ruff's
    py39 target holds the rest: no ``X | Y`` outside an annotation)."""
    import ast

    for path in sorted((CLIENT / "edge_agent_client").glob("*.py")):
        ast.parse(path.read_text(), str(path), feature_version=(3, 9))
        assert "from __future__ import annotations" in path.read_text(), path


def test_client_outputs_equal_ort_run_directly_and_the_socket_is_owner_only(
        tmp_path: Path) -> None:
    x = demo_input(2, seed=3)
    expected = reference(x)
    with serve_process(tmp_path) as served:
        path = served["local"]
        assert path == str(tmp_path / "l.sock")
        assert oct(os.stat(path).st_mode & 0o777) == oct(0o600)  # no group edge-agent here
        with edge_agent_client.Client(path) as client:
            meta = client.metadata("demo")
            assert meta["inputs"] == [{"name": DEMO_INPUT, "datatype": "FP32",
                                       "shape": [-1, 3, 64, 64]}]
            copied = client.infer("demo", {DEMO_INPUT: x})
            np.testing.assert_allclose(copied[DEMO_OUTPUT], expected, rtol=1e-5, atol=1e-6)
            views = client.inputs("demo", batch=2)
            assert views[DEMO_INPUT].shape == (2, 3, 64, 64)
            assert client.inputs("demo", batch=2) is views  # the same arrays each time
            views[DEMO_INPUT][...] = x
            in_place = client.infer("demo", views, copy=False)
            np.testing.assert_allclose(in_place[DEMO_OUTPUT], expected, rtol=1e-5, atol=1e-6)
            with pytest.raises(edge_agent_client.NotFound) as missing:
                client.infer("nope", views)
            assert missing.value.code == "NOT_FOUND" and "nope" in missing.value.message
            with pytest.raises(edge_agent_client.InvalidArgument) as wrong:
                client.infer("demo", {DEMO_INPUT: x[:, :2]})
            assert wrong.value.code == "INVALID_ARGUMENT"
            # the session survives its errors
            again = client.infer("demo", {DEMO_INPUT: x})
            np.testing.assert_allclose(again[DEMO_OUTPUT], expected, rtol=1e-5, atol=1e-6)
    assert not os.path.exists(path)  # removed on stop


def test_a_region_too_small_grows_and_the_call_still_answers(tmp_path: Path) -> None:
    x = demo_input(4, seed=5)
    with serve_process(tmp_path) as served, \
            edge_agent_client.Client(served["local"], region_mb=0.01) as client:
        result = client.infer("demo", {DEMO_INPUT: x})
    np.testing.assert_allclose(result[DEMO_OUTPUT], reference(x), rtol=1e-5, atol=1e-6)


def test_concurrent_clients_share_a_batch_shown_in_the_statistics(tmp_path: Path) -> None:
    model = tmp_path / "state" / "repository" / "cnn"
    (model / "1").mkdir(parents=True)
    conv_net(model / "1" / "model.onnx")
    (model / "config.yaml").write_text(yaml.safe_dump({
        "max_batch_size": 8, "dynamic_batching": {"preferred_batch_size": [4],
                                                  "max_queue_delay_us": 10_000_000}}))
    with serve_process(tmp_path) as served:
        client = edge_agent_client.Client(served["local"])
        frames = [demo_input(1, seed=seed) for seed in range(4)]
        results: dict[int, np.ndarray] = {}

        def one(index: int) -> None:  # each thread its own session
            results[index] = client.infer("cnn", {DEMO_INPUT: frames[index]})[DEMO_OUTPUT]

        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        client.close()
        stats = _get(served["http"], "/v2/models/cnn/stats")["model_stats"][0]
    assert sorted(results) == [0, 1, 2, 3]
    import onnxruntime as ort

    session = ort.InferenceSession(str(model / "1" / "model.onnx"))
    for index, frame in enumerate(frames):
        np.testing.assert_allclose(results[index], session.run(None, {DEMO_INPUT: frame})[0],
                                   rtol=1e-5, atol=1e-6)
    assert stats["inference_count"] == 4 and stats["execution_count"] == 1
    assert [b["batch_size"] for b in stats["batch_stats"]] == [4]


def _ready(client: edge_agent_client.Client, model: str) -> bool:
    """Whether ``model`` answers a call (its metadata is there before it loaded)."""
    try:
        client.infer(model, {DEMO_INPUT: demo_input(1)})
    except edge_agent_client.ServerError:
        return False
    return True


def _get(address: str, route: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{address}{route}", timeout=10) as answer:
        return json.loads(answer.read())  # type: ignore[no-any-return]


KILLED_CLIENT = """
import sys
sys.path.insert(0, sys.argv[2])
import numpy as np
from edge_agent_client import Client
client = Client(sys.argv[1])
views = client.inputs("demo", batch=4)
views["image"][...] = 0.5
client.infer("demo", views)
print("serving", flush=True)
while True:
    client.infer("demo", views)
"""


def test_a_client_killed_mid_request_leaves_the_server_serving_and_frees_its_region(
        tmp_path: Path) -> None:
    x = demo_input(1)
    with serve_process(tmp_path) as served:
        pid = served["process"].pid
        child = subprocess.Popen([sys.executable, "-c", KILLED_CLIENT, served["local"],
                                  str(CLIENT)], stdout=subprocess.PIPE, text=True,
                                 stderr=subprocess.PIPE)
        try:
            assert child.stdout is not None and child.stderr is not None
            assert child.stdout.readline() == "serving\n", child.stderr.read()
            marker = "memfd:edge-agent-client"
            assert region_fds(pid, marker)  # mapped, and its descriptor held, while it lives
            child.kill()
            child.wait()
        finally:
            if child.poll() is None:
                child.kill()
        assert wait_until(lambda: not region_fds(pid, marker), 30), region_fds(pid, marker)
        with edge_agent_client.Client(served["local"]) as client:
            result = client.infer("demo", {DEMO_INPUT: x})
        np.testing.assert_allclose(result[DEMO_OUTPUT], reference(x), rtol=1e-5, atol=1e-6)


def test_another_uid_without_the_group_is_refused(tmp_path: Path, sock_dir: Path) -> None:
    path = str(sock_dir / "infer.sock")
    with serve_process(tmp_path, local={"socket": path}):
        assert oct(sock_dir.stat().st_mode & 0o777) == oct(0o755)
        read, write = os.pipe()
        child = os.fork()
        if child == 0:  # pragma: no cover (the child reports through the pipe)
            os.close(read)
            try:
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                edge_agent_client.Client(path).metadata("demo")
                report = "connected"
            except edge_agent_client.ServerError as error:
                report = f"{type(error).__name__} {error.code} {error.message}"
            except BaseException as error:
                report = repr(error)
            os.write(write, report.encode())
            os._exit(0)
        os.close(write)
        with os.fdopen(read) as pipe:
            report = pipe.read()
        os.waitpid(child, 0)
    assert report.startswith(f"PermissionDenied PERMISSION_DENIED {path}: permission denied"), \
        report
    assert "serve.local.group" in report


def _memfd(size: int, seals: int) -> int:
    fd = os.memfd_create("hostile", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def test_descriptors_that_are_no_sealed_region_and_offsets_beyond_it_are_refused(
        tmp_path: Path) -> None:
    regular = tmp_path / "file"
    regular.write_bytes(b"\0" * 4096)
    with serve_process(tmp_path, local={"socket": str(tmp_path / "l.sock"),
                                        "max_region_mb": 1}) as served:
        path = served["local"]
        pipe_read, pipe_write = os.pipe()
        cases = {
            "a regular file": os.open(regular, os.O_RDWR),
            "a pipe": pipe_read,
            "an unsealed memfd": _memfd(4096, 0),
            "a memfd sealed only against growing": _memfd(4096, fcntl.F_SEAL_GROW),
            "a region over max_region_mb": _memfd(2 << 20, fcntl.F_SEAL_SHRINK),
        }
        replies = {}
        for what, fd in cases.items():
            connection, replies[what] = raw_hello(path, [fd])
            connection.close()
            os.close(fd)
        os.close(pipe_write)
        assert {what: reply["error"]["code"] for what, reply in replies.items()} == dict.fromkeys(
            cases, "INVALID_ARGUMENT")
        assert "not shared memory" in replies["a pipe"]["error"]["message"]
        assert "MFD_ALLOW_SEALING" in replies["a regular file"]["error"]["message"]
        assert "not sealed against shrinking" in replies["an unsealed memfd"]["error"]["message"]
        assert "serve.local.max_region_mb" in replies["a region over max_region_mb"]["error"][
            "message"]
        two = [_memfd(4096, fcntl.F_SEAL_SHRINK), _memfd(4096, fcntl.F_SEAL_SHRINK)]
        connection, reply = raw_hello(path, two)
        assert reply["error"]["code"] == "INVALID_ARGUMENT", reply
        connection.close()
        # a good region, then requests that point outside it
        fd = _memfd(65536, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        connection, reply = raw_hello(path, [fd])
        assert reply["size"] == 65536, reply
        image = [DEMO_INPUT, "FP32", [1, 3, 64, 64]]
        bad = {
            "beyond": {"inputs": [[*image, 65536 - 100]], "area": [0, 1000]},
            "misaligned": {"inputs": [[*image, 2]], "area": [0, 1000]},
            "area beyond": {"inputs": [[*image, 0]], "area": [60000, 10000]},
            "huge shape": {"inputs": [[DEMO_INPUT, "FP32", [1 << 31, 1 << 31], 0]],
                           "area": [0, 0]},
            "not a list": {"inputs": "x", "area": [0, 0]},
        }
        for what, fields in bad.items():
            reply = ask(connection, {"op": "infer", "model": "demo", **fields})
            assert reply["error"]["code"] == "INVALID_ARGUMENT", (what, reply)
        assert "beyond the region" in ask(connection, {"op": "infer", "model": "demo",
                                                       **bad["beyond"]})["error"]["message"]
        connection.sendall(b"{not json")
        assert json.loads(connection.recv(65536))["error"]["code"] == "INVALID_ARGUMENT"
        # outputs that do not fit the area: the bytes they need
        reply = ask(connection, {"op": "infer", "model": "demo", "inputs": [[*image, 0]],
                                 "area": [49152, 8]})
        assert reply["error"]["code"] == "RESOURCE_EXHAUSTED" and reply["error"]["needed"] == 40
        # and the session still serves
        reply = ask(connection, {"op": "infer", "model": "demo", "inputs": [[*image, 0]],
                                 "area": [49152, 1024]})
        assert reply["outputs"] == [[DEMO_OUTPUT, "FP32", [1, 10], 49152]], reply
        connection.close()
        os.close(fd)


def test_a_session_flood_is_refused_beyond_max_sessions(tmp_path: Path) -> None:
    with serve_process(tmp_path, local={"socket": str(tmp_path / "l.sock"),
                                        "max_sessions": 3}) as served:
        path = served["local"]
        region = Region(4096)
        held = [raw_hello(path, [region.fd])[0] for _ in range(3)]
        with pytest.raises(edge_agent_client.ResourceExhausted) as refused:
            edge_agent_client.Client(path).metadata("demo")
        assert refused.value.code == "RESOURCE_EXHAUSTED"
        assert "serve.local.max_sessions" in refused.value.message
        held.pop().close()
        client = edge_agent_client.Client(path)
        assert wait_until(lambda: _ready(client, "demo"), 30)
        client.close()
        for connection in held:
            connection.close()
        region.close()


def test_threads_that_end_give_their_sessions_back(tmp_path: Path) -> None:
    """A thread's session ends with the thread: a client used from short-lived threads
    (a thread pool that replaces its workers, a bench) never uses up max_sessions."""
    x = demo_input(1, seed=3)
    with serve_process(tmp_path, local={"socket": str(tmp_path / "l.sock"),
                                        "max_sessions": 2}) as served:
        pid = served["process"].pid
        client = edge_agent_client.Client(served["local"])
        results: list[dict[str, np.ndarray]] = []

        def one_call() -> None:
            assert wait_until(lambda: _ready(client, "demo"), 60)
            results.append(client.infer("demo", {DEMO_INPUT: x}))

        for count in range(1, 7):  # three times max_sessions, one thread after another
            thread = threading.Thread(target=one_call)
            thread.start()
            thread.join()
            assert len(results) == count
            # the session went with its thread: the data plane let go of its region
            assert wait_until(lambda: not region_fds(pid, "memfd:edge-agent-client"), 30)
        for result in results:
            np.testing.assert_allclose(result[DEMO_OUTPUT], reference(x), rtol=1e-5,
                                       atol=1e-6)
        client.close()


def test_the_data_plane_restarted_under_a_client_is_reconnected_or_raised(
        tmp_path: Path) -> None:
    x = demo_input(1, seed=9)
    expected = reference(x)
    config = _config(tmp_path)
    first = _start(tmp_path, config)
    client = edge_agent_client.Client(str(tmp_path / "l.sock"), timeout_s=30)
    try:
        assert wait_until(lambda: _ready(client, "demo"), 120)
        views = client.inputs("demo")
        views[DEMO_INPUT][...] = x
        np.testing.assert_allclose(client.infer("demo", views)[DEMO_OUTPUT], expected,
                                   rtol=1e-5, atol=1e-6)
        first.kill()  # its socket file stays behind: stale
        first.wait()
        with pytest.raises(edge_agent_client.ServerGone) as gone:
            client.infer("demo", views)
        assert gone.value.code == "UNAVAILABLE"
        second = _start(tmp_path, config)
        try:
            assert wait_until(lambda: _ready(client, "demo"), 120)
            # the same views: the session came back with the same region
            np.testing.assert_allclose(client.infer("demo", views)[DEMO_OUTPUT], expected,
                                       rtol=1e-5, atol=1e-6)
            # a second data plane on a live socket is refused, naming the key
            third = subprocess.run([sys.executable, "-m", "agent", "serve", "--config",
                                    str(config)], capture_output=True, text=True, timeout=120)
            assert third.returncode == 2
            assert "serve.local.socket" in third.stderr and "another data plane" in third.stderr
        finally:
            second.send_signal(signal.SIGTERM)
            assert second.wait(30) == 0
        with pytest.raises(edge_agent_client.ServerGone):
            client.infer("demo", views)
    finally:
        client.close()
        if first.poll() is None:
            first.kill()


def _config(tmp_path: Path) -> Path:
    from tests.agent_process import agent_config

    config = agent_config(tmp_path, 1883)
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _start(tmp_path: Path, config: Path) -> subprocess.Popen[bytes]:
    ready = tmp_path / "ready.json"
    ready.unlink(missing_ok=True)
    process = subprocess.Popen([sys.executable, "-m", "agent", "serve", "--config",
                                str(config), "--ready-file", str(ready)])
    assert wait_until(lambda: ready.exists() or process.poll() is not None, 120)
    assert process.poll() is None
    return process


def test_serve_local_false_turns_the_front_end_off(tmp_path: Path) -> None:
    with serve_process(tmp_path, local=False) as served:
        assert "local" not in served
    assert not (tmp_path / "l.sock").exists()


def test_serve_local_is_checked_like_every_section() -> None:
    from agent.config import ConfigError
    from agent.config.loader import from_dict

    assert from_dict({}).serve.local is not None  # on by default
    assert from_dict({"serve": {"local": False}}).serve.local is None
    assert from_dict({"serve": {"local": {"max_sessions": 8}}}).serve.local.max_sessions == 8
    with pytest.raises(ConfigError, match=r"serve\.local: 5 is not allowed: expected a "
                       r"mapping with keys socket, group, max_sessions, max_region_mb, or "
                       "false to turn it off"):
        from_dict({"serve": {"local": 5}})
    with pytest.raises(ConfigError, match=r"serve\.local\.max_sessions: 0 is not allowed"):
        from_dict({"serve": {"local": {"max_sessions": 0}}})


def test_infer_url_unix_drives_the_local_path_or_says_the_client_is_missing(
        tmp_path: Path) -> None:
    with serve_process(tmp_path) as served:
        url = f"unix://{served['local']}"
        command = [sys.executable, "-m", "agent", "infer", "--url", url, "--seconds", "1",
                   "--concurrency", "2", "--json"]
        with_client = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(CLIENT.parents[1]), str(CLIENT)])}
        result = subprocess.run(command, capture_output=True, text=True, timeout=120,
                                check=False, env=with_client)
        assert result.returncode == 0, result.stderr
        report = json.loads(result.stdout)
        assert report["url"] == url and report["versions"] == ["1"]
        assert report["errors"] == 0 and report["count"] > 2 and report["concurrency"] == 2
        missing = subprocess.run([*command[:-3], "--model", "nosuch"], capture_output=True,
                                 text=True, timeout=120, check=False, env=with_client)
        assert missing.returncode == 2 and "unknown model 'nosuch'" in missing.stderr
        # a package of that name that cannot be imported shadows the one installed here
        absent = tmp_path / "absent" / "edge_agent_client"
        absent.mkdir(parents=True)
        (absent / "__init__.py").write_text(
            "raise ModuleNotFoundError(\"No module named 'edge_agent_client'\", "
            "name='edge_agent_client')\n")
        without = subprocess.run(command, capture_output=True, text=True, timeout=120,
                                 check=False, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                     [str(absent.parent), str(CLIENT.parents[1])])})
    assert without.returncode == 2
    assert without.stderr.strip().splitlines() == [
        "edge-agent infer: --url unix://...: the local path needs the edge-agent-client "
        "package (pip install clients/python of the edge-agent checkout; install.sh "
        "installs it)"]


def test_a_call_past_its_timeout_raises_deadline_exceeded_and_the_next_call_is_its_own(
        tmp_path: Path) -> None:
    """A data plane that takes the session and the call and never answers (a run stuck in
    the runtime): the client's wait ends at ``timeout_s`` with DeadlineExceeded, and the
    connection that may still carry the late answer is dropped, so the next call (on a new
    session, answered at once here) gets its own answer, never the one that came late."""
    path = tmp_path / "silent.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(path))
    listener.listen(2)
    sessions: list[socket.socket] = []

    def peer() -> None:
        for answer in (False, True):
            connection, _ = listener.accept()
            sessions.append(connection)
            _, fds, _, _ = socket.recv_fds(connection, local_wire.MAX_MESSAGE, 1)
            for fd in fds:
                os.close(fd)
            connection.send(json.dumps({"size": 1 << 20, "trusted": False,
                                        "protocol": local_wire.PROTOCOL}).encode())
            call = json.loads(connection.recv(local_wire.MAX_MESSAGE))
            if answer:  # the second session: an error naming the model it was asked for
                connection.send(json.dumps({"error": {
                    "code": "NOT_FOUND", "message": f"unknown model {call['model']!r}"}}
                ).encode())

    thread = threading.Thread(target=peer, daemon=True)
    thread.start()
    x = demo_input(1)
    with edge_agent_client.Client(str(path), region_mb=1) as client:
        with pytest.raises(edge_agent_client.DeadlineExceeded) as late:
            client.infer("demo", {DEMO_INPUT: x}, timeout_s=0.2)
        assert late.value.code == "DEADLINE_EXCEEDED"
        with pytest.raises(edge_agent_client.NotFound, match="unknown model 'second'"):
            client.infer("second", {DEMO_INPUT: x}, timeout_s=30)
    thread.join(30)
    assert len(sessions) == 2  # the session of the unanswered call was not reused
    for connection in sessions:
        connection.close()
    listener.close()
