"""``model tune --variants``: the versions ``model build`` made are one more dimension of the
search.  Which versions are variants (and the precision each is served with), the grid and
coordinate descent over them, the config.yaml a variant's candidate makes, and on a real
model with a real INT8 build made by the real build code: both measured, the one written is
the one the report measured best and the repository serves it alone, rollback restores the
old file byte for byte."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from agent.modelbuild.build import build_candidate
from agent.modelbuild.install import install
from agent.modelbuild.request import BuildRequest, Gate
from agent.modeltune.plane import ScratchPlane, stage_model
from agent.modeltune.search import Result, choose, coordinate_descent, exhaustive
from agent.modeltune.space import Candidate, grid, with_candidate
from agent.modeltune.variants import NoVariantsError, Variant, config_precision, find
from agent.serving.repository import scan_model
from agent.serving.settings import parse_settings
from agent.serving.versions import file_sha256
from tests import onnx_models
from tests.cli_helpers import edge_agent
from tests.test_model_tune import best_of


def _version(directory: Path, number: int, model: bytes, build: dict[str, object] | None
             ) -> Path:
    (directory / str(number)).mkdir(parents=True)
    path = directory / str(number) / "model.onnx"
    path.write_bytes(model)
    if build is not None:
        (directory / str(number) / "build.json").write_text(json.dumps(build))
    return path


def test_the_variants_are_the_passed_builds_their_source_and_the_served_version(
        tmp_path: Path) -> None:
    source = b"the fp32 original"
    digest = file_sha256(_version(tmp_path / "scratch", 1, source, None))
    built = {"passed": True, "source": {"sha256": digest}, "chosen": "u8s8-per-channel",
             "target": "cpu", "precision": "int8"}
    versions = {
        1: _version(tmp_path, 1, source, None),  # the builds' source
        2: _version(tmp_path, 2, b"int8", built),
        3: _version(tmp_path, 3, b"failed", {**built, "passed": False}),
        4: _version(tmp_path, 4, b"trt", {**built, "target": "tensorrt",
                                          "chosen": "s8s8-symmetric-per-channel"}),
        5: _version(tmp_path, 5, b"another model entirely", None),
        6: _version(tmp_path, 6, b"a retrained one, served", None),
        7: _version(tmp_path, 7, b"unreadable report", None),
        8: _version(tmp_path, 8, b"odd", {"passed": True, "target": "cpu\n\x1b[2J",
                                           "chosen": ["not", "a", "word"]}),
    }
    (tmp_path / "7" / "build.json").write_text("{not json")
    assert find("m", versions, 6) == {
        1: Variant(1, "build source"),
        2: Variant(2, "int8 u8s8-per-channel", "cpu", None),
        4: Variant(4, "int8 s8s8-symmetric-per-channel", "tensorrt", "int8"),
        6: Variant(6, "served"),
        8: Variant(8, "build", "cpu[2J")}  # a report's words shown printable, or "build"
    with pytest.raises(NoVariantsError, match=r"^model m: --variants: model build has made "
                       r"no variant of it .*; make one with `edge-agent model build SRC\.onnx "
                       r"--name m --calibration DIR"):
        find("m", {k: versions[k] for k in (1, 3, 5, 7)}, 5)


@pytest.mark.parametrize(("target", "precision", "key"), [
    ("cpu", "int8", None), ("cpu", "fp16", None), ("tensorrt", "int8", "int8"),
    ("tensorrt", "fp16", "fp16"), ("openvino", "int8", None), ("openvino", "fp16", "fp16"),
    ("rknn:rk3588", "int8", "int8"), ("tensorrt", "int4", None)])
def test_a_build_is_served_with_the_precision_its_engine_needs(
        target: str, precision: str, key: str | None) -> None:
    assert config_precision(target, precision) == key


def test_a_variant_candidate_pins_its_version_and_precision_and_keeps_the_rest() -> None:
    original = {"max_run_ms": 100, "version_policy": {"latest": 2}, "precision": "fp16",
                "sha256": {1: "a" * 64}}
    config = with_candidate(original, Candidate(2, 1, 0, 0, 4), "gpu:0", "int8")
    assert config == {"max_run_ms": 100, "version_policy": {"specific": [4]},
                      "precision": "int8", "sha256": {1: "a" * 64}, "max_batch_size": 0,
                      "instances": [{"count": 1, "threads": 2, "device": "gpu:0"}]}
    assert parse_settings(config, "config.yaml").version_policy.select([1, 2, 4]) == [4]
    # None: the config's own precision stays; version 0: the config's own policy
    kept = with_candidate(original, Candidate(2, 1, 0, 0), None, None)
    assert kept["precision"] == "fp16" and kept["version_policy"] == {"latest": 2}


SPACE = {"version": (1, 2), "threads": (1, 2), "count": (1,), "max_batch_size": (1, 4),
         "max_queue_delay_us": (0, 500)}


def simulated(candidate: Candidate) -> Result:
    """Version 2 (the INT8 build) serves twice as much; threads and batch help a little,
    waiting costs a little."""
    rps = 100.0 * candidate.version * (1 + 0.1 * candidate.threads) * (
        1 + 0.05 * candidate.max_batch_size) * (1 - candidate.max_queue_delay_us / 10_000)
    return Result(candidate, 1000 / rps, rps, rps, True, "closed loop, 1 clients")


def test_the_grid_and_both_searches_treat_the_variant_as_a_dimension() -> None:
    points = grid(SPACE, 2)
    assert len(points) == 2 * 2 * (1 + 2)  # versions x threads x (batch 1; batch 4 x delays)
    assert {p.version for p in points} == {1, 2}
    everything = exhaustive(points, simulated)
    assert max(everything, key=lambda r: r.goodput_rps).candidate.version == 2
    found = coordinate_descent(SPACE, 2, simulated, lambda: False, waits=False)
    assert found[0].candidate == Candidate(2, 1, 1, 0, 1)  # starts at the lowest version
    assert {r.candidate.version for r in found} == {1, 2}
    assert choose(found).candidate == Candidate(2, 1, 4, 0, 2)
    assert len(found) < len(points)


def test_a_space_without_the_variant_dimension_searches_the_served_version() -> None:
    space = {k: v for k, v in SPACE.items() if k != "version"}
    assert {p.version for p in grid(space, 2)} == {0}
    assert {r.candidate.version for r in coordinate_descent(space, 2, lambda c: Result(
        c, 1.0, 1.0, 1.0, True, ""), lambda: False)} == {0}


FAST = ("--window-s", "0.2", "--space", "threads=1", "--space", "count=1", "--space",
        "batch=1", "--space", "delay_us=0")
ORIGINAL = b"# the operator's file\nmax_run_ms: 4000\nqos: {class: throughput}\n"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A repository whose model ``cnn`` has version 1 (fp32) and version 2, the INT8 build
    ``model build``'s own code made of it and installed."""
    root = tmp_path_factory.mktemp("built")
    source = onnx_models.conv_net(root / "cnn.onnx", batch="N")
    calibration = root / "calibration"
    calibration.mkdir()
    rng = np.random.default_rng(3)
    for i in range(6):
        np.save(calibration / f"{i}.npy", rng.standard_normal((1, 3, 64, 64)).astype(
            np.float32))
    repository = root / "repository"
    (repository / "cnn" / "1").mkdir(parents=True)
    shutil.copyfile(source, repository / "cnn" / "1" / "model.onnx")
    work = root / "work"
    work.mkdir()
    report = build_candidate(BuildRequest(source, "cnn", calibration=calibration,
                                          gate=Gate(0.0, 0.0, 0.0)), work)
    assert report.passed, report.reason
    assert install(report, work, repository) == 2
    return repository


def test_the_tuner_measures_each_build_and_writes_the_best_and_rollback_restores(
        built: Path, tmp_path: Path) -> None:
    repository = tmp_path / "repository"
    shutil.copytree(built, repository)
    config = repository / "cnn" / "config.yaml"
    config.write_bytes(ORIGINAL)
    result = edge_agent("model", "tune", "cnn", "--repository", repository, "--variants",
                        "--exhaustive", *FAST, "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    int8 = json.loads((repository / "cnn" / "2" / "build.json").read_text())["chosen"]
    assert report["variants"] == [
        {"version": 1, "name": "build source", "target": None, "precision": None},
        {"version": 2, "name": f"int8 {int8}", "target": "cpu", "precision": None}]
    candidates = report["candidates"]
    # both measured, each by the data plane serving that version alone (else a problem)
    assert [c["variant"]["version"] for c in candidates] == [1, 2]
    assert all("problem" not in c and c["met"] and c["throughput_rps"] > 0
               for c in candidates)
    assert [c["settings"]["version_policy"] for c in candidates] == [
        {"specific": [1]}, {"specific": [2]}]
    chosen = report["chosen"]
    row = [c["settings"] for c in candidates].index(chosen)
    assert candidates[row] in best_of(candidates)
    assert report["p99_ms"] == min(c["p99_ms"] for c in best_of(candidates))
    written = yaml.safe_load(config.read_text())
    assert written["version_policy"] == chosen["version_policy"]
    assert written["max_run_ms"] == 4000 and written["qos"] == {"class": "throughput"}
    entry = scan_model(repository, {}, "cnn")
    assert entry is not None and not entry.error
    assert list(entry.wanted()) == chosen["version_policy"]["specific"]  # served alone

    text = edge_agent("model", "tune", "cnn", "--repository", repository, "--variants",
                      *FAST, "--budget-s", "0.1")
    assert text.returncode == 0, text.stderr
    assert "variant" in text.stdout.splitlines()[1]
    assert f"note: variants: version 1 build source; version 2 int8 {int8} (cpu)" \
        in text.stdout

    rolled = edge_agent("model", "tune", "cnn", "--repository", repository, "--rollback")
    assert rolled.returncode == 0, rolled.stderr
    assert config.read_bytes() == ORIGINAL
    assert sorted(p.name for p in (repository / "cnn").iterdir()) == [
        "1", "2", "config.yaml"]


def test_variants_without_a_build_is_one_line_on_how_to_make_one(tmp_path: Path) -> None:
    repository = tmp_path / "repository"
    (repository / "mlp" / "1").mkdir(parents=True)
    onnx_models.mlp(repository / "mlp" / "1" / "model.onnx")
    result = edge_agent("model", "tune", "mlp", "--repository", repository, "--variants")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "edge-agent model: model mlp: --variants: model build has made no variant of it "
        "(no version with a passed build.json); make one with `edge-agent model build "
        "SRC.onnx --name mlp --calibration DIR [--target T] [--precision int8|fp16]`"]
    assert sorted(p.name for p in (repository / "mlp").iterdir()) == ["1"]


def test_the_scratch_plane_serves_a_variant_alone_or_says_what_it_serves(
        tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    files = {n: onnx_models.mlp(models / f"{n}.onnx") for n in (1, 2)}
    config_file = stage_model(tmp_path / "scratch", "mlp", files, None, {}, 1)
    assert sorted(p.name for p in config_file.parent.iterdir()) == ["1", "2", "config.yaml"]
    with ScratchPlane(tmp_path / "scratch") as plane:
        assert plane.reload("mlp", config_file, with_candidate(
            {}, Candidate(1, 1, 0, 0, 2), None), 2) == ""
        with plane.client() as client:
            assert client.model_metadata("mlp").versions == ("2",)
        assert plane.reload("mlp", config_file, {"version_policy": "all"}, 2) == \
            "the data plane serves versions 1, 2, not 2 alone"
