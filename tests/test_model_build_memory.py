"""A build's memory does not grow with its calibration set (issue 32): ONNX Runtime's
calibrators keep every activation of every input they are given at once, so a build feeds
them a chunk at a time and reads its inputs from disk as it uses them.  Each build runs in
its own child process, so what the test process holds does not count; the peak is the one
the build reports in build.json, checked against the child's own high-water mark."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from agent.modelbuild import quantize, variants
from tests.onnx_models import wide_conv_net

ROOT = Path(__file__).resolve().parent.parent

CHILD = """
import json, sys
from pathlib import Path
from agent.modelbuild.build import build_candidate
from agent.modelbuild.request import BuildRequest, Gate
model, inputs, work = map(Path, sys.argv[1:])
# a gate no variant can pass: every variant is built, the histogram (percentile) one too
report = build_candidate(BuildRequest(model, "wide", calibration=inputs,
                                      gate=Gate(top1=0.0, cosine=0.0, speed=100)),
                         work, measure=lambda original, built, feed: 1.0)
# VmHWM, not ru_maxrss: exec carries the parent's high-water mark into ru_maxrss (fs/exec.c
# exec_mmap), so a child of a big pytest process would report pytest's size
status = Path("/proc/self/status").read_text()
print(json.dumps({"document": json.loads((work / "build.json").read_text()),
                  "maxrss_mb": int(status.split("VmHWM:")[1].split()[0]) / 1024}))
"""


def build_in_child(model: Path, inputs: int, tmp_path: Path) -> tuple[dict, float]:
    """(build.json, the child's peak RSS in MB) of a build on ``inputs`` calibration
    inputs (and as many held out)."""
    directory, work = tmp_path / f"in{inputs}", tmp_path / f"work{inputs}"
    directory.mkdir()
    work.mkdir()
    rng = np.random.default_rng(inputs)
    for index in range(2 * inputs):
        np.save(directory / f"{index:04}.npy",
                rng.standard_normal((1, 3, 96, 96)).astype(np.float32))
    done = subprocess.run([sys.executable, "-c", CHILD, str(model), str(directory), str(work)],
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
                          capture_output=True, text=True, check=False, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result["document"], result["maxrss_mb"]


def test_peak_memory_is_flat_in_the_calibration_count_and_is_reported(tmp_path: Path) -> None:
    model = wide_conv_net(tmp_path / "wide.onnx")  # ~4.7 MB of activations an input
    small, small_rss = build_in_child(model, 8, tmp_path)
    large, large_rss = build_in_child(model, 32, tmp_path)
    assert small["inputs"] == {"calibration": 8, "heldout": 8}
    assert large["inputs"] == {"calibration": 32, "heldout": 32}
    assert [v["name"].endswith("percentile") for v in large["variants"]].count(True) == 1
    # before: every activation of every input held at once: 173 MB at 8, 354 MB at 32
    assert large_rss < small_rss * 1.3, (small_rss, large_rss)
    for document, rss in ((small, small_rss), (large, large_rss)):
        # the build's own peak (reset as it starts): at most the process's, and most of it
        assert rss * 0.6 < document["peak_rss_mb"] <= rss + 1
    assert large["peak_rss_mb"] < small["peak_rss_mb"] * 1.3


def test_minmax_ranges_fed_in_chunks_are_those_of_the_whole_set(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """11 inputs in chunks of 4 (the last one short) quantize to the very scales and zero
    points of all 11 at once: min and max merge exactly."""
    model = wide_conv_net(tmp_path / "wide.onnx", size=16, channels=4)
    prepared = quantize.prepare(model, tmp_path)
    rng = np.random.default_rng(3)
    feeds = [{"image": rng.standard_normal((1, 3, 16, 16)).astype(np.float32) * (i + 1)}
             for i in range(11)]
    variant = variants.for_target("cpu")[0]
    scales = []
    for chunk in (4, 1000):
        monkeypatch.setattr(quantize, "CALIBRATION_CHUNK", chunk)
        out = tmp_path / f"chunk{chunk}.onnx"
        quantize.quantize(prepared, out, variant, feeds)
        scales.append({t.name: numpy_helper.to_array(t) for t in onnx.load(str(out)).graph
                       .initializer if t.name.endswith(("_scale", "_zero_point"))})
    chunked, whole = scales
    assert len(chunked) > 8 and chunked.keys() == whole.keys()
    assert all(np.array_equal(chunked[name], whole[name]) for name in whole)
