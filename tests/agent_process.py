"""``edge-agent run`` as a real process in tests: its config, its start, its status."""

from __future__ import annotations

import ast
import contextlib
import io
import json
import os
import resource
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from agent import cli

FIXTURES = Path(__file__).parent / "fixtures"


def agent_config(tmp_path: Path, port: int, root: Path | None = None,
                 **extra: Any) -> dict[str, Any]:
    """Node orin-1 of fleet lab on a fixture AGX Orin, a fast sampler and fast reconnects;
    its data plane on free loopback ports, its local socket in the test's directory (tests
    run as root, whose default /run/edge-agent/infer.sock they would share) and with a token
    file of the test's.  No broker
    of its own (``mqtt.local_broker: false``): a test without a broker means none."""
    token = tmp_path / "serve-token"
    if not token.exists():
        token.write_text("test-token\n")
        token.chmod(0o600)  # the data plane refuses a token other users may read
    return {"node_id": "orin-1", "fleet": "lab", "state_dir": str(tmp_path / "state"),
            "root": str(root or FIXTURES / "jetson-agx-orin-jp6"),
            "mqtt": {"host": "127.0.0.1", "port": port, "local_broker": False,
                     "reconnect": {"min_s": 0.1, "max_s": 0.5}},
            "telemetry": {"interval_s": 0.2},
            "serve": {"http": "127.0.0.1:0", "grpc": "127.0.0.1:0", "metrics": "127.0.0.1:0",
                      "token_file": str(token), "local": {"socket": str(tmp_path / "l.sock")}},
            **extra}


def write_config(tmp_path: Path, port: int, root: Path | None = None, **extra: Any) -> Path:
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(agent_config(tmp_path, port, root, **extra)))
    return path


def start_agent(config: Path, *args: str, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(sigint_at_default(sys.executable, "-m", "agent", "run", "--config",
                                              str(config), *args),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, **env})


def serving_addresses(state_dir: Path) -> dict[str, Any]:
    """``{pid, http, grpc}`` of the data plane a running agent supervises ({} before)."""
    try:
        return json.loads((state_dir / "serve" / "ready.json").read_text())  # type: ignore[no-any-return]
    except (OSError, ValueError):
        return {}


def status(config: Path) -> tuple[int, dict[str, Any]]:
    """Exit status and JSON of ``edge-agent status``, read through the state directory
    next to ``config`` (the config file itself may be broken on purpose).

    The command's own entry point, called in this process: the tests poll it, and a fresh
    interpreter per poll took a core away from the agent it waits for.  What it prints and
    returns is the command's; the process, which these tests are not about, is the
    test's."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["status", "--state-dir", str(config.parent / "state"), "--json"])
    return code, json.loads(out.getvalue()) if out.getvalue().strip() else {}


def sigint_at_default(*argv: str) -> list[str]:
    """``argv`` for a child that is to get Ctrl-C: a test run started as a background job
    ignores SIGINT, and a child inherits that.  env(1) resets it in the child after exec,
    where a ``preexec_fn`` would run Python between fork and exec: unsafe in a process
    with threads (pytest has dozens), and once it left a child hung before it started."""
    return ["env", "--default-signal=INT", *argv]


def with_nofile(soft: int, *argv: str, hard: int | None = None) -> list[str]:
    """``argv`` run with a soft descriptor limit of ``soft`` (and ``hard``, or this one's),
    set by prlimit(1) before it execs: the systemd unit's default, without a
    ``preexec_fn``."""
    hard = hard or resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return ["prlimit", f"--nofile={soft}:{hard}", "--", *argv]


def modules_loaded_by(statement: str, *prefixes: str) -> list[str]:
    """The modules whose names start with one of ``prefixes`` that a fresh interpreter has
    loaded after running ``statement`` from the checkout (the import-cost checks)."""
    code = (f"import sys\n{statement}\n"
            f"print(sorted(m for m in sys.modules if m.startswith({prefixes!r})), "
            "file=sys.stderr)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parents[1], timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    loaded: list[str] = ast.literal_eval(result.stderr.strip().splitlines()[-1])
    return loaded


HALF_CORE_HOG = ("import time\nwhile True:\n    end = time.perf_counter() + 0.005\n"
                 "    while time.perf_counter() < end:\n        pass\n    time.sleep(0.005)\n")


@contextlib.contextmanager
def half_core_hog() -> Iterator[subprocess.Popen[bytes]]:
    """A process taking half a core (spin 5 ms, sleep 5 ms) while the block runs: a stand-in
    for a co-located app or a thermal throttle; killed (and reaped) after."""
    process = subprocess.Popen([sys.executable, "-c", HALF_CORE_HOG])
    try:
        yield process
    finally:
        process.kill()
        process.wait()
