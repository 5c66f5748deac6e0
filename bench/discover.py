"""Benchmark: full discovery against a psutil baseline, in one process, as ratios.

The baseline reads the comparable facts psutil offers (cpu_count, per-CPU cpu_freq,
sensors_temperatures, disk_partitions).  Machines here are 2-core and noisy, so each
measurement is the median of many runs and the ratio matters more than absolute times.
Targets (issue 2): discovery <= 50 ms CPU on this machine; `edge-agent discover --json`
<= 300 ms as a whole process.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from agent.discovery import discover
from agent.kernel.fsroot import Root

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures"


def measure(work: Callable[[], object], runs: int) -> tuple[float, float]:
    """Median (wall ms, CPU ms) of ``runs`` calls."""
    walls, cpus = [], []
    for _ in range(runs):
        wall, cpu = time.perf_counter(), time.process_time()
        work()
        cpus.append((time.process_time() - cpu) * 1000)
        walls.append((time.perf_counter() - wall) * 1000)
    return statistics.median(walls), statistics.median(cpus)


def psutil_baseline() -> object:
    return (psutil.cpu_count(), psutil.cpu_freq(percpu=True),
            getattr(psutil, "sensors_temperatures", dict)(), psutil.disk_partitions())


def process_ms(command: list[str], runs: int) -> float:
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        samples.append((time.perf_counter() - start) * 1000)
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()

    base_wall, base_cpu = measure(psutil_baseline, args.runs)
    print(f"psutil baseline on /: wall {base_wall:.2f} ms, CPU {base_cpu:.2f} ms "
          f"(median of {args.runs})")
    print(f"{'tree':<24} {'wall ms':>8} {'CPU ms':>8} {'wall/psutil':>12} {'CPU/psutil':>11}")
    trees = [("/", Root("/"))] + [(p.name, Root(p)) for p in sorted(FIXTURES.iterdir())
                                  if p.is_dir() and not p.name.startswith(("_", "."))]
    host_cpu = 0.0
    for name, root in trees:
        wall, cpu = measure(lambda root=root: discover(root), args.runs)  # type: ignore[misc]
        host_cpu = cpu if name == "/" else host_cpu
        print(f"{name:<24} {wall:>8.2f} {cpu:>8.2f} {wall / base_wall:>11.1f}x "
              f"{cpu / max(base_cpu, 1e-3):>10.1f}x")

    runs = max(5, args.runs // 3)
    python_ms = process_ms([sys.executable, "-c", "pass"], runs)
    agent_ms = process_ms([sys.executable, "-m", "agent", "discover", "--json"], runs)
    print(f"process: `edge-agent discover --json` {agent_ms:.0f} ms, bare python "
          f"{python_ms:.0f} ms, ratio {agent_ms / python_ms:.1f}x (median of {runs})")
    verdict = "met" if host_cpu <= 50 and agent_ms <= 300 else "MISSED"
    print(f"targets (discovery <= 50 ms CPU on /, whole process <= 300 ms): {verdict}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
