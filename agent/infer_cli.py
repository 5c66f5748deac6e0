"""``edge-agent infer``: run the inference loop on a model for a while and print its statistics.

Wires discovery (providers, threads) and the inference runtime together; the output is the
"Inference statistics" contract of shared/DESIGN.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import onnxruntime as ort

from agent.cli import open_root
from agent.discovery import discover
from agent.inference.io import SyntheticSource
from agent.inference.loop import InferenceLoop, LoadedModel
from agent.inference.session import SessionError, build_session, choose_providers, thread_plan

DEFAULT_STATE_DIR = "/var/lib/edge-agent"


def _cache_dir(state_dir: str) -> Path | None:
    """The optimised-model cache, or None where the state directory is not writable."""
    directory = Path(state_dir) / "model-cache"
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return directory if os.access(directory, os.W_OK) else None


def run_inference(args: argparse.Namespace) -> dict[str, Any]:
    ort.set_default_logger_severity(3)  # errors only: its warnings are not for an operator
    topology = discover(open_root(args.root))
    providers = choose_providers(ort.get_available_providers(), topology,
                                 args.providers.split(",") if args.providers else None)
    intra_op, inter_op = thread_plan(topology, None)
    built = build_session(Path(args.model), providers=providers, intra_op=intra_op,
                          inter_op=inter_op, cache_dir=_cache_dir(args.state_dir),
                          expected_sha256=args.sha256)
    model = LoadedModel(name=Path(args.model).name, session=built.session,
                        providers=built.providers, threads=(intra_op, inter_op),
                        worker_tids=built.worker_tids)
    loop = InferenceLoop(model, SyntheticSource(built.session.get_inputs()),
                         rate_hz=args.rate)
    loop.start()
    time.sleep(args.seconds)
    loop.stop()
    stats = model.stats.snapshot()
    return {"model": str(args.model), "providers": built.providers,
            "threads": {"intra_op": intra_op, "inter_op": inter_op}, **stats,
            "load_ms": round(built.load_ms, 3), "cache": built.cache,
            "warnings": loop.warnings}


def run(args: argparse.Namespace) -> int:
    try:
        result = run_inference(args)
    except (SessionError, OSError) as error:
        print(f"edge-agent infer: {error}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        latency = result["latency_ms"]
        print(f"{result['model']} on {', '.join(result['providers'])} "
              f"({result['threads']['intra_op']} threads, load {result['load_ms']} ms, "
              f"cache {result['cache']})\n"
              f"{result['count']} calls, {result['errors']} errors, "
              f"{result['throughput_per_s']:.1f}/s, latency ms mean {latency['mean']:.3f} "
              f"p50 {latency['p50']:.3f} p95 {latency['p95']:.3f} p99 {latency['p99']:.3f} "
              f"max {latency['max']:.3f}, deadline misses {result['deadline_misses']}")
    return 0
