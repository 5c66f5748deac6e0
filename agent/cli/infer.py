"""``edge-agent infer``: run the inference loop on a model for a while and print its statistics.

Wires discovery (providers, threads) and the inference runtime together; the output is the
statistics contract: model, providers, threads, count, errors, throughput and latency
percentiles in ms, load time and cache outcome.  ``--swap-to M2 --after S`` hot-swaps to a
second model under load and reports how the swap went.  SIGINT or SIGTERM ends the run early:
the loop is stopped as at the end of a normal run and the statistics so far are printed.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO

from agent.cli.common import (
    UsageError,
    add_state_dir,
    open_root,
    positive_float,
    print_json,
    resolve_state_dir,
)
from agent.stopping import SIGINT_EXIT, StopSignals, exit_code

if TYPE_CHECKING:
    from agent.inference.loader import ModelLoader
    from agent.inference.loop import InferenceLoop, LoadedModel
    from agent.inference.stats import Window

PROGRESS_INTERVAL_S = 0.5


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from agent.inference.demo_model import DEMO_MODEL_PATH  # a path: imports nothing heavy

    infer = commands.add_parser("infer", help="run a model in the inference loop for a while "
                                "and print latency statistics")
    infer.add_argument("--model", default=str(DEMO_MODEL_PATH),
                       help="ONNX model (default: the bundled demo CNN)")
    infer.add_argument("--seconds", type=positive_float, default=5.0)
    infer.add_argument("--rate", type=positive_float, default=None, metavar="HZ",
                       help="fixed call rate with deadline-miss counting (default: free-running)")
    infer.add_argument("--providers", metavar="P1,P2",
                       help="execution providers in order (default: chosen from the hardware)")
    infer.add_argument("--sha256", help="refuse the model unless its sha256 matches")
    infer.add_argument("--root", default="/", metavar="DIR",
                       help="discover the hardware below DIR instead of /")
    add_state_dir(infer, "where the optimised-model cache lives")
    infer.add_argument("--json", action="store_true", help="print the statistics contract")
    infer.add_argument("--swap-to", metavar="M2", help="hot-swap to this model during the run")
    infer.add_argument("--after", type=float, metavar="S",
                       help="seconds into the run for --swap-to (default: a third of it)")
    infer.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                       help="a live status line on stderr (default: when it is a terminal)")
    infer.add_argument("--url", metavar="URL",
                       help="drive a running server instead (http://HOST:PORT, "
                       "grpc://HOST:PORT or unix:///run/edge-agent/infer.sock); --model is "
                       "then a served model's name (default demo)")
    infer.add_argument("--concurrency", type=_positive_int, default=1, metavar="N",
                       help="with --url: clients sending at once (default 1)")
    infer.add_argument("--shm", action="store_true",
                       help="with --url: inputs and outputs in system shared memory (each "
                       "client a region; needs --token-file)")
    infer.add_argument("--shm-prefix", default="edge-agent-", metavar="PREFIX",
                       help="with --shm: the server's serve.shm_prefix (default edge-agent-)")
    infer.add_argument("--token-file", metavar="FILE",
                       help="with --url: the bearer token, for a server beyond loopback "
                       "and for the privileged priority levels (serve.privileged_priority)")
    infer.add_argument("--priority-mix", metavar="P:F,...",
                       help="with --url: the fraction F of requests sent with priority P "
                       "(e.g. 1:0.2,2:0.8), figures printed per priority")
    infer.set_defaults(handler=run)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: expected an integer 1 or above")
    return value


class _Swapper(threading.Thread):
    """Loads the second model after a delay and swaps to it while the loop runs."""

    def __init__(self, loop: InferenceLoop, loader: ModelLoader, path: str, after_s: float,
                 canary_s: float) -> None:
        super().__init__(name="swap", daemon=True)
        self.loop, self.loader, self.path = loop, loader, path
        self.after_s, self.canary_s = after_s, canary_s
        self.cancelled = threading.Event()
        self.report: dict[str, Any] = {"to": path, "switched": False}

    def run(self) -> None:
        from agent.inference.errors import SessionError
        from agent.inference.loop import SwapRejected

        if self.cancelled.wait(self.after_s):
            self.report["reason"] = "the run ended before the swap was due"
            return
        try:
            model, built = self.loader.load(self.path)
            result = self.loop.swap(model, canary_s=self.canary_s)
        except (SessionError, SwapRejected, OSError) as error:
            self.report["reason"] = str(error)
            return
        self.report.update(switched=result.switched, rolled_back=result.rolled_back,
                           reason=result.reason, load_ms=round(built.load_ms, 3),
                           cache=built.cache,
                           switch_gap_ms=[round(gap / 1e6, 3)
                                          for gap in self.loop.switch_gaps_ns],
                           stats=result.new)


def _progress_line(elapsed_s: float, model: LoadedModel, since: Window, now: Window) -> str:
    """Rate and latency over the last interval, so a change (a swap, throttling) shows."""
    recent = now.since(since)
    return (f"{elapsed_s:6.1f} s  {model.name}  {recent.throughput_per_s:9.1f}/s  "
            f"p50 {recent.percentile_ns(50) / 1e6:.3f} ms  "
            f"p99 {recent.percentile_ns(99) / 1e6:.3f} ms  errors {now.errors}")


def _watch(loop: InferenceLoop, seconds: float, progress: TextIO | None,
           stop: threading.Event) -> None:
    """Wait through the run (or until ``stop``), redrawing one status line on ``progress``."""
    start = time.monotonic()
    end = start + seconds
    model, last = loop.active, loop.active.stats.window()
    while (now := time.monotonic()) < end:
        if stop.wait(min(PROGRESS_INTERVAL_S, end - now)):
            break
        if progress is None:
            continue
        if loop.active is not model:
            model, last = loop.active, loop.active.stats.window()
            continue
        window = model.stats.window()
        if window.generation != last.generation:  # reset by a swap back to this model
            last = window
            continue
        progress.write("\r" + _progress_line(time.monotonic() - start, model, last, window))
        progress.flush()
        last = window
    if progress is not None:
        progress.write("\n")


def run_inference(args: argparse.Namespace, progress: TextIO | None = None,
                  stop: threading.Event | None = None) -> tuple[dict[str, Any], bool]:
    """The run's statistics, and whether the loop thread ended (a call stuck in ORT cannot be
    joined); ``stop`` ends the run early, through the same stop path."""
    import onnxruntime as ort

    from agent.discovery import discover
    from agent.inference.accelerators import unused_accelerators
    from agent.inference.io import SyntheticSource
    from agent.inference.loader import ModelLoader, model_cache_dir
    from agent.inference.loop import InferenceLoop
    from agent.inference.options import thread_plan
    from agent.inference.providers import choose_providers

    stop = stop or threading.Event()
    ort.set_default_logger_severity(3)  # errors only: its warnings are not for an operator
    topology = discover(open_root(args.root))
    available = ort.get_available_providers()
    providers = choose_providers(available, topology,
                                 args.providers.split(",") if args.providers else None)
    loader = ModelLoader(providers, thread_plan(topology, None),
                         model_cache_dir(resolve_state_dir(args.state_dir, args.root)))
    first, built = loader.load(args.model, args.sha256)
    loop = InferenceLoop(first, SyntheticSource(built.session.get_inputs()), rate_hz=args.rate)
    swapper = None
    if args.swap_to:
        after = args.seconds / 3 if args.after is None else args.after
        swapper = _Swapper(loop, loader, args.swap_to, after,
                           canary_s=max(0.2, min(5.0, (args.seconds - after) / 2)))
    loop.start()
    if swapper is not None:
        swapper.start()
    try:
        _watch(loop, args.seconds, progress, stop)
    finally:  # whatever ends the wait (a closed stderr too), no thread is left inside ORT
        if swapper is not None:
            swapper.cancelled.set()
            if stop.is_set():
                loop.stop()  # ends a canary window now instead of waiting it out
            swapper.join()
        loop.stop()
    if loop.alive:
        loop.warnings.append("the inference thread did not stop: a call is stuck in "
                             "onnxruntime")
    result = {"model": str(args.model), "providers": built.providers,
              "threads": {"intra_op": loader.threads[0], "inter_op": loader.threads[1]},
              **first.stats.snapshot(), "load_ms": round(built.load_ms, 3),
              "cache": built.cache, "warnings": loop.warnings,
              "unused_accelerators": [accelerator.to_dict() for accelerator in
                                      unused_accelerators(available, topology, built.providers)]}
    if swapper is not None:
        result["swap"] = {**swapper.report, "max_gap_ms": round(loop.max_gap_ns / 1e6, 3),
                          "active": loop.active.name}
    return result, not loop.alive


def _print_summary(result: dict[str, Any]) -> None:
    latency = result["latency_ms"]
    print(f"{result['model']} on {', '.join(result['providers'])} "
          f"({result['threads']['intra_op']} threads, load {result['load_ms']} ms, "
          f"cache {result['cache']})\n"
          f"{result['count']} calls, {result['errors']} errors, "
          f"{result['throughput_per_s']:.1f}/s, latency ms mean {latency['mean']:.3f} "
          f"p50 {latency['p50']:.3f} p95 {latency['p95']:.3f} p99 {latency['p99']:.3f} "
          f"max {latency['max']:.3f}, deadline misses {result['deadline_misses']}")
    for accelerator in result["unused_accelerators"]:
        print(f"{accelerator['device']} is not used: {accelerator['reason']}")
    if result.get("stopped_by"):
        print(f"stopped early by {result['stopped_by']}")
    swap = result.get("swap")
    if swap is None:
        return
    if not swap["switched"]:
        print(f"swap to {swap['to']}: not done: {swap['reason']}")
        return
    outcome = "rolled back" if swap["rolled_back"] else "kept"
    print(f"swap to {swap['to']}: {outcome} ({swap['reason']}); gap across the switch "
          f"{', '.join(map(str, swap['switch_gap_ms']))} ms; now running {swap['active']}")


def run(args: argparse.Namespace) -> int:
    if args.after is not None and not args.swap_to:
        raise UsageError("--after needs --swap-to")
    if args.after is not None and not 0 <= args.after < args.seconds:
        raise UsageError(f"--after {args.after} must be at least 0 and below --seconds "
                         f"{args.seconds}")
    if args.priority_mix and not args.url:
        raise UsageError("--priority-mix needs --url (a server's scheduler reads it)")
    if args.url:
        return _run_remote(args)
    show = args.progress if args.progress is not None else sys.stderr.isatty()
    with StopSignals() as stop:
        result, joined = run_inference(args, sys.stderr if show else None, stop.event)
        code = _report(args, result, stop.name, _print_summary)
        return exit_code(code, threads_stuck=not joined)


def _report(args: argparse.Namespace, result: dict[str, Any], stopped_by: str | None,
            summary: Callable[[dict[str, Any]], None]) -> int:
    """Print the statistics (``--json`` or the summary); the exit status of the run.
    SIGTERM asks for a clean stop, and the statistics printed are a whole result: 0."""
    if stopped_by is not None:
        result["stopped_by"] = stopped_by
    if args.json:
        print_json(result)
    else:
        summary(result)
    return SIGINT_EXIT if stopped_by == "SIGINT" else 0


def _run_remote(args: argparse.Namespace) -> int:
    from agent.cli.infer_remote import print_remote, run_remote
    from agent.inference.demo_model import DEMO_MODEL_PATH

    if args.swap_to:
        raise UsageError("--swap-to is for the local loop; a server swaps by loading a "
                         "version (edge-agent fleet send ... set-model)")
    model = "demo" if args.model == str(DEMO_MODEL_PATH) else args.model
    with StopSignals() as stop:
        return _report(args, run_remote(args, model, stop.event), stop.name, print_remote)
