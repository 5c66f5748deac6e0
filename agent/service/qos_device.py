"""The device side of the QoS loop in ``edge-agent run``: the latency ladder over the
profile this agent applied (agent.tuning.latency_knobs, moved under the tuning service's
lock so that a profile switch or rollback never interleaves with a rung), and the device's
figures each window (utilisation, frequencies, throttling, temperature) that the
controller reads and its events carry."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from agent.kernel.reader import SysReader
from agent.telemetry.device import DeviceWindow
from agent.tuning.latency_knobs import KnobError, KnobStep, profile_max_khz

if TYPE_CHECKING:
    from agent.service.tuning import Tuning


class ProfileLadder:
    """The QoS loop's Ladder: empty (no rung to climb) while no profile is applied."""

    def __init__(self, tuning: Tuning) -> None:
        self._tuning = tuning

    @property
    def rung(self) -> int:
        with self._tuning.lock:
            knobs = self._tuning.latency_knobs()
            return knobs.rung if knobs is not None else 0

    def ladder(self) -> list[KnobStep]:
        with self._tuning.lock:
            knobs = self._tuning.latency_knobs()
            return knobs.ladder() if knobs is not None else []

    def apply(self, rung: int) -> None:
        with self._tuning.lock:
            knobs = self._tuning.latency_knobs()
            if knobs is None:
                raise KnobError("no profile is applied by the agent: the latency ladder is "
                                "the profile's")
            knobs.apply(rung)

    def restore(self) -> None:
        with self._tuning.lock:
            knobs = self._tuning.latency_knobs()
            if knobs is not None:
                knobs.restore()


class DeviceReader:
    """Each window's device figures as plain values; a clip at the applied profile's own
    max_khz is the profile's, not throttling (read again each window: a switch moves it)."""

    def __init__(self, tuning: Tuning) -> None:
        self._tuning = tuning
        engine = tuning.engine
        self._window = DeviceWindow(SysReader(engine.root), engine.topology)

    def __call__(self) -> dict[str, Any]:
        engine = self._tuning.engine
        with self._tuning.lock:
            self._window.expected = profile_max_khz(engine.root, engine.journal)
        figures = self._window.figures()
        return asdict(figures) | {"throttled": figures.throttled}
