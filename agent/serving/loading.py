"""The first load round, in the background: the models one after the other as before (one
build's peak memory at a time), each on a thread of its own, so that one whose build takes
longer than ``alone_s`` has the next start beside it: a model whose build hangs keeps only
itself from serving, never the others or the health endpoints.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import TypeVar

_Entry = TypeVar("_Entry")


def load_in_turn(entries: Mapping[str, _Entry], load: Callable[[str, _Entry], None],
                 alone_s: float, stopping: threading.Event) -> None:
    """``load(name, entry)`` for each entry, as above; returns once every load returned
    (none is started once ``stopping`` is set)."""
    loaders = []
    for name, entry in entries.items():
        if stopping.is_set():
            break
        loader = threading.Thread(target=load, args=(name, entry), name=f"load-{name}"[:15],
                                  daemon=True)
        loader.start()
        loaders.append(loader)
        loader.join(alone_s)  # the next one after it, or beside a slow one
    for loader in loaders:
        loader.join()
