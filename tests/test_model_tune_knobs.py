"""The latency knobs hook of ``model tune``: a ladder of rungs searched as one more dimension
(last, the costliest move), moved only when a candidate's rung differs, the lower rung when
it buys no goodput, and restored whatever ends the tune.  The ladder is a fake that records
its calls (the device's knobs need a real cpufreq/PM QoS); the data plane is real."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent.modeltune.knobs import KnobRungs, KnobSetter
from agent.modeltune.search import Result, choose, coordinate_descent
from agent.modeltune.space import Candidate, grid
from agent.modeltune.tune import TuneError, TuneRequest, tune
from tests import onnx_models


class FakeLadder:
    """LatencyKnobs' shape: ladder(), apply(rung), restore(); every call recorded."""

    def __init__(self, steps: int = 3, refuse: int | None = None) -> None:
        self.steps, self.refuse = steps, refuse
        self.calls: list[str] = []

    def ladder(self) -> list[str]:
        return [f"floor {i}" for i in range(self.steps)]

    def apply(self, rung: int) -> None:
        self.calls.append(f"apply {rung}")
        if rung == self.refuse:
            raise OSError(f"rung {rung} not applied: EBUSY")

    def restore(self) -> None:
        self.calls.append("restore")


def test_the_setter_moves_only_on_a_change_and_restores_on_any_exit() -> None:
    fake = FakeLadder()
    with pytest.raises(RuntimeError), KnobSetter(KnobRungs.of(fake)) as knobs:
        for rung in (0, 0, 2, 2, 1):
            knobs.move(rung)
        assert knobs.label(2) == "floor 2"
        raise RuntimeError("a measurement broke")
    assert fake.calls == ["apply 0", "apply 2", "apply 1", "restore"]
    with KnobSetter(None) as none:  # no ladder: nothing moves, nothing to restore
        none.move(3)
        assert none.label(0) == ""


def test_a_refused_move_is_tried_again_next_time() -> None:
    fake = FakeLadder(refuse=1)
    with KnobSetter(KnobRungs.of(fake)) as knobs:
        with pytest.raises(OSError):
            knobs.move(1)
        fake.refuse = None
        knobs.move(1)
    assert fake.calls == ["apply 1", "apply 1", "restore"]


SPACE = {"threads": (1, 2), "count": (1,), "max_batch_size": (0,),
         "max_queue_delay_us": (0,), "knobs": (0, 1, 2)}


def test_the_knobs_are_swept_last_and_a_rung_that_buys_nothing_is_not_chosen() -> None:
    order: list[Candidate] = []

    def flat(candidate: Candidate) -> Result:
        """Rung 1 lowers p99 a little but serves no more: the floor is not worth it."""
        order.append(candidate)
        rps = 100.0 * candidate.threads
        return Result(candidate, 10.0 - candidate.knobs, rps, rps, True, "")

    found = coordinate_descent(SPACE, 2, flat, lambda: False)
    assert order[:3] == [Candidate(2, 1, 0, 0), Candidate(1, 1, 0, 0),
                         Candidate(2, 1, 0, 0, 0, 1)]  # threads, then the knobs
    assert choose(found).candidate == Candidate(2, 1, 0, 0)  # rung 0: ties go cheap
    assert len(grid(SPACE, 2)) == 2 * 3

    def faster(candidate: Candidate) -> Result:
        rps = 100.0 * candidate.threads * (1 + candidate.knobs)
        return Result(candidate, 1000 / rps, rps, rps, True, "")

    assert choose(coordinate_descent(SPACE, 2, faster, lambda: False)).candidate.knobs == 2


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    (tmp_path / "repository" / "mlp" / "1").mkdir(parents=True)
    onnx_models.mlp(tmp_path / "repository" / "mlp" / "1" / "model.onnx")
    return tmp_path / "repository"


def request(repository: Path, fake: FakeLadder, model: str = "mlp") -> TuneRequest:
    return TuneRequest(model, repository, exhaustive=True, window_s=0.2,
                       space=("threads=1", "count=1"), knobs=KnobRungs.of(fake))


def test_the_tuner_measures_every_rung_once_and_puts_the_device_back(
        repository: Path) -> None:
    fake = FakeLadder()
    report = tune(request(repository, fake))
    assert [r.candidate.knobs for r in report.results] == [0, 1, 2]
    chosen = report.chosen.candidate.knobs
    confirm = [] if chosen == 2 else [f"apply {chosen}"]  # measured again at its rung
    assert fake.calls == ["apply 0", "apply 1", "apply 2", *confirm, "restore"]
    document = report.to_dict()
    assert [c["knobs"] for c in document["candidates"]] == [
        {"rung": n, "label": f"floor {n}"} for n in range(3)]
    assert document["chosen_knobs"] == {"rung": chosen, "label": f"floor {chosen}"}
    assert "knobs" not in document["chosen"]  # device-wide: no config.yaml key
    assert any(note.startswith(f"latency knobs: best at rung {chosen} (floor {chosen})")
               for note in document["notes"])


def test_the_device_is_put_back_when_a_move_fails_or_the_tune_is_refused(
        repository: Path) -> None:
    fake = FakeLadder(refuse=1)
    with pytest.raises(OSError, match="rung 1 not applied"):
        tune(request(repository, fake))
    assert fake.calls == ["apply 0", "apply 1", "restore"]
    refused = FakeLadder()
    with pytest.raises(TuneError):
        tune(request(repository, refused, "absent"))
    assert refused.calls == ["restore"]


def test_the_cli_searches_a_real_ladder_on_a_fixture_board_and_puts_it_back(
        tmp_path: Path) -> None:
    """``model tune --knobs --root``: the ladder over the profile applied there (rk3588's
    floors on its A76 clusters), each rung measured, the board's files as the profile left
    them afterwards, and no rung written to config.yaml."""
    from tests.cli_helpers import edge_agent
    from tests.tuning_helpers import copy_board, engine_for, snapshot

    tree = copy_board("rk3588-vendor", tmp_path)
    engine_for(tree, tree / "var/lib/edge-agent").apply("rk3588")
    applied = snapshot(tree)
    repository = tmp_path / "repository"
    (repository / "demo").mkdir(parents=True)
    result = edge_agent("model", "tune", "demo", "--repository", repository, "--knobs",
                        "--root", tree, "--state-dir", tree / "var/lib/edge-agent",
                        "--exhaustive", "--space", "threads=1", "--space", "count=1",
                        "--space", "batch=1", "--window-s", "0.2", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    rungs = {c["knobs"]["rung"] for c in report["candidates"]}
    assert len(rungs) >= 3 and 0 in rungs, report["candidates"]
    labels = {c["knobs"]["label"] for c in report["candidates"]}
    assert "the profile's" in labels and any("policy4 >= " in label for label in labels)
    assert "chosen_knobs" in report
    assert snapshot(tree) == applied, "the ladder was not put back"
    assert "knobs" not in (repository / "demo" / "config.yaml").read_text()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_tune_stopped_by_sigterm_or_sighup_puts_the_device_and_its_scratch_back(
        tmp_path: Path, signum: signal.Signals) -> None:
    """A service manager's stop (SIGTERM) or a closed terminal (SIGHUP) mid-search: once
    a rung had raised policy4's floor, both ended the process where it stood, and the floor
    stayed raised, the scratch directory with it; now they unwind as Ctrl-C does."""
    from tests.agent_process import sigint_at_default
    from tests.tuning_helpers import copy_board, engine_for, snapshot

    tree = copy_board("rk3588-vendor", tmp_path)
    engine_for(tree, tree / "var/lib/edge-agent").apply("rk3588")
    applied = snapshot(tree)
    floor = tree / "sys/devices/system/cpu/cpufreq/policy4/scaling_min_freq"
    before = floor.read_text()
    repository, scratch = tmp_path / "repository", tmp_path / "tmp"
    (repository / "demo").mkdir(parents=True)
    scratch.mkdir()
    argv = sigint_at_default(sys.executable, "-m", "agent", "model", "tune", "demo",
                             "--repository", str(repository), "--knobs", "--root", str(tree),
                             "--state-dir", str(tree / "var/lib/edge-agent"), "--exhaustive",
                             "--space", "threads=1", "--space", "count=1", "--space",
                             "batch=1", "--window-s", "1")
    argv[1] = "--default-signal=INT,TERM,HUP"  # a test run under nohup ignores SIGHUP
    with subprocess.Popen(argv, env={**os.environ, "TMPDIR": str(scratch)},
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as child:
        deadline = time.monotonic() + 120
        while floor.read_text() == before and child.poll() is None:
            assert time.monotonic() < deadline, "no rung moved policy4's floor"
            time.sleep(0.02)
        assert child.poll() is None, child.communicate()
        assert floor.read_text() != before  # a rung is on the device now
        child.send_signal(signum)
        _, err = child.communicate(timeout=120)
    assert child.returncode == 128 + signum, err
    assert f"stopped by {signum.name}" in err and "Traceback" not in err, err
    assert snapshot(tree) == applied, "the ladder was not put back"
    # the scratch repository and data plane's files (ONNX Runtime leaves a .ses of its own)
    assert [p.name for p in scratch.iterdir() if p.name.startswith("edge-agent-")] == []
    assert not (repository / "demo" / "config.yaml").exists()
