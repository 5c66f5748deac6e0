"""The inference loop: one thread, pre-built inputs, every call measured, safe hot swap.

The active model is one attribute read once per iteration, so a swap lands between two calls
and no call is dropped or fails because of it.  The loop asks the tuning engine's RT API for
its own thread's policy, priority and CPUs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from agent.inference.io import ORT_TYPES, Feeds, Sink, Source
from agent.inference.stats import LatencyStats
from agent.kernel import sched as rt

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    """A ready session and its own statistics."""

    name: str
    session: Any  # onnxruntime.InferenceSession
    stats: LatencyStats = field(default_factory=LatencyStats)
    providers: list[str] = field(default_factory=list)
    threads: tuple[int, int] = (0, 0)
    worker_tids: frozenset[int] = frozenset()  # ORT's intra-op workers (BuiltSession)
    check_finite: bool = False  # count non-finite outputs as errors (a swap's canary)

    def __post_init__(self) -> None:
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.run = self._bound_runner() or self._plain_run

    def _plain_run(self, feeds: Feeds) -> Sequence[np.ndarray]:
        return self.session.run(self.output_names, feeds)  # type: ignore[no-any-return]

    def _bound_runner(self) -> Callable[[Feeds], Sequence[np.ndarray]] | None:
        """With static output shapes, ORT writes into buffers allocated once (IOBinding),
        so no call allocates its outputs.  The arrays are reused: a sink that keeps one past
        its ``emit`` must copy it."""
        outputs = self.session.get_outputs()
        if not all(ORT_TYPES.get(o.type) and all(isinstance(d, int) and d > 0 for d in o.shape)
                   for o in outputs):
            return None
        buffers = [np.empty(o.shape, dtype=ORT_TYPES[o.type]) for o in outputs]
        binding = self.session.io_binding()
        for output, buffer in zip(outputs, buffers, strict=True):
            binding.bind_output(output.name, "cpu", 0, buffer.dtype, list(buffer.shape),
                                buffer.ctypes.data)
        bind_input, run_bound = binding.bind_cpu_input, self.session.run_with_iobinding

        def run(feeds: Feeds) -> Sequence[np.ndarray]:
            for name, array in feeds.items():
                bind_input(name, array)
            run_bound(binding)
            return buffers

        return run


def all_finite(outputs: Sequence[np.ndarray]) -> bool:
    """No NaN or infinity in any floating-point output."""
    return all(o.dtype.kind != "f" or bool(np.isfinite(o).all()) for o in outputs)


class SwapRejected(ValueError):
    """The new model was not switched to: it cannot take the source's inputs or its warm-up
    outputs are not finite.  The running model was never interrupted."""


@dataclass
class SwapResult:
    switched: bool
    rolled_back: bool
    reason: str
    old: dict[str, Any]
    new: dict[str, Any]


def check_compatible(session: Any, feeds: Feeds) -> None:
    """The new model must take exactly the feeds the source produces."""
    inputs = {arg.name: arg for arg in session.get_inputs()}
    if set(inputs) != set(feeds):
        raise SwapRejected(f"inputs {sorted(inputs)} do not match the source's "
                           f"{sorted(feeds)}")
    for name, array in feeds.items():
        shape = inputs[name].shape
        if len(shape) != array.ndim or any(
                isinstance(dim, int) and dim != size for dim, size in zip(shape, array.shape,
                                                                          strict=True)):
            raise SwapRejected(f"input {name}: model wants {shape}, the source gives "
                               f"{list(array.shape)}")


def check_spinning(session: Any, thread_sched: rt.ThreadSched | None) -> None:
    """A real-time loop takes sessions whose workers do not spin (``options.spinning_for``):
    a SCHED_FIFO worker busy-waiting between ops keeps everything else off its CPU."""
    from agent.inference.options import session_spins  # onnxruntime: only once a loop is made

    if thread_sched is not None and rt.is_realtime(thread_sched) and session_spins(session):
        raise SwapRejected(f"the loop runs at {thread_sched.policy} {thread_sched.priority}: "
                           "build the session with allow_spinning=False "
                           "(options.spinning_for)")


class InferenceLoop:
    def __init__(self, model: LoadedModel, source: Source, sinks: Sequence[Sink] = (),
                 rate_hz: float | None = None, thread_sched: rt.ThreadSched | None = None,
                 on_event: Callable[[dict[str, Any]], None] | None = None) -> None:
        check_spinning(model.session, thread_sched)
        self.active = model
        self.source = source
        self.sinks = list(sinks)
        self.period_ns = int(1e9 / rate_hz) if rate_hz else 0
        self.thread_sched = thread_sched
        self.on_event = on_event or (lambda event: None)
        self.warnings: list[str] = []
        self.last_feeds: Feeds | None = None
        self.completions = 0
        self.max_gap_ns = 0  # longest time between two completions (swap benchmark)
        self.switch_gaps_ns: list[int] = []  # completion gap across each model switch
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.native_id: int | None = None
        self._failing: set[str] = set()  # models whose first failure was logged

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="inference", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _apply_thread_sched(self) -> None:
        self.native_id = threading.get_native_id()
        self._schedule([self.native_id, *sorted(self.active.worker_tids)])

    def _schedule(self, tids: Sequence[int]) -> None:
        """The profile's policy for the loop thread and ORT's workers alike: a real-time loop
        thread waiting on normal-priority workers on the same CPUs could starve them."""
        if self.thread_sched is None:
            return
        for tid in tids:
            try:
                rt.apply_thread_sched(tid, self.thread_sched)
            except (rt.RtError, ProcessLookupError) as error:  # runs on, at normal priority
                self.warnings.append(f"thread {tid}: scheduling not applied: {error}")
                logger.warning("%s", self.warnings[-1])

    def _run(self) -> None:
        self._apply_thread_sched()
        clock = time.perf_counter_ns
        next_feeds, sinks, period, stop = self.source.next, self.sinks, self.period_ns, self._stop
        deadline = last_end = clock()
        seq = 0
        model: LoadedModel | None = None
        switched = False
        while not stop.is_set():
            if self.active is not model:  # a swap takes effect between two calls
                switched = model is not None
                model = self.active
                run, stats = model.run, model.stats
            feeds = next_feeds()
            self.last_feeds = feeds
            start = clock()
            stats.call_started(start)
            try:
                outputs = run(feeds)
            except Exception as error:  # a failing call is counted, never fatal
                outputs = None
                if model.name not in self._failing:
                    self._failing.add(model.name)
                    logger.warning("inference on %s failed: %s", model.name, error)
            end = clock()
            if model.check_finite and outputs is not None and not all_finite(outputs):
                outputs = None  # a canary's NaN/inf is an error, not a result
            stats.record(end - start, outputs is not None)
            if end - last_end > self.max_gap_ns:
                self.max_gap_ns = end - last_end
            if switched:
                self.switch_gaps_ns.append(end - last_end)
                switched = False
            last_end = end
            self.completions += 1
            if outputs is not None:
                for sink in sinks:
                    sink.emit(outputs, seq)
            seq += 1
            if period:
                deadline += period
                now = clock()
                if now > deadline:
                    stats.deadline_missed()
                    deadline = now
                else:
                    time.sleep((deadline - now) / 1e9)

    def swap(self, new: LoadedModel, *, canary_s: float = 5.0, warmup_calls: int = 10,
             max_error_rate: float = 0.003, max_p99_ratio: float = 2.0,
             max_p99_ms: float | None = None) -> SwapResult:
        """Warm up and check ``new`` beside the running model, switch between two calls,
        watch it for ``canary_s`` and switch back if it is worse than the limits."""
        old = self.active
        feeds = self.last_feeds
        if feeds is None:
            raise SwapRejected("the loop has not run yet: nothing to check the model against")
        check_compatible(new.session, feeds)
        check_spinning(new.session, self.thread_sched)
        for _ in range(warmup_calls):
            if not all_finite(new.run(feeds)):
                raise SwapRejected(f"{new.name}: warm-up outputs are not finite")
        old_stats = old.stats.snapshot()
        new.stats.reset()
        self._schedule(sorted(new.worker_tids))
        new.check_finite = True  # during the canary only: it costs a pass over the outputs
        self.active = new
        self.on_event({"type": "model_swapped", "from": old.name, "to": new.name})
        self._stop.wait(canary_s)
        new.check_finite = False
        new_stats = new.stats.snapshot()
        reason = self._canary_verdict(old_stats, new_stats, max_error_rate, max_p99_ratio,
                                      max_p99_ms)
        if reason:
            self.active = old
            self.on_event({"type": "model_swap_rolled_back", "from": new.name, "to": old.name,
                           "reason": reason})
            return SwapResult(True, True, reason, old_stats, new_stats)
        return SwapResult(True, False, "canary passed", old_stats, new_stats)

    @staticmethod
    def _canary_verdict(old: dict[str, Any], new: dict[str, Any], max_error_rate: float,
                        max_p99_ratio: float, max_p99_ms: float | None) -> str | None:
        calls = new["count"] + new["errors"]
        if calls == 0:
            return "the new model completed no call during the canary window"
        error_rate = new["errors"] / calls
        if error_rate > max_error_rate:
            return f"error rate {error_rate:.2%} above {max_error_rate:.2%}"
        p99 = new["latency_ms"]["p99"]
        if max_p99_ms is not None and p99 > max_p99_ms:
            return f"p99 {p99:.3f} ms above the bound {max_p99_ms} ms"
        old_p99 = old["latency_ms"]["p99"]
        if old["count"] and p99 > max_p99_ratio * old_p99:
            return f"p99 {p99:.3f} ms above {max_p99_ratio}x the old model's {old_p99:.3f} ms"
        return None
