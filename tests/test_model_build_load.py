"""``model build --config``: the new version goes into the data plane that runs for that
config, through its load call (model control is explicit), with the ready file and control
token the supervisor keeps in <state_dir>/serve; a version the server refuses is removed."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import yaml

from agent.cli import main
from agent.inference.demo_model import DEMO_MODEL_PATH
from agent.serving.http_client import HttpClient
from tests.agent_process import agent_config
from tests.test_serve_process import serve_process

GATE = "top1=0,cosine=0.9,speed=0"  # judged elsewhere; here the load is under test


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Path, dict[str, str]]]:
    """``edge-agent serve`` as ``run`` starts it: ready file and control token in
    <state_dir>/serve.  Yields the config file and the ready file's addresses."""
    serve = Path(agent_config(tmp_path, 1883)["state_dir"]) / "serve"
    serve.mkdir(parents=True)
    (serve / "control-token").write_text("control-token\n")
    (serve / "control-token").chmod(0o600)
    with serve_process(tmp_path, serve / "ready.json",
                       ["--token-file", str(serve / "control-token")]) as plane:
        yield plane["config"], plane


def inputs(directory: Path) -> Path:
    directory.mkdir()
    for i in range(4):
        np.save(directory / f"{i}.npy", np.random.default_rng(i).standard_normal(
            (1, 3, 64, 64), np.float32))
    return directory


def build_demo(tmp_path: Path, config: Path, *extra: str) -> int:
    """``model build`` of a copy of the demo model as ``demo``, loaded through ``config``."""
    source = shutil.copy(DEMO_MODEL_PATH, tmp_path / "demo.onnx")
    return main(["model", "build", str(source), "--name", "demo", "--calibration",
                 str(inputs(tmp_path / "inputs")), "--config", str(config), "--gate", GATE,
                 *extra])


def test_a_passing_build_is_loaded_by_the_running_data_plane(
        served: tuple[Path, dict[str, str]], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    config, addresses = served
    status = build_demo(tmp_path, config, "--json")
    report = json.loads(capsys.readouterr().out)
    assert status == 0, report
    assert report["version"] == 2  # the built-in demo is version 1
    assert report["data_plane"] == f"loaded into the running data plane ({addresses['http']})"
    with HttpClient(f"http://{addresses['http']}") as client:
        assert list(client.model_metadata("demo").versions) == ["2"]


def test_a_version_the_data_plane_refuses_is_removed_again(
        served: tuple[Path, dict[str, str]], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    config, addresses = served
    settings = tmp_path / "state" / "repository" / "demo" / "config.yaml"
    settings.parent.mkdir(parents=True)
    settings.write_text(yaml.safe_dump({"sha256": {2: "0" * 64}}))  # pins another file
    status = build_demo(tmp_path, config)
    out = capsys.readouterr().out
    assert status == 1
    assert f"the running data plane ({addresses['http']}) refused version 2 (" in out
    assert "it was removed again" in out
    assert not (settings.parent / "2").exists()
    with HttpClient(f"http://{addresses['http']}") as client:
        assert list(client.model_metadata("demo").versions) == ["1"]


def test_a_build_without_a_running_data_plane_waits_for_its_start(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(agent_config(tmp_path, 1883)))
    status = build_demo(tmp_path, path)
    out = capsys.readouterr().out
    assert status == 0
    assert f"no data plane is running for {path}: it loads version 2 when it starts" in out
    assert (tmp_path / "state" / "repository" / "demo" / "2" / "model.onnx").is_file()
