"""install.sh's onnxruntime distribution: the choice for each fixture board (offline, from
the hardware alone), its overrides, the module install.sh runs with the bare system python,
and install.sh's pip steps with that choice (a fake venv python records them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent.discovery import discover
from agent.discovery.onnxruntime_choice import JETSON_AI_LAB, PYPI, Choice, choose
from agent.kernel.fsroot import Root

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
JP6 = f"{JETSON_AI_LAB}/jp6/cu126"


def choice(board: str, **environ: str) -> Choice:
    return choose(discover(Root(FIXTURES / board)), environ)


@pytest.mark.parametrize(("board", "distribution", "index", "why"), [
    ("jetson-agx-orin-jp6", "onnxruntime-gpu", JP6, "JetPack 6.2 (L4T 36.4.3, CUDA 12.6)"),
    ("jetson-orin-nano-jp6", "onnxruntime-gpu", JP6, "CPU-only"),
    ("jetson-xavier-nx-jp5-rt", "onnxruntime", PYPI, "no known Jetson AI Lab index"),
    ("rk3588-vendor", "onnxruntime", PYPI, "rknn-toolkit-lite2"),
    ("rk3588-mainline", "onnxruntime", PYPI, "Teflon"),
    ("x86-server-nvidia", "onnxruntime-gpu", PYPI, "0000:99:00.0 (driver nvidia)"),
    ("x86-edge-npu", "onnxruntime-openvino", PYPI, "Intel NPU (intel_vpu) and Intel GPU"),
    ("bare-vm", "onnxruntime", PYPI, "the CPU provider"),
])
def test_the_choice_for_each_board(board: str, distribution: str, index: str,
                                   why: str) -> None:
    found = choice(board)
    assert (found.distribution, found.index_url) == (distribution, index)
    assert why in found.reason


def test_a_jetpack_6_root_without_cuda_files_maps_l4t_to_the_index(tmp_path: Path) -> None:
    topology = discover(Root(FIXTURES / "jetson-orin-nano-jp6"))
    topology.runtimes.cuda = None  # a container without /usr/local/cuda
    assert choose(topology, {}).index_url == JP6
    topology.board.l4t = "36.3.0"  # JetPack 6.0: CUDA 12.2, cuDNN 8, no known index
    assert choose(topology, {}).distribution == "onnxruntime"


def test_overrides_name_the_distribution_and_the_index() -> None:
    forced = choice("bare-vm", EDGE_AGENT_ONNXRUNTIME="onnxruntime-openvino")
    assert forced == Choice("onnxruntime-openvino", PYPI, forced.reason)
    assert "EDGE_AGENT_ONNXRUNTIME=onnxruntime-openvino" in forced.reason
    mirror = "https://mirror.example/jp6/cu126"
    indexed = choice("jetson-agx-orin-jp6", EDGE_AGENT_ONNXRUNTIME_INDEX=mirror)
    assert (indexed.distribution, indexed.index_url) == ("onnxruntime-gpu", mirror)
    assert choice("x86-edge-npu", EDGE_AGENT_ONNXRUNTIME="auto").distribution == (
        "onnxruntime-openvino")


def test_the_module_runs_on_the_bare_system_python(tmp_path: Path) -> None:
    """install.sh runs it before any venv exists: ``-S`` (no site-packages) proves it
    needs the standard library only."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDGE_AGENT_")}
    result = subprocess.run(
        [sys.executable, "-S", "-m", "agent.discovery.onnxruntime_choice", "--root",
         str(FIXTURES / "jetson-agx-orin-jp6")], cwd=tmp_path, capture_output=True,
        text=True, timeout=120, env={**env, "PYTHONPATH": str(REPO)}, check=False)
    assert result.returncode == 0, result.stderr
    distribution, index, reason = result.stdout.splitlines()
    assert (distribution, index) == ("onnxruntime-gpu", JP6) and "JetPack 6.2" in reason
    as_json = subprocess.run(
        [sys.executable, "-S", "-m", "agent.discovery.onnxruntime_choice", "--json",
         "--root", str(FIXTURES / "x86-edge-npu")], cwd=tmp_path, capture_output=True,
        text=True, timeout=120, env={**env, "PYTHONPATH": str(REPO)}, check=False)
    assert json.loads(as_json.stdout)["distribution"] == "onnxruntime-openvino"


FAKE_PYTHON = """#!/bin/sh
# a venv python: pip calls are recorded (and fail for {fail}), the rest runs for real
if [ "$1" = -m ] && [ "$2" = pip ]; then
    echo "$*" >> {log}
    case "$*" in *" {fail}"*) exit 1 ;; esac
    exit 0
fi
exec {python} "$@"
"""


def staged_install(tmp_path: Path, fail: str = "no-such-thing", broken_ort: str | None = None,
                   **environ: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """install.sh in DESTDIR mode over a venv whose python is FAKE_PYTHON; ``broken_ort``:
    its onnxruntime does not import, raising that ImportError (as a wheel whose CUDA
    library is missing does)."""
    prefix, stage, log = tmp_path / "opt/edge-agent", tmp_path / "stage", tmp_path / "pip.log"
    bin_dir = Path(f"{stage}{prefix}/bin")
    bin_dir.mkdir(parents=True)
    python = sys.executable
    if broken_ort is not None:  # found before the real one
        shadow = tmp_path / "shadow/onnxruntime"
        shadow.mkdir(parents=True)
        (shadow / "__init__.py").write_text(f"raise ImportError({broken_ort!r})\n")
        python = f"env PYTHONPATH={shadow.parent} {python}"
    (bin_dir / "python").write_text(FAKE_PYTHON.format(log=log, fail=fail, python=python))
    (bin_dir / "python").chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME") and not k.startswith("EDGE_AGENT_")}
    result = subprocess.run(
        [str(REPO / "install.sh"), "--prefix", str(prefix), "--no-start"], cwd=tmp_path,
        capture_output=True, text=True, timeout=300, check=False,
        env={**env, "DESTDIR": str(stage), "PYTHON": sys.executable, **environ})
    calls = log.read_text().splitlines() if log.exists() else []
    # the client library's own install (numpy only, --no-deps) follows the agent's whatever
    # onnxruntime was chosen: the calls about onnxruntime are the others
    client = [line for line in calls if line.endswith("/clients/python")]
    if result.returncode == 0:
        assert len(client) == 1, calls
    return result, [line for line in calls if line not in client]


def test_a_destdir_build_installs_plain_onnxruntime_and_says_why(tmp_path: Path) -> None:
    result, pip = staged_install(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "install.sh: onnxruntime: onnxruntime from PyPI (a DESTDIR build is not the " \
           "board it will run on" in result.stdout
    assert [line for line in pip if "--no-deps" in line] == []  # the plain path, unchanged
    assert "install.sh: onnxruntime: installed onnxruntime " in result.stdout


def test_a_chosen_distribution_replaces_onnxruntime_in_the_requirements(
        tmp_path: Path) -> None:
    result, pip = staged_install(tmp_path, EDGE_AGENT_ONNXRUNTIME="onnxruntime-openvino")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "install.sh: onnxruntime: onnxruntime-openvino from PyPI (EDGE_AGENT_ONNXRUNTIME=" \
           in result.stdout
    # pip's own upgrade runs first unless the venv already has the pinned pip
    pip = [line for line in pip if not line.endswith(" pip")]
    # this interpreter has plain onnxruntime (as an older install would): it goes first,
    # and the chosen build is reinstalled over the files its removal took
    assert pip == [
        "-m pip uninstall -y -q onnxruntime", pip[1], pip[2], pip[3],
        f"-m pip install -q --force-reinstall --no-deps {pip[3].split(' -q ', 1)[1]}"], pip
    no_deps, requirements, distribution = pip[1:4]
    assert "--no-deps" in no_deps and "--no-compile" in no_deps
    assert "paho-mqtt" in requirements and "onnxruntime" not in requirements
    assert distribution.endswith(" onnxruntime-openvino")


def test_a_distribution_that_does_not_install_falls_back_to_onnxruntime(
        tmp_path: Path) -> None:
    result, pip = staged_install(tmp_path, fail="onnxruntime-gpu",
                                 EDGE_AGENT_ONNXRUNTIME="onnxruntime-gpu",
                                 EDGE_AGENT_ONNXRUNTIME_INDEX="https://pypi.example/jp6/cu126")
    assert result.returncode == 0, result.stdout + result.stderr
    assert any("--extra-index-url https://pypi.example/jp6/cu126 onnxruntime-gpu" in line
               for line in pip)
    assert pip[-1].endswith(" onnxruntime")
    assert "onnxruntime-gpu did not install; falling back to PyPI's onnxruntime" in (
        result.stderr)
    assert "install.sh: onnxruntime: installed onnxruntime " in result.stdout


def test_an_unknown_distribution_is_refused(tmp_path: Path) -> None:
    result, pip = staged_install(tmp_path, EDGE_AGENT_ONNXRUNTIME="tensorflow")
    assert result.returncode == 2 and pip == []
    assert "--onnxruntime must be auto or an onnxruntime distribution" in result.stderr


@pytest.mark.parametrize(("chosen", "hint"), [
    ("onnxruntime", ""),
    ("onnxruntime-gpu", " (--onnxruntime onnxruntime installs PyPI's CPU build)")])
def test_an_onnxruntime_that_does_not_import_fails_the_install_with_the_reason(
        tmp_path: Path, chosen: str, hint: str) -> None:
    why = "libcudart.so.12: cannot open shared object file: No such file or directory"
    result, _ = staged_install(tmp_path, broken_ort=why, EDGE_AGENT_ONNXRUNTIME=chosen)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.splitlines()[-1] == (
        f"install.sh: onnxruntime: {chosen} was installed but does not import: "
        f"ImportError: {why}{hint}")
    assert "onnxruntime: installed" not in result.stdout
    assert "edge-agent staged" not in result.stdout  # it stopped there
