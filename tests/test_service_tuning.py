"""The service's tuning is driven from two threads: hot-plug retargets it from the main loop
while fleet commands switch and roll it back from the controller's worker."""

from __future__ import annotations

import threading
from pathlib import Path
from types import TracebackType
from typing import Any

from tuning_helpers import copy_board

from agent.discovery import discover
from agent.kernel.fsroot import Root
from agent.service.tuning import Tuning

BOARD, PROFILE = "jetson-agx-orin-jp6", "jetson-orin-latency"


class ProbedLock:
    """Tuning's lock, noting when the hot-plug thread finds it held and has to wait."""

    def __init__(self, inner: Any, seen: list[str], reached: threading.Event) -> None:
        self.inner, self.seen, self.reached = inner, seen, reached

    def __enter__(self) -> None:
        if not self.inner.acquire(blocking=False):
            if threading.current_thread().name == "hotplug":
                self.seen.append("lock")
                self.reached.set()
            self.inner.acquire()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.inner.release()


def test_a_retarget_waits_for_a_switch_in_progress(tmp_path: Path) -> None:
    root = Root(str(copy_board(BOARD, tmp_path)))
    tuning = Tuning(root, discover(root), tmp_path / "state", PROFILE, True,
                    lambda kind, **fields: None)
    seen: list[str] = []  # what the hot-plug thread met first: the lock, or the engine
    applying, release, reached = threading.Event(), threading.Event(), threading.Event()
    tuning.lock = ProbedLock(tuning.lock, seen, reached)  # type: ignore[assignment]
    apply, plan = tuning.engine.apply, tuning.engine.plan

    def held_apply(name: str, force: bool = False) -> Any:
        applying.set()
        assert release.wait(30)
        return apply(name, force=force)

    def watched_plan(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread().name == "hotplug":
            seen.append("engine")
            reached.set()
        return plan(*args, **kwargs)

    tuning.engine.apply, tuning.engine.plan = held_apply, watched_plan  # type: ignore[method-assign]
    switch = threading.Thread(target=tuning.switch, args=(PROFILE,), name="control")
    switch.start()
    assert applying.wait(30)  # the switch is half-way: planned, now writing the tree
    retarget = threading.Thread(target=tuning.retarget, args=(discover(root),),
                                name="hotplug")
    retarget.start()
    assert reached.wait(30)
    assert seen == ["lock"]  # it waits; it did not plan against a half-applied tree
    release.set()
    switch.join(30)
    retarget.join(30)
    assert not switch.is_alive() and not retarget.is_alive()
    assert seen[0] == "lock" and set(seen[1:]) == {"engine"}  # then it applied again
    assert tuning.applied and tuning.profile == PROFILE and tuning.error is None
    assert tuning.drift == 0
