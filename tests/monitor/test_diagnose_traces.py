"""The diagnosis end to end on the 8-GPU traces: fake NVML, host and step files -> the real Sampler -> the rules.
Each fault scenario must raise its rule about exactly the GPUs (or ranks) it afflicts, and nothing else; the
same with the step files left out, where the rules must fall back to GPU and host readings."""

from __future__ import annotations

from pathlib import Path

import pytest

from fakes.traces import SCENARIOS, scenario
from redline.monitor.diagnose import diagnose
from redline.monitor.sample import Sample

# scenario -> {(rule, subject)} with steps, and without them
EXPECTED = {
    "healthy": (set(), set()),
    "throttling": ({("monitor.thermal", "GPUs 2,5")}, {("monitor.thermal", "GPUs 2,5")}),
    "power_cap": ({("monitor.power_limit", "GPUs 0-7")}, {("monitor.power_limit", "GPUs 0-7")}),
    "straggler": ({("monitor.straggler", "rank 6")}, {("monitor.straggler", "GPU 6")}),
    "input_bound": ({("monitor.input_bound", "ranks 0-7")}, {("monitor.input_bound", "GPUs 0-7")}),
    "memory_full": ({("monitor.memory_near_full", "GPUs 0-7")}, {("monitor.memory_near_full", "GPUs 0-7")}),
    "foreign_process": ({("monitor.foreign_process", "GPU 4")}, {("monitor.foreign_process", "GPU 4")}),
    "pcie_downgrade": (
        {("monitor.pcie_downgraded", "GPU 3"), ("monitor.pcie_downgraded", "GPU 6")},
        {("monitor.pcie_downgraded", "GPU 3"), ("monitor.pcie_downgraded", "GPU 6")},
    ),
    # swapping slows the input pipeline too: the steps show it, the GPU readings alone do not
    "swapping": (
        {("monitor.host_swapping", "host"), ("monitor.input_bound", "ranks 0-7")},
        {("monitor.host_swapping", "host")},
    ),
    # the lost GPUs come back with Xid 79 in the kernel log
    "nvml_lost": (
        {("monitor.gpu_lost", "GPUs 0-7"), ("monitor.ecc_xid_errors", "GPUs 0-7")},
        {("monitor.gpu_lost", "GPUs 0-7"), ("monitor.ecc_xid_errors", "GPUs 0-7")},
    ),
}


def test_every_scenario_has_an_expectation() -> None:
    assert set(EXPECTED) == set(SCENARIOS)


@pytest.mark.parametrize("name", SCENARIOS)
def test_the_rules_blame_what_each_trace_afflicts(name: str, tmp_path: Path) -> None:
    trace = scenario(name, root=tmp_path)
    samples = trace.run()
    with_steps, without_steps = EXPECTED[name]
    found = diagnose(samples, job_pids=set(trace.job_pids))
    assert {(f.rule, f.subject) for f in found} == with_steps
    no_steps = [Sample(time=s.time, gpus=s.gpus, host=s.host, notes=s.notes) for s in samples]
    assert {(f.rule, f.subject) for f in diagnose(no_steps, job_pids=set(trace.job_pids))} == without_steps
