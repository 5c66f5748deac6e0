"""``Client``: inference on the local data plane, tensors in shared memory.

Each thread that calls gets its own session (a connection and a region of shared memory),
so a call is a send and a receive on the caller's own thread, with no lock and no hand-off,
and threads run their calls at once (the server batches them where the model allows).
``infer_async`` runs ``infer`` on a small thread pool of the client's: each pool thread
holds a session of its own too.

A region is laid out as [views handed out by ``inputs``][inputs copied in][outputs].  An
input that is a view of the calling thread's region is read by the model where it lies; any
other array is copied into the region first.  Outputs are written into the region by the
server and copied out (``copy=False``: views, valid until this thread's next call).
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
import weakref
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from edge_agent_client import _wire
from edge_agent_client._session import Connection, Region
from edge_agent_client.errors import InvalidArgument, ResourceExhausted, ServerError, ServerGone

MB = 1 << 20
DEFAULT_SOCKET = "/run/edge-agent/infer.sock"


def default_path() -> str:
    """The data plane's socket: /run/edge-agent/infer.sock (a data plane run as root),
    else the one a data plane run by this user makes in $XDG_RUNTIME_DIR."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and not os.path.exists(DEFAULT_SOCKET):
        mine = os.path.join(runtime, "edge-agent", "infer.sock")
        if os.path.exists(mine):
            return mine
    return DEFAULT_SOCKET


class _Slot:
    """One thread's session: its region, its connection (None until needed, or after the
    server went) and the views ``inputs`` handed out."""

    def __init__(self, size: int) -> None:
        self.region = Region(size)
        self.connection: Connection | None = None
        self.views: dict[tuple[str, str, int], dict[str, np.ndarray]] = {}
        self.views_end = 0

    def close(self) -> None:
        if self.connection is not None:
            self.connection.close()
            self.connection = None
        self.region.close()

    def __del__(self) -> None:
        """A thread that ends drops its slot (the client holds slots weakly): its session
        and descriptor go with it, so threads that come and go do not use up the server's
        serve.local.max_sessions."""
        self.close()


class Client:
    """The local data plane at ``path`` (None: ``default_path()``).

    ``region_mb``: each thread's shared region to start with (it grows when a call needs
    more; memory is only taken as it is written).  ``timeout_s``: the longest any call waits
    for its answer unless it says otherwise.  ``token``: the bearer token of
    serve.token_file, for the privileged priority levels."""

    def __init__(self, path: str | None = None, *, region_mb: float = 16,
                 timeout_s: float = 60.0, token: str | None = None,
                 async_workers: int = 4) -> None:
        self.path = path or default_path()
        self.region_bytes = int(region_mb * MB)
        self.timeout_s = timeout_s
        self.token = token
        self._local = threading.local()
        self._slots: weakref.WeakSet[_Slot] = weakref.WeakSet()  # held by their threads
        self._lock = threading.Lock()
        self._metadata: dict[tuple[str, str], dict[str, Any]] = {}
        self._async_workers = async_workers
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False

    # -- sessions -------------------------------------------------------------------------

    def _slot(self) -> _Slot:
        slot: _Slot | None = getattr(self._local, "slot", None)
        if slot is None:
            if self._closed:
                raise ServerGone("the client is closed")
            slot = _Slot(self.region_bytes)
            with self._lock:
                self._slots.add(slot)
            self._local.slot = slot
        return slot

    def _call(self, slot: _Slot, message: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """``message`` on this thread's session; a server gone is reconnected once (the
        same region: views stay valid) and asked again, else ServerGone."""
        for attempt in (0, 1):
            fresh = slot.connection is None
            if fresh:
                slot.connection = Connection(self.path, slot.region, self.token)
            assert slot.connection is not None
            try:
                return slot.connection.call(message, timeout_s)
            except ServerGone:
                slot.connection.close()
                slot.connection = None
                if fresh or attempt:
                    raise
            except BaseException as error:
                if not (isinstance(error, ServerError) and error.answered):
                    slot.connection.close()  # its answer may still come: not on this socket
                    slot.connection = None
                raise
        raise AssertionError("unreachable")

    def _grow(self, slot: _Slot, needed: int) -> None:
        """A region of at least ``needed`` bytes (a new session: views of the old region
        stay readable, and are copied in from then on)."""
        size = max(needed, 2 * slot.region.size)
        slot.close()
        slot.region = Region(size)
        slot.views, slot.views_end = {}, 0

    # -- calls ----------------------------------------------------------------------------

    def metadata(self, model: str, version: str = "") -> dict[str, Any]:
        """``{name, versions, platform, inputs, outputs}``, each tensor ``{name, datatype,
        shape}`` with -1 for a dynamic dimension."""
        key = (model, version)
        if key not in self._metadata:
            self._metadata[key] = self._call(self._slot(), {"op": "metadata", "model": model,
                                                            "version": version},
                                             self.timeout_s)
        return self._metadata[key]

    def inputs(self, model: str, batch: int = 1, version: str = ""
               ) -> dict[str, np.ndarray]:
        """Writable arrays in this thread's region, one per model input (a dynamic first
        dimension is ``batch``, any other dynamic one 1): write a frame into them and pass
        them to ``infer``, and the model reads them where they are.  The same arrays on
        each call for the same model and batch."""
        slot = self._slot()
        key = (model, version, batch)
        if key in slot.views:
            return slot.views[key]
        specs = self.metadata(model, version)["inputs"]
        shapes = [_shape(spec["shape"], batch) for spec in specs]
        sizes = [int(np.prod(shape)) * np.dtype(_wire.DATATYPES[spec["datatype"]]).itemsize
                 for spec, shape in zip(specs, shapes)]
        end = slot.views_end
        for size in sizes:
            end = _wire.aligned(end) + size
        if end > slot.region.size // 2:  # keep half for copies and outputs
            self._grow(slot, 4 * end)
        views, offset = {}, slot.views_end
        for spec, shape, size in zip(specs, shapes, sizes):
            offset = _wire.aligned(offset)
            views[spec["name"]] = slot.region.view(spec["datatype"], shape, offset)
            offset += size
        slot.views_end = offset
        slot.views[key] = views
        return views

    def infer(self, model: str, inputs: Mapping[str, Any], *, version: str = "",
              outputs: Sequence[str] | None = None, priority: int = 0,
              timeout_s: float | None = None, copy: bool = True
              ) -> dict[str, np.ndarray]:
        """The model's outputs for ``inputs`` ({name: array}); ``outputs`` names those
        wanted (None: all).  ``priority``: the model's level (1 the highest; 0 its default).
        ``timeout_s``: DeadlineExceeded when no answer came by then (the server also drops
        it from its queue where the model's config allows a request's own timeout).
        ``copy=False``: outputs are views of the region, overwritten by this thread's next
        call.  Raises the ServerError subclass of the server's code."""
        slot = self._slot()
        wait = self.timeout_s if timeout_s is None else timeout_s
        for _ in range(3):  # at most: grow for the inputs, then for the outputs
            placed, end = self._place(slot, inputs)
            if end > slot.region.size:
                self._grow(slot, 2 * end)
                continue
            message: dict[str, Any] = {"op": "infer", "model": model, "version": version,
                                       "inputs": placed,
                                       "area": [end, slot.region.size - end]}
            if outputs is not None:
                message["outputs"] = list(outputs)
            if priority:
                message["priority"] = priority
            if timeout_s is not None:
                message["timeout_us"] = max(1, int(timeout_s * 1e6))
            try:
                reply = self._call(slot, message, wait)
            except ResourceExhausted as error:
                if error.needed is None:
                    raise
                self._grow(slot, end + error.needed + _wire.ALIGNMENT)
                continue
            result = {}
            for name, datatype, shape, offset in reply["outputs"]:
                array = slot.region.view(datatype, shape, offset)
                result[name] = array.copy() if copy else array
            return result
        raise InvalidArgument("the request does not fit a shared region however grown")

    def _place(self, slot: _Slot, inputs: Mapping[str, Any]) -> tuple[list[Any], int]:
        """Each input's [name, datatype, shape, offset] (copied in unless it is a view of
        the region), and where the copies end."""
        placed, end = [], slot.views_end
        for name, value in inputs.items():
            array = np.asarray(value)
            if array.dtype.byteorder == ">":
                array = array.astype(array.dtype.newbyteorder("<"))
            try:
                datatype = _wire.datatype_of(array.dtype)
            except KeyError:
                raise InvalidArgument(f"input {name}: numpy type {array.dtype} has no "
                                      f"protocol datatype ({', '.join(_wire.DATATYPES)})") \
                    from None
            offset = slot.region.offset_of(array)
            if offset is None:
                offset = end = _wire.aligned(end)
                end += array.nbytes
                if end <= slot.region.size:
                    slot.region.view(datatype, array.shape, offset)[...] = array
            placed.append([name, datatype, list(array.shape), offset])
        return placed, _wire.aligned(end)

    async def infer_async(self, model: str, inputs: Mapping[str, Any],
                          **options: Any) -> dict[str, np.ndarray]:
        """``infer`` off the event loop, on the client's thread pool (``async_workers``
        threads, each with its own session)."""
        if self._pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self._async_workers, "edge-agent-client")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._pool, functools.partial(self.infer, model, inputs, **options))

    def close(self) -> None:
        """End every session (a thread's next call raises ServerGone)."""
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        with self._lock:
            slots, self._slots = list(self._slots), weakref.WeakSet()
        for slot in slots:
            slot.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _shape(shape: Sequence[int], batch: int) -> tuple[int, ...]:
    return tuple(batch if d < 0 and i == 0 else 1 if d < 0 else d
                 for i, d in enumerate(shape))
