"""Where inference inputs come from and where outputs go.

Sources hand the loop ready feeds (``{input name: array}``); the synthetic and directory
sources build every array up front, so the hot loop never allocates for its inputs.  The MQTT
link will implement :class:`Source`/:class:`Sink` through the queue and callback variants.
"""

from __future__ import annotations

import json
import logging
import queue
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

logger = logging.getLogger(__name__)

Feeds = dict[str, np.ndarray]
ORT_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16,
             "tensor(double)": np.float64, "tensor(int64)": np.int64,
             "tensor(int32)": np.int32, "tensor(uint8)": np.uint8, "tensor(int8)": np.int8,
             "tensor(bool)": np.bool_}


class SourceError(ValueError):
    """A source cannot feed this model (shape, type or missing data)."""


class Source(Protocol):
    def next(self) -> Feeds:
        """The next feeds; may block (a queue) or return the same arrays again (synthetic)."""
        ...


class Sink(Protocol):
    def emit(self, outputs: Sequence[np.ndarray], seq: int) -> None:
        ...


def resolve_shape(name: str, shape: Sequence[Any], dims: Mapping[str, int]) -> list[int]:
    """Concrete shape for an ORT input: named dynamic dims from config, others 1."""
    resolved = []
    for dim in shape:
        if isinstance(dim, int) and dim > 0:
            resolved.append(dim)
        elif isinstance(dim, str) and dim in dims:
            resolved.append(int(dims[dim]))
        elif isinstance(dim, str) or dim is None:
            resolved.append(1)
        else:
            raise SourceError(f"input {name}: cannot resolve dimension {dim!r}")
    return resolved


class SyntheticSource:
    """Random inputs shaped from the model, built once and reused for every call."""

    def __init__(self, inputs: Sequence[Any], dims: Mapping[str, int] | None = None,
                 seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.feeds: Feeds = {}
        for arg in inputs:
            dtype = ORT_TYPES.get(arg.type)
            if dtype is None:
                raise SourceError(f"input {arg.name}: unsupported type {arg.type}")
            shape = resolve_shape(arg.name, arg.shape, dims or {})
            self.feeds[arg.name] = rng.random(shape).astype(dtype)

    def next(self) -> Feeds:
        return self.feeds


class NpyDirectorySource:
    """Cycles through ``*.npy`` files (sorted), all loaded up front, fed to one input."""

    def __init__(self, directory: str | Path, input_name: str) -> None:
        files = sorted(Path(directory).glob("*.npy"))
        if not files:
            raise SourceError(f"{directory}: no .npy files")
        self.arrays = [np.load(f, allow_pickle=False) for f in files]
        self.input_name = input_name
        self.index = 0

    def next(self) -> Feeds:
        array = self.arrays[self.index]
        self.index = (self.index + 1) % len(self.arrays)
        return {self.input_name: array}


class QueueSource:
    """Feeds pushed by another part (the MQTT link); ``next`` waits for one."""

    def __init__(self, maxsize: int = 64) -> None:
        self.queue: queue.Queue[Feeds] = queue.Queue(maxsize)

    def push(self, feeds: Feeds) -> None:
        self.queue.put(feeds)

    def next(self) -> Feeds:
        return self.queue.get()


class LogSink:
    """Logs the top class of every ``every``-th result."""

    def __init__(self, every: int = 100) -> None:
        self.every = every

    def emit(self, outputs: Sequence[np.ndarray], seq: int) -> None:
        if seq % self.every == 0:
            logger.info("inference %d: top class %d", seq, int(np.argmax(outputs[0])))


class FileSink:
    """Appends one JSON line per result: sequence, output shapes and the top class."""

    def __init__(self, path: str | Path) -> None:
        self.handle = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the sink

    def emit(self, outputs: Sequence[np.ndarray], seq: int) -> None:
        self.handle.write(json.dumps({"seq": seq, "shapes": [list(o.shape) for o in outputs],
                                      "top": int(np.argmax(outputs[0]))}) + "\n")

    def close(self) -> None:
        self.handle.close()


class CallbackSink:
    """Hands results to a function (the MQTT link's publisher)."""

    def __init__(self, callback: Callable[[Sequence[np.ndarray], int], None]) -> None:
        self.callback = callback

    def emit(self, outputs: Sequence[np.ndarray], seq: int) -> None:
        self.callback(outputs, seq)
