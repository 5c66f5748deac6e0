"""The inference loop with real ONNX Runtime sessions: swap, rollback, affinity, sinks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx_models import incompatible_model, mlp, nan_model, slow_model

from agent.inference.io import CallbackSink, NpyDirectorySource, SyntheticSource
from agent.inference.loop import InferenceLoop, LoadedModel, SwapRejected
from agent.kernel.sched import ThreadSched


def load(path: Path) -> LoadedModel:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return LoadedModel(name=path.stem, session=session)


class Recorder:
    """A sink that keeps every sequence number, to prove nothing was dropped."""

    def __init__(self) -> None:
        self.seqs: list[int] = []

    def __call__(self, outputs: Sequence[np.ndarray], seq: int) -> None:
        self.seqs.append(seq)


@pytest.fixture()
def models(tmp_path: Path) -> dict[str, Path]:
    return {"a": mlp(tmp_path / "a.onnx"), "b": mlp(tmp_path / "b.onnx", hidden=96),
            "slow": slow_model(tmp_path / "slow.onnx"), "nan": nan_model(tmp_path / "nan.onnx"),
            "wrong": incompatible_model(tmp_path / "wrong.onnx")}


@pytest.fixture()
def running(models: dict[str, Path]) -> Iterator[tuple[InferenceLoop, Recorder]]:
    first = load(models["a"])
    recorder = Recorder()
    loop = InferenceLoop(first, SyntheticSource(first.session.get_inputs()),
                         sinks=[CallbackSink(recorder)])
    loop.start()
    deadline = time.monotonic() + 10
    while loop.completions < 50 and time.monotonic() < deadline:
        time.sleep(0.01)
    yield loop, recorder
    loop.stop()


def wait_for(predicate: object, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate() and time.monotonic() < deadline:  # type: ignore[operator]
        time.sleep(0.01)


def test_swap_under_load_drops_and_fails_nothing(models: dict[str, Path],
                                                 running: tuple[InferenceLoop, Recorder]) -> None:
    loop, recorder = running
    old = loop.active
    new = load(models["b"])
    events: list[dict[str, object]] = []
    loop.on_event = events.append
    result = loop.swap(new, canary_s=0.5, max_p99_ratio=1000)  # judged elsewhere
    assert (result.switched, result.rolled_back) == (True, False), result.reason
    assert loop.active is new
    wait_for(lambda: new.stats.snapshot()["count"] > 100)
    loop.stop()
    old_stats, new_stats = old.stats.snapshot(), new.stats.snapshot()
    assert old_stats["errors"] == new_stats["errors"] == 0
    assert old_stats["count"] + new_stats["count"] == loop.completions == len(recorder.seqs)
    assert recorder.seqs == list(range(len(recorder.seqs)))  # no gap, no duplicate
    assert [e["type"] for e in events] == ["model_swapped"]


def test_swap_to_a_slow_model_rolls_back(models: dict[str, Path],
                                         running: tuple[InferenceLoop, Recorder]) -> None:
    loop, recorder = running
    old = loop.active
    events: list[dict[str, object]] = []
    loop.on_event = events.append
    result = loop.swap(load(models["slow"]), canary_s=1.0, max_p99_ratio=3.0)
    assert (result.switched, result.rolled_back) == (True, True)
    assert "p99" in result.reason and "old model" in result.reason
    assert loop.active is old
    assert [e["type"] for e in events] == ["model_swapped", "model_swap_rolled_back"]
    loop.stop()
    assert recorder.seqs == list(range(len(recorder.seqs)))


def test_p99_bound_rolls_back(models: dict[str, Path],
                              running: tuple[InferenceLoop, Recorder]) -> None:
    loop, _ = running
    result = loop.swap(load(models["slow"]), canary_s=0.5, max_p99_ratio=1000,
                       max_p99_ms=0.001)
    assert result.rolled_back and "above the bound" in result.reason


@pytest.mark.parametrize(("model", "message"), [("nan", "not finite"),
                                                ("wrong", "model wants")])
def test_bad_model_is_rejected_before_switching(models: dict[str, Path], model: str,
                                                message: str,
                                                running: tuple[InferenceLoop, Recorder]) -> None:
    loop, _ = running
    old = loop.active
    before = loop.completions
    with pytest.raises(SwapRejected, match=message):
        loop.swap(load(models[model]), canary_s=0.2)
    assert loop.active is old
    wait_for(lambda: loop.completions > before + 20)
    assert old.stats.snapshot()["errors"] == 0


def test_loop_thread_runs_on_the_cpus_it_was_given(models: dict[str, Path]) -> None:
    model = load(models["a"])
    loop = InferenceLoop(model, SyntheticSource(model.session.get_inputs()),
                         thread_sched=ThreadSched("other", 0, [0]))
    loop.start()
    try:
        wait_for(lambda: loop.completions > 10)
        assert loop.native_id is not None
        assert os.sched_getaffinity(loop.native_id) == {0}
        assert loop.warnings == []
    finally:
        loop.stop()
    assert os.sched_getaffinity(0) != {0} or os.cpu_count() == 1  # the test's own thread


def test_fixed_rate_counts_deadline_misses(models: dict[str, Path]) -> None:
    model = load(models["slow"])  # ~ms per call: 5 kHz cannot be met
    loop = InferenceLoop(model, SyntheticSource(model.session.get_inputs()), rate_hz=5000)
    loop.start()
    wait_for(lambda: loop.completions > 30)
    loop.stop()
    stats = model.stats.snapshot()
    assert stats["deadline_misses"] > 0
    relaxed = load(models["a"])
    loop = InferenceLoop(relaxed, SyntheticSource(relaxed.session.get_inputs()), rate_hz=50)
    loop.start()
    time.sleep(0.5)
    loop.stop()
    snapshot = relaxed.stats.snapshot()
    assert 15 <= snapshot["count"] <= 30  # 50 Hz for half a second
    assert snapshot["deadline_misses"] <= 2


def test_npy_directory_source_cycles_files(tmp_path: Path, models: dict[str, Path]) -> None:
    for index in range(3):
        np.save(tmp_path / f"{index}.npy", np.full((1, 64), index, dtype=np.float32))
    source = NpyDirectorySource(tmp_path, "x")
    seen = [float(source.next()["x"][0, 0]) for _ in range(5)]
    assert seen == [0.0, 1.0, 2.0, 0.0, 1.0]
    model = load(models["a"])
    outputs = model.run(source.next())
    assert outputs[0].shape == (1, 10)


def test_failing_calls_are_counted_not_fatal(models: dict[str, Path]) -> None:
    model = load(models["a"])

    class BadSource:
        calls = 0

        def next(self) -> dict[str, np.ndarray]:
            self.calls += 1
            shape = (1, 64) if self.calls % 2 else (1, 3)  # every other feed is malformed
            return {"x": np.zeros(shape, dtype=np.float32)}

    loop = InferenceLoop(model, BadSource())
    loop.start()
    wait_for(lambda: loop.completions > 100)
    loop.stop()
    stats = model.stats.snapshot()
    assert stats["errors"] > 0 and stats["count"] > 0
    assert abs(stats["errors"] - stats["count"]) <= 1


def test_infer_cli_prints_the_statistics_contract(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "agent", "infer", "--seconds", "1", "--json", "--state-dir",
         str(tmp_path)], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    stats = json.loads(result.stdout)
    assert set(stats) >= {"model", "providers", "threads", "count", "errors",
                          "throughput_per_s", "latency_ms"}
    assert stats["providers"] == ["CPUExecutionProvider"]
    assert stats["count"] > 100 and stats["errors"] == 0
    latency = stats["latency_ms"]
    assert 0 < latency["p50"] <= latency["p95"] <= latency["p99"] <= latency["max"]
    again = subprocess.run(
        [sys.executable, "-m", "agent", "infer", "--seconds", "0.2", "--json", "--state-dir",
         str(tmp_path)], capture_output=True, text=True, timeout=120, check=False)
    assert json.loads(again.stdout)["cache"] == "hit"


def test_infer_cli_refuses_a_wrong_sha256(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "agent", "infer", "--seconds", "0.2", "--sha256", "0" * 64,
         "--state-dir", str(tmp_path)], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 1
    assert "sha256" in result.stderr and "0" * 64 in result.stderr


def test_gap_across_a_switch_is_recorded(models: dict[str, Path],
                                         running: tuple[InferenceLoop, Recorder]) -> None:
    loop, _ = running
    assert loop.switch_gaps_ns == []
    loop.swap(load(models["b"]), canary_s=0.3, max_p99_ratio=1000)
    assert len(loop.switch_gaps_ns) == 1 and loop.switch_gaps_ns[0] > 0


def test_ort_worker_threads_get_the_loops_scheduling(models: dict[str, Path]) -> None:
    """A SCHED_FIFO loop thread must not wait on normal-priority ORT workers: the workers
    get the same policy and CPUs."""
    from agent.inference.session import build_session

    built = build_session(models["a"], providers=["CPUExecutionProvider"], intra_op=2,
                          inter_op=1, cache_dir=None)
    assert len(built.worker_tids) == 1  # intra_op 2: the caller plus one worker
    model = LoadedModel(name="a", session=built.session, worker_tids=built.worker_tids)
    loop = InferenceLoop(model, SyntheticSource(built.session.get_inputs()),
                         thread_sched=ThreadSched("other", 0, [0]))
    loop.start()
    try:
        wait_for(lambda: loop.completions > 10)
        (worker,) = built.worker_tids
        assert os.sched_getaffinity(worker) == {0}
        assert loop.warnings == []
    finally:
        loop.stop()


def test_static_outputs_are_written_into_reused_buffers(models: dict[str, Path],
                                                        tmp_path: Path) -> None:
    """IOBinding path: the same output buffers every call, with the same values as run()."""
    from onnx_models import dynamic_batch_mlp

    model = load(models["a"])
    feeds = SyntheticSource(model.session.get_inputs()).next()
    first = model.run(feeds)
    expected = model.session.run(model.output_names, feeds)
    np.testing.assert_array_equal(first[0], expected[0])
    assert model.run(feeds)[0] is first[0]  # no allocation per call
    dynamic = load(dynamic_batch_mlp(tmp_path / "dyn.onnx"))  # dynamic outputs: plain run
    out = dynamic.run(SyntheticSource(dynamic.session.get_inputs(), {"N": 3}).next())
    assert out[0].shape[0] == 3


def infer_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agent", "infer", *args], capture_output=True,
                          text=True, timeout=120, check=False)


def test_infer_cli_swaps_under_load(tmp_path: Path, models: dict[str, Path]) -> None:
    result = infer_cli("--model", str(models["a"]), "--swap-to", str(models["b"]), "--after",
                       "0.5", "--seconds", "2", "--json", "--state-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    stats = json.loads(result.stdout)
    swap = stats["swap"]
    assert swap["switched"] is True and swap["to"] == str(models["b"])
    assert swap["stats"]["count"] > 0 and swap["stats"]["errors"] == 0
    assert stats["count"] > 0 and stats["errors"] == 0
    assert len(swap["switch_gap_ms"]) in (1, 2)  # 2 when the canary switched back
    assert swap["active"] == ("a.onnx" if swap["rolled_back"] else "b.onnx")


def test_infer_cli_reports_a_refused_swap(tmp_path: Path, models: dict[str, Path]) -> None:
    result = infer_cli("--model", str(models["a"]), "--swap-to", str(models["wrong"]),
                       "--after", "0.2", "--seconds", "1", "--json", "--state-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    swap = json.loads(result.stdout)["swap"]
    assert swap["switched"] is False and swap["active"] == "a.onnx"
    assert "input" in swap["reason"]


def test_infer_cli_draws_a_live_progress_line(tmp_path: Path, models: dict[str, Path]) -> None:
    result = infer_cli("--model", str(models["a"]), "--seconds", "1.2", "--progress",
                       "--state-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]  # \r counts too
    assert len(lines) >= 2
    rate = float(lines[-1].split()[3].removesuffix("/s"))
    assert lines[-1].split()[2] == "a.onnx" and rate > 0 and "p99" in lines[-1]
    quiet = infer_cli("--model", str(models["a"]), "--seconds", "0.6", "--state-dir",
                      str(tmp_path))
    assert "p99" not in quiet.stderr  # not a terminal, not asked for: no progress line


def test_infer_cli_after_needs_swap_to(tmp_path: Path) -> None:
    result = infer_cli("--after", "1", "--state-dir", str(tmp_path))
    assert result.returncode == 2 and "--after needs --swap-to" in result.stderr


def test_non_finite_outputs_during_the_canary_roll_the_swap_back(
        tmp_path: Path, models: dict[str, Path]) -> None:
    from onnx_models import sqrt_model

    first, fragile = load(models["a"]), load(sqrt_model(tmp_path / "sqrt.onnx"))
    positive = SyntheticSource(first.session.get_inputs()).next()
    negative = {name: -array - 1 for name, array in positive.items()}

    class Source:
        """Data the new model cannot take arrives only once it is switched in."""

        def next(self) -> dict[str, np.ndarray]:
            return negative if loop.active is fragile else positive

    loop = InferenceLoop(first, Source())
    loop.start()
    wait_for(lambda: loop.completions > 50)
    result = loop.swap(fragile, canary_s=0.5, warmup_calls=3, max_p99_ratio=100)
    loop.stop()
    assert result.rolled_back and "error rate 100.00% above 0.30%" in result.reason
    assert loop.active is first and result.new["errors"] > 0 and result.new["count"] == 0
    assert fragile.check_finite is False


def test_a_real_time_loop_takes_only_sessions_that_do_not_spin(
        models: dict[str, Path]) -> None:
    """ORT's intra-op workers busy-wait between ops by default; at SCHED_FIFO one would keep
    everything of lower priority (kernel threads too) off its CPU, so the loader builds RT
    loops' sessions with spinning off (Documentation/scheduler/sched-rt-group.rst: nothing
    throttles it once sched_rt_runtime_us is -1)."""
    from agent.inference.loader import ModelLoader
    from agent.inference.options import session_spins, spinning_for

    fifo = ThreadSched("fifo", 1, [0])
    assert spinning_for(fifo) is False and spinning_for(ThreadSched("other", 0, [0])) is None
    spinning, _ = ModelLoader(["CPUExecutionProvider"], (2, 1), None).load(str(models["a"]))
    assert session_spins(spinning.session)
    with pytest.raises(SwapRejected, match="allow_spinning=False"):
        InferenceLoop(spinning, SyntheticSource(spinning.session.get_inputs()),
                      thread_sched=fifo)
    quiet, _ = ModelLoader(["CPUExecutionProvider"], (2, 1), None,
                           allow_spinning=spinning_for(fifo)).load(str(models["a"]))
    assert not session_spins(quiet.session)
    loop = InferenceLoop(quiet, SyntheticSource(quiet.session.get_inputs()), thread_sched=fifo)
    with pytest.raises(SwapRejected, match="allow_spinning=False"):  # nor a swap to one
        loop.last_feeds = SyntheticSource(quiet.session.get_inputs()).next()
        loop.swap(spinning, canary_s=0.0)
