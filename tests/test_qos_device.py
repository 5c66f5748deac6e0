"""The QoS loop's slowest lever on a real data plane and a fixture board: with the model's
own levers spent, it climbs the device's latency ladder (CPU frequency floors written through
the tuning journal of the profile ``edge-agent run`` applied), each move an event carrying the
device's figures; given back when it did not help; the profile's own floors again when the
loop stops, and the pristine tree after the profile's rollback."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path
from typing import Any

from test_qos_loop import Plane, plane, qos, windows  # noqa: F401  (plane: the fixture)
from tuning_helpers import copy_board, snapshot

from agent.control.qos import Hysteresis, QosController
from agent.discovery import discover
from agent.kernel.fsroot import Root
from agent.service.parts import Ending
from agent.service.qos import QosLoop
from agent.service.qos_device import DeviceReader, ProfileLadder
from agent.service.qos_inputs import Objectives
from agent.service.tuning import Tuning
from agent.serving.registry import ModelRegistry

POLICY4 = "sys/devices/system/cpu/cpufreq/policy4/scaling_min_freq"


def test_the_ladder_is_climbed_last_with_the_device_figures_and_put_back_on_stop(
        plane: tuple[ModelRegistry, Plane, Path], tmp_path: Path) -> None:  # noqa: F811
    registry, supervisor, repo = plane
    tree = copy_board("rk3588-vendor", tmp_path)
    pristine = snapshot(tree)
    root = Root(str(tree))
    tuning = Tuning(root, discover(root), tmp_path / "state", "rk3588", True,
                    lambda kind, **fields: None)
    tuning.start()
    assert tuning.applied, tuning.error
    applied = snapshot(tree)
    profile_floor = (tree / POLICY4).read_text()
    ladder = ProfileLadder(tuning)
    rungs = len(ladder.ladder())
    assert rungs >= 3, "rk3588's profile leaves floors to climb"
    events: list[tuple[str, dict[str, Any]]] = []
    loop = QosLoop(qos("control"), supervisor, Objectives(repo),
                   lambda kind, **fields: events.append((kind, fields)),
                   QosController(Hysteresis(violate_windows=2)), ladder=ladder,
                   device=DeviceReader(tuning))
    try:
        windows(loop, registry, 12 + 3 * rungs)
        actions = [f for kind, f in events if kind == "qos_action"]
        kinds = [a["lever"] for a in actions]
        # lifted as it serves (latency-critical), then the model's own delay: all of it at
        # once, the p99 being more than 4 ms above it
        assert kinds[:2] == ["realtime", "max_queue_delay_us"], kinds
        assert kinds.count("max_queue_delay_us") == 1 and kinds.count("realtime") == 1, kinds
        ladder_moves = [a for a in actions if a["lever"] == "device_rung"]
        climbed = [a for a in ladder_moves if a["tighten"]]
        # one rung at a time from the profile's own, never past the top; each move starts
        # where the last one left the ladder
        assert climbed and (climbed[0]["before"], climbed[0]["after"]) == (0, 1)
        assert all(a["after"] == a["before"] + 1 <= rungs - 1 for a in climbed), climbed
        assert all(b["before"] == a["after"] for a, b in pairwise(ladder_moves))
        assert all(a["applied"] is True and a["model"] == "lc" for a in climbed)
        device = climbed[0]["figures"]["device"]
        assert device["throttled"] is False and device["hottest_c"] is not None
        assert set(device["cur_khz"]) >= {"policy4", "policy6"}
        given = [a for a in ladder_moves if not a["tighten"]]
        # a trial gives a rung back when the windows after it were no better (a fixture's
        # frequency moves no latency: which ones is the machine's timing to say)
        assert all("did not help" in a["why"] and a["after"] < a["before"] for a in given)
        assert ladder.rung == ladder_moves[-1]["after"]
        if not given:
            assert ladder.rung == rungs - 1
            assert int((tree / POLICY4).read_text()) > int(profile_floor)
        assert loop.metrics()["device"]["rungs"] == rungs
    finally:
        loop.stop()
    assert ladder.rung == 0
    assert snapshot(tree) == applied, "the profile's own floors were not put back"
    tuning.stop(Ending(flush_s=0, rollback=True))
    assert snapshot(tree) == pristine
