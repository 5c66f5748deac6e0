"""The default node id (agent.config.nodeid): the hostname plus 6 hex digits of the sha256 of
``/etc/machine-id`` read below the config's root; the file's ``node_id`` wins; without a
machine id, the hostname alone and a warning; ``edge-agent config node-id`` prints it."""

from __future__ import annotations

import hashlib
import json
import socket
from pathlib import Path

import pytest
from cli_helpers import edge_agent

from agent.config import from_dict, load_config
from agent.config.checks import TOPIC_LEVEL
from agent.config.nodeid import node_id_for, parse_machine_id

MACHINE = "0123456789abcdef0123456789abcdef"
OTHER = "fedcba9876543210fedcba9876543210"


def expected(machine_id: str) -> str:
    """The contract (DESIGN.md "Brokers"), spelled independently of the code."""
    host = socket.gethostname()
    return f"{host}-{hashlib.sha256(machine_id.encode()).hexdigest()[:6]}"


def root_with(tmp_path: Path, content: str | None, name: str = "root") -> Path:
    root = tmp_path / name
    (root / "etc").mkdir(parents=True)
    if content is not None:
        (root / "etc/machine-id").write_text(content)
    return root


def test_hostname_plus_six_hex_digits_of_the_machine_id_s_sha256() -> None:
    assert node_id_for("rock-5b", MACHINE) == \
        "rock-5b-" + hashlib.sha256(MACHINE.encode()).hexdigest()[:6]
    assert node_id_for("rock-5b", MACHINE) != node_id_for("rock-5b", OTHER)
    assert node_id_for("rock-5b", None) == "rock-5b"


@pytest.mark.parametrize("hostname", ["a" * 80, "my host/1+#", "", "ünïcode.local"])
def test_every_hostname_gives_a_valid_topic_level_with_the_whole_suffix(hostname: str) -> None:
    for machine in (MACHINE, None):
        node_id = node_id_for(hostname, machine)
        assert TOPIC_LEVEL.match(node_id), node_id
    suffix = hashlib.sha256(MACHINE.encode()).hexdigest()[:6]
    assert node_id_for(hostname, MACHINE).endswith("-" + suffix)
    assert len(node_id_for("a" * 80, MACHINE)) == 64


@pytest.mark.parametrize(("text", "parsed"), [
    (MACHINE + "\n", MACHINE), ("  " + MACHINE, MACHINE), ("", None), ("\n", None),
    ("uninitialized\n", None), (MACHINE.upper(), None), (MACHINE[:-1], None),
    (MACHINE + MACHINE, None)])
def test_only_a_machine_id_is_taken(text: str, parsed: str | None) -> None:
    assert parse_machine_id(text) == parsed


def test_a_config_without_node_id_takes_the_machine_id_below_its_root(tmp_path: Path) -> None:
    root = root_with(tmp_path, MACHINE + "\n")
    config = from_dict({"root": str(root)})
    assert config.node_id == expected(MACHINE)
    assert config.node_id_warning is None
    assert config.topic_root.endswith("/" + expected(MACHINE))
    assert from_dict({"root": str(root), "node_id": "line-a-7"}).node_id == "line-a-7"


def test_a_new_root_derives_the_id_anew(tmp_path: Path) -> None:
    """``--root`` rebuilds the config from ``raw`` (cli.service.command_config): the id comes
    from the new root's machine id, not the file's root's."""
    first = from_dict({"root": str(root_with(tmp_path, MACHINE, "a"))})
    second = from_dict({**first.raw, "root": str(root_with(tmp_path, OTHER, "b"))})
    assert (first.node_id, second.node_id) == (expected(MACHINE), expected(OTHER))


@pytest.mark.parametrize(("content", "why"), [
    (None, "cannot be read (No such file or directory)"),
    ("uninitialized\n", "holds no machine id (empty, uninitialized or malformed)")])
def test_without_a_machine_id_the_hostname_alone_and_a_warning(
        tmp_path: Path, content: str | None, why: str) -> None:
    root = root_with(tmp_path, content)
    config = from_dict({"root": str(root)})
    host = socket.gethostname()
    assert config.node_id == host
    assert config.node_id_warning == (
        f"node_id: /etc/machine-id below {root} {why}: the default node id is the hostname "
        f"alone ({host}), which every device with this hostname shares; set node_id in "
        "agent.yaml")
    assert from_dict({"root": str(root), "node_id": "set"}).node_id_warning is None


def test_config_node_id_prints_the_id_run_would_use(tmp_path: Path) -> None:
    root = root_with(tmp_path, MACHINE)
    config = tmp_path / "agent.yaml"
    config.write_text(f"root: {root}\n")
    result = edge_agent("config", "node-id", "--config", config)
    assert (result.returncode, result.stdout, result.stderr) == (0, expected(MACHINE) + "\n",
                                                                 "")
    assert load_config(str(config)).node_id == expected(MACHINE)
    as_json = json.loads(edge_agent("config", "node-id", "--config", config, "--json").stdout)
    assert as_json == {"node_id": expected(MACHINE), "file": str(config), "derived": True,
                       "warning": None}
    config.write_text(f"root: {root}\nnode_id: kept-1\n")
    assert edge_agent("config", "node-id", "--config", config).stdout == "kept-1\n"


def test_config_node_id_warns_on_stderr_and_refuses_a_bad_file(tmp_path: Path) -> None:
    config = tmp_path / "agent.yaml"
    config.write_text(f"root: {root_with(tmp_path, None)}\n")
    result = edge_agent("config", "node-id", "--config", config)
    assert result.returncode == 0
    assert result.stdout == socket.gethostname() + "\n"
    assert result.stderr.startswith("warning: node_id: /etc/machine-id below "), result.stderr
    config.write_text("node_id: a/b\n")
    bad = edge_agent("config", "node-id", "--config", config)
    assert bad.returncode == 2 and bad.stdout == ""
    assert f"{config}: node_id: 'a/b' is not allowed" in bad.stderr, bad.stderr
