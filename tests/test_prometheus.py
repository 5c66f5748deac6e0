"""Telemetry metrics as Prometheus samples: groups become names, list items labels."""

from __future__ import annotations

from agent.telemetry.prometheus import flatten


def test_nested_groups_lists_and_strings() -> None:
    metrics = {
        "cpu": {"util_pct": 12.5, "cores": [{"cpu": 0, "util_pct": 10.0, "freq_khz": None},
                                           {"cpu": 4, "util_pct": 15.0, "freq_khz": 2201600}]},
        "thermal": [{"zone": "thermal_zone0", "type": "cpu-thermal", "temp_c": 45.5}],
        "npus": [{"name": "rknpu", "util_pct": 30.0, "core_util_pct": [20, 40, 30]}],
        "thp": {"enabled": "madvise", "counters": {"thp_fault_alloc": 7}},
        "tuning": {"applied": True, "drift": None},
    }
    samples = {(name, tuple(sorted(labels.items()))): value
               for name, labels, value in flatten(metrics)}
    assert samples[("edge_agent_cpu_util_pct", ())] == 12.5
    assert samples[("edge_agent_cpu_cores_util_pct", (("cpu", "4"),))] == 15.0
    assert samples[("edge_agent_cpu_cores_freq_khz", (("cpu", "4"),))] == 2201600
    assert ("edge_agent_cpu_cores_freq_khz", (("cpu", "0"),)) not in samples  # null: absent
    assert samples[("edge_agent_thermal_temp_c", (("type", "cpu-thermal"),
                                                  ("zone", "thermal_zone0")))] == 45.5
    assert samples[("edge_agent_npus_core_util_pct", (("index", "1"), ("name", "rknpu")))] == 40
    assert samples[("edge_agent_thp_enabled", (("value", "madvise"),))] == 1.0
    assert samples[("edge_agent_thp_counters_thp_fault_alloc", ())] == 7
    assert samples[("edge_agent_tuning_applied", ())] == 1.0
    assert not any(name == "edge_agent_tuning_drift" for name, _ in samples)
