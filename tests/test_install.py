"""Packaging and the installer: the wheel a device installs, run from outside the checkout,
and install.sh's help, options, Debian packages and DESTDIR relocation.

Everything runs offline. The wheel is built without build isolation (the dev venv carries
setuptools), and each fresh venv gets its dependencies from this venv's site-packages
through a .pth file naming a directory of links to everything there but edge-agent itself,
so the package under test is the one installed, never the checkout or the editable install.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import site
import socket
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import yaml
from mqtt_helpers import Broker, Subscriber, wait_until
from onnx_models import conv_net

REPO = Path(__file__).resolve().parents[1]
PACKAGE = ("pyproject.toml", "README.md", "agent", "profiles", "dts-overlays")
INSTALLER = (*PACKAGE, "install.sh", "constraints", "systemd", "scripts", "clients")
# building the wheel and a fresh venv runs several pip calls of up to 300 s each
pytestmark = pytest.mark.timeout(1200)

NOT_DEPENDENCIES = ("__editable__", "edge_agent", "agent", "__pycache__")


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without what would put the checkout on the path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return {**env, **extra}


def copy_tree(names: tuple[str, ...], dest: Path) -> Path:
    """The checkout's files a build needs, so the build leaves nothing in the checkout."""
    dest.mkdir(parents=True)
    for name in names:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, dest / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(source, dest / name)
    return dest


def fresh_venv(path: Path, deps: Path) -> Path:
    """A venv without pip whose only link to this one is the dependency directory."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True,
                   timeout=60)
    purelib = subprocess.run([str(path / "bin" / "python"), "-c",
                              "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True, timeout=60,
                             env=clean_env()).stdout.strip()
    Path(purelib, "edge-agent-test-deps.pth").write_text(f"{deps}\n")
    return path


def run(command: list[str], cwd: Path, timeout: float = 120,
        **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=clean_env(**env), check=False)


@pytest.fixture(scope="module")
def deps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Links to this venv's installed distributions, edge-agent's own files left out."""
    directory = tmp_path_factory.mktemp("deps")
    for packages in site.getsitepackages():  # Debian's list names directories never made
        for entry in sorted(Path(packages).iterdir()) if Path(packages).is_dir() else []:
            if entry.name.startswith(NOT_DEPENDENCIES) or entry.suffix == ".pth":
                continue
            if not (directory / entry.name).exists():
                (directory / entry.name).symlink_to(entry)
    return directory


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel ``pip install .`` builds on a device, built here offline."""
    version = importlib.metadata.version("setuptools")
    if int(version.split(".")[0]) < 77:
        pytest.fail(f"setuptools {version} cannot build edge-agent (pyproject.toml needs "
                    ">= 77): run ./install.sh --dev, which installs the dev tools")
    top = tmp_path_factory.mktemp("wheel")
    source = copy_tree(PACKAGE, top / "src")
    result = run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                  "--no-build-isolation", "--no-index", "-w", str(top / "dist"),
                  str(source)], cwd=top, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    (built,) = (top / "dist").glob("edge_agent-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel: Path, deps: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the wheel installed, as a device has it; its bin/ directory."""
    top = tmp_path_factory.mktemp("installed")
    venv = fresh_venv(top / "venv", deps)
    result = run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps",
                  "--no-index", str(wheel)], cwd=top, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    where = run([str(venv / "bin" / "python"), "-c", "import agent; print(agent.__file__)"],
                cwd=top)
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(venv), where.stdout  # not the checkout
    return venv / "bin"


def test_every_source_directory_is_a_shipped_package(wheel: Path) -> None:
    shipped = set(zipfile.ZipFile(wheel).namelist())
    problems = []
    for directory, subdirs, files in os.walk(REPO / "agent"):
        subdirs[:] = [d for d in subdirs if d != "__pycache__"]
        here = Path(directory).relative_to(REPO).as_posix()
        sources = sorted(f for f in files if f.endswith(".py"))
        if not sources:
            continue
        if "__init__.py" not in sources:
            problems.append(f"{here}/ has no __init__.py (namespaces = false: not shipped)")
        problems += [f"{here}/{name} is not in the wheel" for name in sources
                     if f"{here}/{name}" not in shipped]
    assert not problems, "\n".join(problems)
    models = sorted((REPO / "agent/inference/models").glob("*.onnx"))
    assert models
    for model in models:
        assert model.relative_to(REPO).as_posix() in shipped  # package data


def test_installed_discover_json_runs_outside_the_checkout(installed: Path,
                                                           tmp_path: Path) -> None:
    result = run([str(installed / "edge-agent"), "discover", "--json"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    topology = json.loads(result.stdout)
    assert topology["schema"] == "topology/1"
    assert topology["board"]["arch"] == os.uname().machine


def test_the_installed_agent_has_its_profiles_and_overlay_sources(installed: Path,
                                                                  tmp_path: Path) -> None:
    """A wheel installed with plain pip (no install.sh) plans profiles and finds overlays."""
    listed = run([str(installed / "edge-agent"), "profile", "list", "--json"], cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    names = {p["name"] for p in json.loads(listed.stdout)["profiles"]}
    assert names == {p.stem for p in (REPO / "profiles").glob("*.yaml")}
    plan = run([str(installed / "edge-agent"), "profile", "plan", "auto", "--json"],
               cwd=tmp_path)
    assert plan.returncode == 0, plan.stderr
    overlays = run([str(installed / "python"), "-c", "from agent.overlays.build import "
                    "entries; print(sorted(entries()))"], cwd=tmp_path)
    assert overlays.returncode == 0, overlays.stderr
    assert overlays.stdout.strip() == str(sorted(
        p.stem for p in (REPO / "dts-overlays").glob("*.dts")))


def test_installed_model_build_runs_outside_the_checkout(installed: Path,
                                                         tmp_path: Path) -> None:
    """The wheel ships the build (and the .rknn converter's worker beside it)."""
    model = conv_net(tmp_path / "cnn.onnx")
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    for i in range(4):
        np.save(inputs / f"{i}.npy", np.random.default_rng(i).standard_normal(
            (1, 3, 64, 64), np.float32))
    result = run([str(installed / "edge-agent"), "model", "build", str(model), "--name", "cnn",
                  "--calibration", str(inputs), "--repository", str(tmp_path / "repo"),
                  "--gate", "top1=0,cosine=0.9,speed=0", "--json"], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads(result.stdout)["version"] == 1
    assert (tmp_path / "repo" / "cnn" / "1" / "model.onnx").is_file()
    worker = run([str(installed / "python"), "-c", "from agent.modelbuild import rknn; "
                  "print(rknn.WORKER.is_file())"], cwd=tmp_path)
    assert worker.stdout.strip() == "True", worker.stderr


def test_installed_run_reports_to_a_broker(installed: Path, tmp_path: Path,
                                           broker: Broker) -> None:
    config = tmp_path / "agent.yaml"
    state = tmp_path / "state"
    config.write_text(yaml.safe_dump({
        "node_id": "pkg-1", "fleet": "lab", "state_dir": str(state),
        "mqtt": {"host": "127.0.0.1", "port": broker.port,
                 "reconnect": {"min_s": 0.1, "max_s": 0.5}},
        "telemetry": {"interval_s": 0.2}}))
    subscriber = Subscriber(broker, ["edge/v1/lab/pkg-1/#"])
    try:
        assert subscriber.subscribed.wait(10)
        result = run([str(installed / "edge-agent"), "run", "--config", str(config),
                      "--seconds", "3"], cwd=tmp_path)
        assert result.returncode == 0, result.stdout + result.stderr
        assert wait_until(lambda: len(subscriber.on("telemetry")) >= 3, 5), \
            result.stdout + result.stderr
    finally:
        subscriber.close()
    status = run([str(installed / "edge-agent"), "status", "--state-dir", str(state),
                  "--json"], cwd=tmp_path)
    assert status.returncode == 1, status.stderr  # 1: not running, it stopped cleanly
    state_now = json.loads(status.stdout)
    assert state_now["stopped"] is True, status.stdout
    assert state_now["link"]["acked"] >= 3, status.stdout
    assert state_now["outbox"]["depth"] == 0, status.stdout  # everything acknowledged
    assert state_now["problems"] == [], status.stdout  # its profile was found and planned


def test_installed_fleet_keygen(installed: Path, tmp_path: Path) -> None:
    key = tmp_path / "keys" / "operator.key"
    key.parent.mkdir()
    result = run([str(installed / "edge-agent"), "fleet", "keygen", "--out", str(key)],
                 cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert key.read_text().startswith("-----BEGIN PRIVATE KEY-----")
    assert "trusted_keys" in result.stdout


# -- install.sh ------------------------------------------------------------------------------


def test_help_prints_the_header_and_exits_0() -> None:
    result = run([str(REPO / "install.sh"), "--help"], cwd=REPO)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "edge-agent installer."
    assert any("--prefix DIR" in line for line in lines)
    assert not [line for line in lines if line.startswith(("set -", "#"))], result.stdout


def test_an_unknown_option_exits_2_with_the_allowed_list() -> None:
    result = run([str(REPO / "install.sh"), "--frobnicate"], cwd=REPO)
    assert result.returncode == 2
    assert "unknown option '--frobnicate'" in result.stderr
    for option in ("--dev", "--prefix DIR", "--no-start", "--uninstall", "--purge", "--help"):
        assert option in result.stderr


def test_dev_asks_for_mosquitto_clients_once_each(tmp_path: Path) -> None:
    """With every Debian package missing (a dpkg that knows none), --dev asks apt-get for
    each package the tests and the README need, each once; a fake apt-get records it and
    stops the run there (as non-root, the script names them and stops instead)."""
    fake = tmp_path / "bin"
    fake.mkdir()
    log = tmp_path / "apt.log"
    (fake / "dpkg").write_text("#!/bin/sh\nexit 1\n")
    (fake / "apt-get").write_text(f'#!/bin/sh\necho "$*" >> {log}\n'
                                  '[ "$1" = update ] && exit 0\nexit 1\n')
    for script in fake.iterdir():
        script.chmod(0o755)
    checkout = copy_tree(("install.sh",), tmp_path / "checkout")
    result = run([str(checkout / "install.sh"), "--dev"], cwd=tmp_path,
                 PATH=f"{fake}:{os.environ['PATH']}", PYTHON=sys.executable)
    assert result.returncode != 0
    if os.geteuid() == 0:
        asked = log.read_text().splitlines()[-1].split()
    else:
        asked = result.stderr.split("please install these Debian packages first:")[1].split()
    packages = [word for word in asked if not word.startswith("-") and word != "install"]
    for package in ("mosquitto", "mosquitto-clients", "rabbitmq-server", "device-tree-compiler",
                    "libudev1"):
        assert packages.count(package) == 1, packages
    if os.geteuid() == 0:
        assert f"install.sh: installing Debian packages: {' '.join(packages)}" in result.stdout
    assert not (checkout / ".venv").exists()


def test_destdir_install_runs_once_moved_to_its_prefix(tmp_path: Path, deps: Path) -> None:
    if int(importlib.metadata.version("setuptools").split(".")[0]) < 77:
        pytest.fail("setuptools < 77 cannot build edge-agent: run ./install.sh --dev")
    checkout = copy_tree(INSTALLER, tmp_path / "checkout")
    prefix = tmp_path / "opt" / "edge-agent"  # the target path; it does not exist yet
    stage = tmp_path / "stage"
    staged = Path(f"{stage}{prefix}")
    # install.sh's own `python -m venv`, done beforehand with this venv's packages on the
    # path so pip runs offline (install.sh reuses the venv it finds, as on a rerun)
    fresh_venv(staged, deps)
    command = [str(checkout / "install.sh"), "--prefix", str(prefix), "--no-start"]
    offline = {"DESTDIR": str(stage), "PYTHON": sys.executable, "PIP_NO_INDEX": "1",
               "PIP_NO_BUILD_ISOLATION": "0"}
    result = run(command, cwd=tmp_path, timeout=300, **offline)
    assert result.returncode == 0, result.stdout + result.stderr

    # nothing in the venv still names the staging directory: scripts, pyvenv.cfg, .pyc
    naming = [str(p.relative_to(staged)) for p in sorted(staged.rglob("*"))
              if p.is_file() and not p.is_symlink() and str(stage).encode() in p.read_bytes()]
    assert not naming, naming
    assert (staged / "bin" / "edge-agent").read_text().count(f"{prefix}/bin/python") == 1
    unit = (stage / "etc/systemd/system/edge-agent.service").read_text()
    assert f"ExecStart={prefix}/bin/edge-agent run" in unit and str(stage) not in unit
    assert (stage / "etc/systemd/system/edge_agent.slice").read_text().count("[Slice]") == 1
    setup = staged / "share/edge-agent/setup_rknn_converter.sh"
    assert setup.read_bytes() == (REPO / "scripts/setup_rknn_converter.sh").read_bytes()
    assert os.access(setup, os.X_OK)
    written = stage / "etc/edge-agent/agent.yaml"
    config = yaml.safe_load(written.read_text())
    assert config["tuning"]["profile"] == "auto"  # not the build machine's board
    # nor its node id, which would be every device's: each derives its own
    assert "node_id" not in config
    assert "# node_id: unset: each device takes <hostname>-<6 hex digits from its machine " \
        "id>\n" in written.read_text()

    # an existing config is never changed (the node keeps its id): the new default goes beside
    new_default = written.read_text()
    edited = written.read_bytes() + b"node_id: line-a-7\n"
    written.write_bytes(edited)
    again = run(command, cwd=tmp_path, timeout=300, **offline)
    assert again.returncode == 0, again.stdout + again.stderr
    assert written.read_bytes() == edited
    assert written.with_name("agent.yaml.dist").read_text() == new_default

    prefix.parent.mkdir(parents=True)
    staged.rename(prefix)  # what unpacking the package on the device does
    discover = run([str(prefix / "bin" / "edge-agent"), "discover", "--json"], cwd=tmp_path)
    assert discover.returncode == 0, discover.stderr
    assert json.loads(discover.stdout)["schema"] == "topology/1"
    # what install.sh writes into a device's new config: hostname-<sha256(machine-id)[:6]>
    device = tmp_path / "device"
    (device / "etc").mkdir(parents=True)
    (device / "etc/machine-id").write_text("0123456789abcdef0123456789abcdef\n")
    (tmp_path / "device.yaml").write_text(f"root: {device}\n")
    node_id = run([str(prefix / "bin" / "edge-agent"), "config", "node-id", "--config",
                   str(tmp_path / "device.yaml")], cwd=tmp_path)
    assert node_id.returncode == 0, node_id.stderr
    digest = hashlib.sha256(b"0123456789abcdef0123456789abcdef").hexdigest()[:6]
    assert node_id.stdout == f"{socket.gethostname()}-{digest}\n"
    profiles = run([str(prefix / "bin" / "edge-agent"), "profile", "list", "--json"],
                   cwd=tmp_path)
    assert profiles.returncode == 0, profiles.stderr
    dirs = {Path(p["file"]).parent for p in json.loads(profiles.stdout)["profiles"]}
    # the prefix's copy, found through sys.prefix (site profiles in /etc may add to them)
    assert dirs - {Path("/etc/edge-agent/profiles")} == {prefix / "profiles"}
    for package in ("agent", "edge_agent_client"):  # the local socket's client goes along
        where = run([str(prefix / "bin" / "python"), "-c",
                     f"import {package}; print({package}.__file__)"], cwd=tmp_path)
        assert Path(where.stdout.strip()).is_relative_to(prefix), where.stdout + where.stderr
    # one line per step, so a minute of pip is not a minute of silence
    for step in ("install.sh: reusing the venv in ",
                 "install.sh: installing edge-agent and its dependencies with pip (",
                 f"install.sh: relocating the venv from {staged} to {prefix} (DESTDIR)",
                 "install.sh: writing the unit"):
        assert step in result.stdout, result.stdout
