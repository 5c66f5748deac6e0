"""Power in ``model tune``: the device's total from its rails (the input rail where the board
has one, else their sum), sampled through each load in a thread that the load's end stops,
reported per candidate, in the table only where a board has rails, and a fourth objective
of the Pareto front.  The rails are fixture boards' (static files: the figure is exact);
the data plane and the load are real."""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from agent.discovery import discover
from agent.kernel.fsroot import Root
from agent.modeltune.power import RailPower, Sampling
from agent.modeltune.search import Result, pareto
from agent.modeltune.space import Candidate
from agent.telemetry.collectors.power import total_mw
from tests.cli_helpers import edge_agent
from tests.tuning_helpers import FIXTURES

# each board's rails as its fixture tree holds them (tests/golden/<board>.json): Orin Nano's
# VDD_IN 5080 mV x 1180 mA, not VDD_IN + VDD_CPU_GPU_CV + VDD_SOC (9169.4: its parts twice);
# AGX Orin has no input rail: VDD_GPU_SOC + VDD_CPU_CV + VIN_SYS_5V0 + VDDQ_VDD2_1V8AO
ORIN_NANO_MW = 5994.4
AGX_ORIN_MW = 8592.128


def rail_power(board: str) -> RailPower | None:
    root = Root(FIXTURES / board)
    return RailPower.of(root, discover(root))


@pytest.mark.parametrize(("board", "total", "described"), [
    ("jetson-orin-nano-jp6", ORIN_NANO_MW, "VDD_IN (the input rail)"),
    ("jetson-xavier-nx-jp5-rt", 5090.4, "VDD_IN (the input rail)"),
    ("jetson-agx-orin-jp6", AGX_ORIN_MW, "VDD_GPU_SOC + VDD_CPU_CV + VIN_SYS_5V0 + "
     "VDDQ_VDD2_1V8AO (no input rail: approximate)"),
    ("rk3588-vendor", None, None),  # regulators: voltages, no current sense
])
def test_the_total_is_the_input_rail_else_the_sum_of_the_rails(
        board: str, total: float | None, described: str | None) -> None:
    power = rail_power(board)
    assert power is not None
    assert power.read() == total
    if described is not None:
        assert power.described == described


def test_a_board_without_rails_has_no_power_and_an_unread_input_rail_is_not_its_parts(
        ) -> None:
    assert rail_power("bare-vm") is None
    parts = [{"name": "VDD_IN", "power_mw": None}, {"name": "VDD_SOC", "power_mw": 1930.4}]
    assert total_mw(parts) is None
    older = [{"name": "POM_5V_CPU", "power_mw": 900.0}, {"name": "POM_5V_IN", "power_mw": 4000.0}]
    assert total_mw(older) == 4000.0  # L4T 32's name for the input rail
    assert total_mw([{"name": "a", "power_mw": 1.5}, {"name": "b", "power_mw": 2.25}]) == 3.75


def counting(values: list[float | None], enough: int
             ) -> tuple[Callable[[], float | None], list[float | None], threading.Event]:
    """A reader returning ``values`` in turn (the last one again when they run out), the
    values it returned, and an event set once it has returned ``enough`` of them."""
    returned: list[float | None] = []
    reached = threading.Event()

    def read() -> float | None:
        value = values[min(len(returned), len(values) - 1)]
        returned.append(value)
        if len(returned) >= enough:
            reached.set()
        return value

    return read, returned, reached


def sampler_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "tune-power"]


def test_the_sampler_averages_what_it_read_and_stops_with_the_load() -> None:
    read, returned, reached = counting([1000.0, None, 2000.0, 4000.0], 4)
    with Sampling(read, interval_s=0.001) as sampling:
        assert reached.wait(10), "the sampler did not read 4 times in 10 s"
    assert not sampler_threads()
    known = [v for v in returned if v is not None]
    assert sampling.mean_mw() == round(sum(known) / len(known), 3)
    assert len(returned) >= 4 and returned[1] is None  # a read without a value is not a 0


def test_the_sampler_reads_once_however_short_the_load_and_stops_on_an_error() -> None:
    read, returned, _ = counting([750.0], 1)
    with pytest.raises(RuntimeError), Sampling(read, interval_s=60) as sampling:
        raise RuntimeError("the load failed")
    assert not sampler_threads()
    assert returned == [750.0] and sampling.mean_mw() == 750.0
    with Sampling(None) as nothing:
        assert not sampler_threads()  # no rails: no thread
    assert nothing.mean_mw() is None
    unread, _, _ = counting([None], 1)
    with Sampling(unread) as never:
        pass
    assert never.mean_mw() is None


def test_power_is_a_fourth_objective_of_the_front_where_both_have_it() -> None:
    a, b, c, d = (Candidate(1, n, 1, 0) for n in (1, 2, 3, 4))
    results = [Result(a, 5, 100, 100, True, "", power_mw=6000),
               Result(b, 5, 100, 100, True, "", power_mw=6500),  # a's figures at more power
               Result(c, 9, 80, 80, True, "", power_mw=4000)]  # slower, less, but cheaper
    assert pareto(results) == [True, False, True]
    assert pareto([dataclasses.replace(r, power_mw=None) for r in results]) == [
        True, True, False]  # without power, b ties a and c is beaten
    unread = Result(d, 5, 100, 100, True, "")  # a window where no rail was read
    assert pareto([results[0], unread]) == [True, True]  # a's equal: power not compared


FAST = ("--exhaustive", "--space", "threads=1,2", "--space", "count=1", "--space", "batch=1",
        "--window-s", "0.2")


@pytest.mark.parametrize(("board", "total"), [("jetson-orin-nano-jp6", ORIN_NANO_MW),
                                              ("bare-vm", None)])
def test_model_tune_reports_the_boards_power_per_candidate_and_a_column_only_with_rails(
        tmp_path: Path, shared_board: Callable[[str], Path], board: str,
        total: float | None) -> None:
    tree = shared_board(board)
    repository = tmp_path / "repository"
    (repository / "demo").mkdir(parents=True)
    args = ("model", "tune", "demo", "--repository", repository, "--root", tree, *FAST)
    result = edge_agent(*args, "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert len(report["candidates"]) == 2
    assert [c["power_mw"] for c in report["candidates"]] == [total, total]
    assert report["power_mw"] == total and report["confirmed"]["power_mw"] == total
    noted = [n for n in report["notes"] if n.startswith("power: ")]
    assert noted == ([] if total is None else [
        "power: VDD_IN (the input rail), read every 0.1 s through each load and averaged"])

    shown = edge_agent(*args)
    assert shown.returncode == 0, shown.stderr
    header = next(line for line in shown.stdout.splitlines() if "p99_ms" in line)
    rows = [line for line in shown.stdout.splitlines()
            if line.endswith(" clients") and "note:" not in line]
    assert len(rows) == 2, shown.stdout
    if total is None:
        assert "power_mw" not in header
    else:
        assert header.split().index("power_mw") > header.split().index("cpu")
        assert all(f"  {total:.0f}  " in row for row in rows), shown.stdout
