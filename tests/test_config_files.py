"""``config check`` opens the files a config names as the agent would: a directory, a dangling
link or a FIFO in a file's place (what fails for root too, who reads any mode), a file whose
contents the agent's loader refuses, each is one line naming the key and the file, exit 2."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from cli_helpers import edge_agent
from mqtt_helpers import make_test_ca

from agent.inference.demo_model import DEMO_MODEL_PATH

REPO = Path(__file__).resolve().parents[1]


def check(tmp_path: Path, config: dict[str, Any]) -> tuple[int, list[str], str]:
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(config))
    result = edge_agent("config", "check", "--config", path, cwd=REPO)
    return result.returncode, result.stdout.splitlines(), str(path)


def good(tmp_path: Path) -> dict[str, Any]:
    """Every file key set, to files the agent can use."""
    tls = make_test_ca(tmp_path / "ca")
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    token.chmod(0o600)
    password = tmp_path / "password"
    password.write_text("pw\n")
    models = tmp_path / "models"
    models.mkdir()
    broker_ca = tmp_path / "broker-ca.pem"  # a file per key: a broken one is one key's
    broker_ca.write_bytes(tls.ca.read_bytes())
    return {"inference": {"model": str(DEMO_MODEL_PATH)},
            "serve": {"token_file": str(token),
                      "tls": {"cert": str(tls.server_cert), "key": str(tls.server_key),
                              "client_ca": str(tls.ca)}},
            "mqtt": {"username": "n1", "password_file": str(password),
                     "tls": {"ca": str(broker_ca), "cert": str(tls.client_cert),
                             "key": str(tls.client_key)}},
            "control": {"model_dirs": [str(models)]}}


def directory(path: Path) -> str:
    path.unlink()
    path.mkdir()
    return "is a directory, not a file"


def dangling(path: Path) -> str:
    path.unlink()
    path.symlink_to(path.parent / "gone")
    return "cannot read it: No such file or directory"


def fifo(path: Path) -> str:
    path.unlink()
    os.mkfifo(path)
    return "is a FIFO, not a file"


FILE_KEYS = [("inference", "model"), ("serve", "token_file"), ("serve", "tls", "cert"),
             ("serve", "tls", "key"), ("serve", "tls", "client_ca"),
             ("mqtt", "password_file"), ("mqtt", "tls", "ca"), ("mqtt", "tls", "cert"),
             ("mqtt", "tls", "key")]


def test_a_config_whose_files_all_serve_is_ok(tmp_path: Path) -> None:
    code, lines, path = check(tmp_path, good(tmp_path))
    assert (code, lines) == (0, [f"{path}: ok"])


@pytest.mark.parametrize("breaks", [directory, dangling, fifo], ids=lambda f: f.__name__)
@pytest.mark.parametrize("key", FILE_KEYS, ids=".".join)
def test_a_file_the_agent_cannot_open_is_named_with_its_key(
        tmp_path: Path, key: tuple[str, ...], breaks: Callable[[Path], str]) -> None:
    config = good(tmp_path)
    *sections, name = key
    holder = config
    for section in sections:
        holder = holder[section]
    if key == ("inference", "model"):  # a copy: the bundled model stays as it is
        copy = tmp_path / "model.onnx"
        copy.write_bytes(DEMO_MODEL_PATH.read_bytes())
        holder[name] = str(copy)
    file = Path(holder[name])
    said = breaks(file)
    code, lines, path = check(tmp_path, config)
    assert code == 2
    where = ".".join(key)
    if key == ("inference", "model"):  # open_model's own words
        said = {"is a directory, not a file": "is not a regular file; refused",
                "is a FIFO, not a file": "is not a regular file; refused"}.get(said, said)
    assert lines == [f"{path}: {where}: {file}: {said}"]


def test_contents_the_agent_refuses(tmp_path: Path) -> None:
    config = good(tmp_path)
    Path(config["serve"]["token_file"]).write_text("\n")
    Path(config["mqtt"]["tls"]["cert"]).write_text("not a certificate\n")
    code, lines, path = check(tmp_path, config)
    assert code == 2
    assert len(lines) == 2, lines
    assert lines[0] == (f"{path}: serve.token_file: {config['serve']['token_file']}: is "
                        "empty: no token, so nobody may load or unload models")
    tls = config["mqtt"]["tls"]
    assert lines[1].startswith(f"{path}: mqtt.tls: {tls['ca']}, {tls['cert']}, {tls['key']}: "
                               "do not load: ")


def test_a_pinned_model_that_does_not_match(tmp_path: Path) -> None:
    config = good(tmp_path)
    digest = hashlib.sha256(DEMO_MODEL_PATH.read_bytes()).hexdigest()
    config["inference"]["sha256"] = "0" * 64
    code, lines, path = check(tmp_path, config)
    assert (code, lines) == (2, [f"{path}: inference.model: {DEMO_MODEL_PATH} has sha256 "
                                 f"{digest}, but inference.sha256 pins {'0' * 64}; refused"])


def test_directories_and_the_converter(tmp_path: Path) -> None:
    config = good(tmp_path)
    (tmp_path / "not-python").write_text("")
    (tmp_path / "empty").mkdir()
    config["control"]["model_dirs"].append(str(tmp_path / "gone"))
    config["model_build"] = {"rknn_python": str(tmp_path / "not-python")}
    config["inference"]["source"] = f"npy:{tmp_path / 'empty'}"
    code, lines, path = check(tmp_path, config)
    assert code == 2
    assert lines[0] == f"{path}: inference.source: {tmp_path / 'empty'}: no .npy files"
    assert lines[1] == f"{path}: control.model_dirs[1]: {tmp_path / 'gone'}: no such directory"
    assert lines[2].startswith(f"{path}: model_build.rknn_python: {tmp_path / 'not-python'} "
                               "is not an executable python")
    assert len(lines) == 3


def test_a_token_file_named_but_missing_is_a_problem_the_default_one_is_not(
        tmp_path: Path) -> None:
    config = good(tmp_path)
    Path(config["serve"]["token_file"]).unlink()
    code, lines, path = check(tmp_path, config)
    assert (code, lines) == (2, [f"{path}: serve.token_file: {config['serve']['token_file']}: "
                                 "cannot read it: No such file or directory"])
    if not Path("/etc/edge-agent/serve-token").exists():  # a dev checkout: not configured yet
        del config["serve"]["token_file"]
        assert check(tmp_path, config)[:2] == (0, [f"{path}: ok"])


def test_json_lists_each_problem(tmp_path: Path) -> None:
    config = good(tmp_path)
    dangling(Path(config["mqtt"]["password_file"]))
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(config))
    result = edge_agent("config", "check", "--config", path, "--json", cwd=REPO)
    assert result.returncode == 2
    assert json.loads(result.stdout)["problems"] == [
        f"{path}: mqtt.password_file: {config['mqtt']['password_file']}: cannot read it: "
        "No such file or directory"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file of any mode")
def test_a_file_of_a_mode_the_agent_cannot_read(tmp_path: Path) -> None:
    config = good(tmp_path)
    Path(config["serve"]["token_file"]).chmod(0)
    code, lines, path = check(tmp_path, config)
    assert (code, lines) == (2, [f"{path}: serve.token_file: {config['serve']['token_file']}: "
                                 f"cannot read it: Permission denied (as uid {os.geteuid()}: "
                                 "the installed service runs as root; check its config with "
                                 "sudo)"])


@pytest.mark.parametrize("mode", [0o644, 0o604, 0o620, 0o602], ids=oct)
def test_a_token_file_other_users_may_read_or_change_is_refused(tmp_path: Path,
                                                                mode: int) -> None:
    """A token every local user can read (or a group can rewrite) proves nothing: config
    check names the mode and the fix, and the data plane takes no token from it."""
    from agent.serving.access import Access

    config = good(tmp_path)
    token = Path(config["serve"]["token_file"])
    token.chmod(mode)
    code, lines, path = check(tmp_path, config)
    assert (code, lines) == (2, [f"{path}: serve.token_file: {token}: mode {mode:04o} lets "
                                 "other users read or change it, so it proves nothing; chmod "
                                 "0640 (root and the group of its clients) or 0600"])
    assert Access([token], everything=False).holds("s3cret") is False
    token.chmod(0o640)
    assert check(tmp_path, config)[:2] == (0, [f"{path}: ok"])
    assert Access([token], everything=False).holds("s3cret") is True


def test_the_data_plane_reads_a_fifo_token_file_as_no_token(tmp_path: Path) -> None:
    """The reader config check shares: a FIFO in the token's place must not hang a call."""
    from agent.serving.access import Access

    token = tmp_path / "token"
    os.mkfifo(token)
    access = Access([token], everything=False)
    assert access.holds("anything") is False
