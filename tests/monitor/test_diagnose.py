"""Every monitor diagnosis rule on realistic 8 x H100 windows (1 s samples): the fault that raises it, and the
near miss that must not (the same bits while idle, a brief spike, a healthy job's normal wobble)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from redline.doctor.model import Area, Finding, Severity
from redline.monitor.diagnose import DiagnosisConfig, all_rules, diagnose, diagnose_report
from redline.monitor.sample import GpuProcess, GpuSample, HostSample, Sample, StepSample
from redline.units import GiB, MiB

T0 = 1_764_000_000.0
GPUS = 8
H100_TOTAL = 81559 * MiB
JOB_PIDS = {1000 + i for i in range(GPUS)}
RULES = all_rules()

GpuFault = Callable[[int, int], dict[str, Any]]  # (second, GPU index) -> fields to change
HostFault = Callable[[int], dict[str, Any]]
StepFault = Callable[[int, int], dict[str, Any] | None]  # (second, rank) -> fields to change; None: no step


def wobble(t: int, i: int, k: int = 0) -> float:
    """Deterministic noise in [-0.5, 0.5], different per second, GPU and quantity."""
    return ((t * 31 + i * 17 + k * 7) % 11) / 10 - 0.5


def healthy_gpu(t: int, i: int) -> GpuSample:
    """An H100 SXM of a data-parallel job at full tilt: kernels always running, boost clocks a little under
    max, now and then at its power cap (as dense GEMMs put it), a Gen5 x16 link, no errors."""
    used = 62 * GiB + int(wobble(t, i, 1) * 256 * MiB)
    return GpuSample(
        index=i,
        uuid=f"GPU-{i:08d}-0000-0000-0000-000000000000",
        name="NVIDIA H100 80GB HBM3",
        utilization_ratio=min(1.0, 0.97 + 0.06 * wobble(t, i)),
        memory_bandwidth_ratio=0.55 + 0.1 * wobble(t, i, 2),
        memory_used_bytes=used,
        memory_total_bytes=H100_TOTAL,
        sm_clock_hertz=1860e6 + 180e6 * wobble(t, i, 3),
        sm_clock_max_hertz=1980e6,
        memory_clock_hertz=2619e6,
        memory_clock_max_hertz=2619e6,
        clock_event_reasons=["sw_power_cap"] if wobble(t, i, 4) > 0.3 else [],
        power_watts=610 + 120 * wobble(t, i, 5),
        power_limit_watts=700.0,
        energy_joules_total=1e9 + 610.0 * t,
        temperature_celsius=63 + 6 * wobble(t, i, 6),
        temperature_slowdown_celsius=87.0,
        pcie_tx_bytes_per_second=3e9,
        pcie_rx_bytes_per_second=5e9,
        pcie_link_generation=5,
        pcie_link_generation_max=5,
        pcie_link_width=16,
        pcie_link_width_max=16,
        pcie_replay_total=0,
        nvlink_tx_bytes_per_second=120e9,
        nvlink_rx_bytes_per_second=120e9,
        ecc_corrected_total=0,
        ecc_uncorrected_total=0,
        xid_total=0,
        sm_activity_ratio=0.8,
        tensor_activity_ratio=0.45,
        processes=[GpuProcess(pid=1000 + i, name="python", user="alice", used_memory_bytes=used - 600 * MiB)],
    )


def healthy_host(t: int) -> HostSample:
    return HostSample(
        cpu_ratio=0.30 + 0.1 * wobble(t, 0, 7),
        cpu_count=192,
        cpu_iowait_ratio=0.01,
        load_1m=55.0,
        memory_used_bytes=700 * GiB,
        memory_total_bytes=2015 * GiB,
        swap_used_bytes=0,
        swap_in_bytes_per_second=0.0,
        swap_out_bytes_per_second=0.0,
        disk_read_bytes_per_second=200e6,
        disk_write_bytes_per_second=5e6,
        network_rx_bytes_per_second=1e8,
        network_tx_bytes_per_second=1e8,
    )


def healthy_step(t: int, rank: int) -> StepSample:
    """One optimizer step a second on every rank; synchronous, so every rank's step takes as long."""
    return StepSample(
        rank=rank,
        step=t + 1,
        time_s=0.98 + 0.02 * wobble(t, 0, 8),
        data_s=0.01,
        compute_s=0.78 + 0.02 * wobble(t, rank, 9),
        optimizer_s=0.06,
        comm_s=0.08,
        samples_per_s=256.0,
        tokens_per_s=1_048_576.0,
        mfu_catalog=0.42,
        peak_memory_bytes=58 * GiB,
        loss=2.1,
    )


def trace(
    n: int = 60,
    *,
    gpu: GpuFault | None = None,
    host: HostFault | None = None,
    steps: StepFault | None = None,
    with_steps: bool = False,
) -> list[Sample]:
    """``n`` one-second samples of a healthy 8-GPU job, with the faults applied; steps only when asked."""
    samples = []
    for t in range(n):
        gpus = [dataclasses.replace(healthy_gpu(t, i), **(gpu(t, i) if gpu else {})) for i in range(GPUS)]
        step_list = []
        if with_steps:
            for rank in range(GPUS):
                change = steps(t, rank) if steps else {}
                if change is not None:
                    step_list.append(dataclasses.replace(healthy_step(t, rank), **change))
        samples.append(
            Sample(
                time=T0 + t,
                gpus=gpus,
                host=dataclasses.replace(healthy_host(t), **(host(t) if host else {})),
                steps=step_list,
            )
        )
    return samples


def only(index: int, change: dict[str, Any], when: Callable[[int], bool] = lambda t: True) -> GpuFault:
    """A fault on one GPU, at the seconds ``when`` picks."""
    return lambda t, i: change if i == index and when(t) else {}


def every(change: dict[str, Any]) -> GpuFault:
    return lambda t, i: change


def lost(t: int, i: int) -> dict[str, Any]:
    """What the sampler records for a GPU that fell off the bus: the flag and nothing else."""
    fields = {f.name: None for f in dataclasses.fields(GpuSample) if f.name not in ("index", "lost", "processes")}
    return fields | {"lost": True, "processes": []}


def findings(window: list[Sample], rule_id: str, **kwargs: Any) -> list[Finding]:
    report = diagnose_report(window, **kwargs)
    assert report.rule_errors == []
    return [f for f in report.findings if f.rule == rule_id]


def one(window: list[Sample], rule_id: str, **kwargs: Any) -> Finding:
    hits = findings(window, rule_id, **kwargs)
    assert len(hits) == 1, f"{rule_id}: {[f.title for f in hits]}"
    return hits[0]


# ----------------------------------------------------------------------------------------- whole windows


@pytest.mark.parametrize("with_steps", [False, True], ids=["gpus-only", "with-steps"])
def test_healthy_job_raises_nothing(with_steps):
    report = diagnose_report(trace(120, with_steps=with_steps), job_pids=JOB_PIDS)
    assert report.rule_errors == []
    assert report.rules_checked == len(RULES)
    assert report.findings == []
    assert diagnose(trace(120, with_steps=with_steps)) == []


def test_all_none_samples_neither_crash_nor_count():
    window = [
        Sample(time=T0 + t, gpus=[GpuSample(index=i) for i in range(GPUS)], host=HostSample(), steps=[])
        for t in range(60)
    ]
    report = diagnose_report(window, job_pids=JOB_PIDS)
    assert report.rule_errors == []
    assert report.findings == []


@pytest.mark.parametrize("window", [[], [Sample(time=T0)], trace(1), trace(3)], ids=["empty", "bare", "one", "three"])
def test_tiny_windows_raise_nothing(window):
    report = diagnose_report(window)
    assert report.rule_errors == []
    assert report.findings == []


def test_short_window_is_not_evidence_of_a_sustained_fault():
    hot = only(3, {"clock_event_reasons": ["hw_thermal_slowdown"], "temperature_celsius": 91.0})
    assert findings(trace(5, gpu=hot), "monitor.thermal") == []
    assert findings(trace(30, gpu=hot), "monitor.thermal")


def test_registry_ids_are_stable_and_unique():
    ids = [r.id for r in RULES]
    assert len(ids) == len(set(ids))
    assert set(ids) == {
        "monitor.input_bound",
        "monitor.throttling",
        "monitor.power_limit",
        "monitor.thermal",
        "monitor.memory_near_full",
        "monitor.straggler",
        "monitor.idle_memory_holder",
        "monitor.foreign_process",
        "monitor.pcie_downgraded",
        "monitor.host_swapping",
        "monitor.gpu_lost",
        "monitor.ecc_xid_errors",
    }
    assert all(isinstance(r.area, Area) and r.summary for r in RULES)


def test_findings_have_the_doctors_shape():
    window = trace(
        60,
        gpu=lambda t, i: {"clock_event_reasons": ["hw_slowdown"], "sm_clock_hertz": 1100e6} if i == 3 else {},
        host=lambda t: {"swap_in_bytes_per_second": 8 * MiB},
    )
    found = diagnose(window)
    assert {f.rule for f in found} >= {"monitor.thermal", "monitor.host_swapping"}
    for f in found:
        assert f.rule in {r.id for r in RULES} and f.area is not None
        assert f.title and "\n" not in f.title and f.cost and f.fix and f.evidence and f.subject
        assert f.to_dict()["rule"] == f.rule
    assert [f.severity.rank for f in found] == sorted(f.severity.rank for f in found)  # worst first


def test_a_crashing_rule_does_not_hide_the_others():
    window = trace(60, host=lambda t: {"swap_in_bytes_per_second": 8 * MiB})
    window[10].gpus[0].clock_event_reasons = 42  # data no sampler writes: the clock rules trip over it
    report = diagnose_report(window)
    assert report.rule_errors and all("could not run" in e for e in report.rule_errors)
    assert "monitor.host_swapping" in {f.rule for f in report.findings}


# ---------------------------------------------------------------------------------------------- health


def test_lost_gpu_mid_window():
    f = one(trace(60, gpu=lambda t, i: lost(t, i) if i == 5 and t >= 31 else {}), "monitor.gpu_lost")
    assert f.severity is Severity.FAIL and f.subject == "GPU 5" and f.area is Area.HARDWARE
    assert f.evidence[5]["first_lost_s"] == 31 and f.evidence[5]["lost_samples"] == 29
    assert "31 s into the window" in f.title


def test_mixed_lost_gpus_raise_only_gpu_lost():
    def fault(t: int, i: int) -> dict[str, Any]:
        return lost(t, i) if (i == 2 and t >= 10) or (i == 5 and t >= 40) else {}

    found = diagnose(trace(60, gpu=fault), job_pids=JOB_PIDS)
    assert [f.rule for f in found] == ["monitor.gpu_lost"]
    assert found[0].subject == "GPUs 2,5" and "first GPU 2, 10 s" in found[0].title
    assert found[0].evidence[2]["uuid"].startswith("GPU-00000002")


def test_ecc_and_xid_counters_that_grew():
    def fault(t: int, i: int) -> dict[str, Any]:
        if i == 4:
            return {"ecc_uncorrected_total": 0 if t < 20 else 2}
        if i == 0:  # the driver reloaded at 30 s (the counter restarted at zero), then 1 new error
            return {"ecc_uncorrected_total": 9 if t < 30 else 0 if t < 45 else 1}
        if i == 1:
            return {"xid_total": 3 if t < 50 else 4}
        if i == 6:
            return {"ecc_corrected_total": 100 + 2 * t}
        return {}

    found = {f.severity: f for f in findings(trace(60, gpu=fault), "monitor.ecc_xid_errors")}
    assert found[Severity.FAIL].subject == "GPUs 0,4"
    assert found[Severity.FAIL].evidence == {"uncorrected_growth": {0: 1, 4: 2}}
    assert found[Severity.FAIL].title.startswith("3 uncorrectable ECC error(s) in the last 60.0 s")
    assert found[Severity.WARN].subject == "GPU 1" and found[Severity.WARN].evidence == {"xid_growth": {1: 1}}
    assert found[Severity.INFO].subject == "GPU 6" and found[Severity.INFO].evidence["corrected_growth"] == {6: 118}


def test_counters_that_reset_or_stand_still_are_not_errors():
    def fault(t: int, i: int) -> dict[str, Any]:
        if i == 4:  # the driver reloaded: the volatile counter went back to zero
            return {"ecc_uncorrected_total": 5 if t < 30 else 0}
        if i == 1:  # old Xids, none new; one unreadable sample in between
            return {"xid_total": None if t == 20 else 7}
        if i == 6:  # a few corrected errors are background
            return {"ecc_corrected_total": 3 if t < 30 else 5}
        return {}

    assert findings(trace(60, gpu=fault), "monitor.ecc_xid_errors") == []


# --------------------------------------------------------------------------------------- clocks, power


def test_thermal_throttling_under_load():
    def fault(t: int, i: int) -> dict[str, Any]:
        if i != 3 or t % 25 >= 18:  # GPU 3 throttled 18 s of every 25: 72%
            return {}
        return {"clock_event_reasons": ["hw_thermal_slowdown"], "temperature_celsius": 88.0, "sm_clock_hertz": 1100e6}

    f = one(trace(50, gpu=fault), "monitor.thermal")
    assert f.severity is Severity.FAIL and f.subject == "GPU 3" and f.area is Area.POWER_THERMAL
    assert "hw_thermal_slowdown" in f.title and "72%" in f.title and "88 °C" in f.title
    assert f.evidence[3]["fraction"] == pytest.approx(0.72)
    assert f.evidence[3]["sm_clock_mhz"] == 1100 and f.evidence[3]["sm_clock_max_mhz"] == 1980
    assert "1980 → 1100 MHz" in f.cost


def test_hardware_slowdown_on_two_gpus_is_one_finding():
    def fault(t: int, i: int) -> dict[str, Any]:
        brake = {"clock_event_reasons": ["sw_power_cap", "hw_power_brake_slowdown"], "sm_clock_hertz": 900e6}
        return brake | {"temperature_celsius": 70.0 + i} if i in (2, 6) else {}

    f = one(trace(60, gpu=fault), "monitor.thermal")
    assert f.subject == "GPUs 2,6" and set(f.evidence) == {2, 6}
    assert "(worst GPU 6: 100% of 60.0 s under load at 76 °C)" in f.title  # a tie goes to the hotter GPU
    assert f.evidence[2]["reasons"] == {"hw_power_brake_slowdown": 60}  # the power cap is not this rule's


def test_throttle_bits_while_idle_are_not_throttling():
    idle = {
        "utilization_ratio": 0.0,
        "clock_event_reasons": ["gpu_idle", "hw_thermal_slowdown", "sw_power_cap", "board_limit"],
        "sm_clock_hertz": 345e6,
    }
    found = diagnose(trace(60, gpu=every(idle)))
    assert {f.rule for f in found} & {"monitor.thermal", "monitor.power_limit", "monitor.throttling"} == set()


def test_brief_thermal_blip_is_not_sustained():
    blip = only(3, {"clock_event_reasons": ["hw_thermal_slowdown"]}, lambda t: 20 <= t < 25)  # 5 of 60 s
    assert findings(trace(60, gpu=blip), "monitor.thermal") == []


def test_other_limiting_reasons_under_load():
    f = one(
        trace(60, gpu=only(6, {"clock_event_reasons": ["board_limit"], "sm_clock_hertz": 1500e6})), "monitor.throttling"
    )
    assert f.severity is Severity.WARN and f.subject == "GPU 6" and "board_limit" in f.title
    assert f.evidence[6]["reasons"] == {"board_limit": 60}


def test_settings_and_idle_bits_are_not_throttling():
    benign = {"clock_event_reasons": ["applications_clocks_setting", "display_clock_setting", "sync_boost"]}
    assert findings(trace(60, gpu=every(benign)), "monitor.throttling") == []


def test_power_cap_at_full_power_is_information():
    capped = {"clock_event_reasons": ["sw_power_cap"], "power_watts": 698.0, "sm_clock_hertz": 1755e6}
    f = one(trace(60, gpu=every(capped)), "monitor.power_limit")
    assert f.severity is Severity.INFO and f.subject == "GPUs 0-7"
    assert "drawing 698 of 700 W" in f.title and "SM 1755 of 1980 MHz" in f.title
    assert f.evidence["lowered_limit"] == [] and f.evidence[0]["power_limit_watts"] == 700.0


def test_lowered_power_limit_on_one_gpu_is_a_warning():
    def fault(t: int, i: int) -> dict[str, Any]:
        if i != 2:
            return {}
        return {
            "clock_event_reasons": ["sw_power_cap"],
            "power_watts": 498.0,
            "power_limit_watts": 500.0,
            "sm_clock_hertz": 1300e6,
        }

    f = one(trace(60, gpu=fault), "monitor.power_limit")
    assert f.severity is Severity.WARN and f.subject == "GPU 2"
    assert f.evidence["lowered_limit"] == [2] and f.evidence["clock_below_ratio"] == [2]
    assert "500 W" in f.cost and "700 W" in f.cost


def test_intermittent_power_cap_is_normal():
    # the healthy trace already sits at the cap ~20% of the time; 40% is still a GPU that mostly boosts
    sometimes = lambda t, i: {"clock_event_reasons": ["sw_power_cap"]} if t % 5 < 2 else {}  # noqa: E731
    assert findings(trace(60, gpu=sometimes), "monitor.power_limit") == []


# ---------------------------------------------------------------------------------------------- memory


def test_memory_near_full():
    f = one(trace(60, gpu=only(1, {"memory_used_bytes": 78.5 * GiB})), "monitor.memory_near_full")
    assert f.severity is Severity.WARN and f.subject == "GPU 1" and f.area is Area.GPU_MEMORY
    assert f.evidence[1]["used_ratio_max"] == pytest.approx(78.5 * GiB / H100_TOTAL, abs=1e-4)
    assert "99% full" in f.title and "78.5 GiB of 79.6 GiB" in f.title


@pytest.mark.parametrize(
    "fault",
    [
        only(1, {"memory_used_bytes": 72 * GiB}),  # 90%: full enough to matter, not near the edge
        only(1, {"memory_used_bytes": 79 * GiB}, lambda t: t < 18),  # near full 30% of the time
        only(1, {"memory_total_bytes": None}),  # no total: nothing to judge
    ],
    ids=["90-percent", "brief", "no-total"],
)
def test_memory_near_misses(fault):
    assert findings(trace(60, gpu=fault), "monitor.memory_near_full") == []


def with_process(index: int, pid: int, nbytes: int, name: str = "python", **change: Any) -> GpuFault:
    def fault(t: int, i: int) -> dict[str, Any]:
        if i != index:
            return {}
        own = healthy_gpu(t, i).processes if "utilization_ratio" not in change else []
        return {"processes": [*own, GpuProcess(pid=pid, name=name, user="bob", used_memory_bytes=nbytes)], **change}

    return fault


def test_foreign_process_on_a_job_gpu():
    f = one(trace(60, gpu=with_process(3, 4242, 12 * GiB)), "monitor.foreign_process", job_pids=JOB_PIDS)
    assert f.severity is Severity.WARN and f.subject == "GPU 3"
    assert f.evidence["processes"] == [{"gpu": 3, "pid": 4242, "name": "python", "user": "bob", "bytes": 12 * GiB}]
    assert "python[4242]" in f.title and "12.0 GiB" in f.title


def test_foreign_process_on_a_gpu_the_job_does_not_use():
    def fault(t: int, i: int) -> dict[str, Any]:
        if i != 7:
            return {}
        return {
            "utilization_ratio": 0.0,
            "processes": [GpuProcess(pid=777, name="jupyter", used_memory_bytes=20 * GiB)],
        }

    window = trace(60, gpu=fault)
    f = one(window, "monitor.foreign_process", job_pids=JOB_PIDS - {1007})
    assert f.severity is Severity.INFO and f.subject == "GPU 7"
    # with job_pids the idle holder is the foreign rule's alone: one finding, not two
    assert findings(window, "monitor.idle_memory_holder", job_pids=JOB_PIDS - {1007}) == []


@pytest.mark.parametrize(
    ("fault", "job_pids"),
    [
        (with_process(3, 4242, 12 * GiB), None),  # without job_pids nothing is foreign
        (with_process(3, 4242, 300 * MiB), JOB_PIDS),  # a CUDA context, not a memory holder
        (with_process(3, 4242, None), JOB_PIDS),  # memory NVML cannot report is no evidence
        (with_process(3, 4242, 12 * GiB), {99_001, 99_002}),  # job pids of another PID namespace: none on a GPU
        (lambda t, i: with_process(3, 4242, 12 * GiB)(t, i) if t < 20 else {}, JOB_PIDS),  # gone after 20 s
    ],
    ids=["no-job-pids", "small", "unknown-size", "other-namespace", "brief"],
)
def test_foreign_process_near_misses(fault, job_pids):
    assert findings(trace(60, gpu=fault), "monitor.foreign_process", job_pids=job_pids) == []


def idle_gpus(indices: set[int], process_bytes: int | None) -> GpuFault:
    def fault(t: int, i: int) -> dict[str, Any]:
        if i not in indices:
            return {}
        procs = (
            [] if process_bytes is None else [GpuProcess(pid=2000 + i, name="python", used_memory_bytes=process_bytes)]
        )
        return {
            "utilization_ratio": 0.0,
            "memory_used_bytes": 30 * GiB if process_bytes is None else process_bytes + 500 * MiB,
            "sm_clock_hertz": 345e6,
            "clock_event_reasons": ["gpu_idle"],
            "processes": procs,
        }

    return fault


def test_idle_memory_holder():
    f = one(trace(60, gpu=idle_gpus({5, 7}, 30 * GiB)), "monitor.idle_memory_holder")
    assert f.severity is Severity.WARN and f.subject == "GPUs 5,7"
    assert {p["pid"] for p in f.evidence["processes"]} == {2005, 2007}
    assert "2 process(es)" in f.title and "60.0 GiB" in f.title


def test_idle_gpu_memory_with_no_visible_process():
    f = one(trace(60, gpu=idle_gpus({5}, None)), "monitor.idle_memory_holder")
    assert f.subject == "GPU 5" and "no visible process" in f.title
    assert f.evidence == {"memory_used_bytes": {5: 30 * GiB}}


def test_idle_holder_is_reported_when_job_pids_match_nothing():
    # the foreign rule cannot judge pids it never sees, so the idle holder stays this rule's
    f = one(trace(60, gpu=idle_gpus({7}, 30 * GiB)), "monitor.idle_memory_holder", job_pids={99_001})
    assert f.subject == "GPU 7"


def test_idle_memory_near_misses():
    assert findings(trace(60, gpu=idle_gpus({6}, 400 * MiB)), "monitor.idle_memory_holder") == []  # a context
    busy_again = lambda t, i: idle_gpus({6}, 30 * GiB)(t, i) if t < 50 else {}  # noqa: E731
    assert findings(trace(60, gpu=busy_again), "monitor.idle_memory_holder") == []  # ran kernels at the end


# --------------------------------------------------------------------------------------------- the job


def test_straggler_rank_from_step_data():
    def slow_rank(t: int, rank: int) -> dict[str, Any]:
        # rank 5 computes 520 ms where the others take 400 ms; everyone's step is as long as rank 5's, and
        # the others spend the difference in exposed communication
        if rank == 5:
            return {"compute_s": 0.52, "comm_s": 0.02, "time_s": 0.62, "data_s": 0.01, "optimizer_s": 0.06}
        return {"compute_s": 0.40, "comm_s": 0.14, "time_s": 0.62, "data_s": 0.01, "optimizer_s": 0.06}

    f = one(trace(40, steps=slow_rank, with_steps=True), "monitor.straggler")
    assert f.severity is Severity.WARN and f.subject == "rank 5" and f.area is Area.DISTRIBUTED
    assert f.evidence[5]["phase"] == "compute_s" and f.evidence[5]["phase_median_s"] == pytest.approx(0.52)
    assert f.evidence[5]["others_phase_median_s"] == pytest.approx(0.40)
    assert f.evidence[5]["own_work_median_s"] == pytest.approx(0.59)
    assert f.evidence[5]["slow_step_fraction"] == 1.0
    assert "Rank 5 takes 26% longer than the other ranks, mostly in compute (compute 520 vs 400 ms" in f.title
    assert "~150 ms per step" in f.cost and "GPU" in f.fix


def test_straggler_rank_with_a_slow_input():
    def slow_input(t: int, rank: int) -> dict[str, Any]:
        # rank 6's DataLoader takes 550 ms per batch; the others wait for it in the all-reduce
        if rank == 6:
            return {"data_s": 0.55, "compute_s": 1.30, "comm_s": 0.10, "time_s": 2.05}
        return {"data_s": 0.02, "compute_s": 1.30, "comm_s": 0.63, "time_s": 2.05}

    f = one(trace(40, steps=slow_input, with_steps=True), "monitor.straggler")
    assert f.subject == "rank 6" and f.evidence[6]["phase"] == "data_s"
    assert "mostly loading data (data 550 vs 20 ms per step" in f.title and "DataLoader" in f.fix
    # one rank's slow input is a straggler, not an input-bound job
    assert findings(trace(40, steps=slow_input, with_steps=True), "monitor.input_bound") == []


def test_slow_rank_nobody_waits_for_is_not_a_straggler():
    # independent ranks (no synchronisation): rank 5 is slower but the others do not wait for it
    def independent(t: int, rank: int) -> dict[str, Any]:
        compute = 0.52 if rank == 5 else 0.40
        return {"compute_s": compute, "comm_s": None, "time_s": compute + 0.07, "data_s": 0.01, "optimizer_s": 0.06}

    assert findings(trace(40, steps=independent, with_steps=True), "monitor.straggler") == []


def test_step_data_outweighs_gpu_clocks():
    # GPU 3's clock is low, but the ranks' step times say nobody is held back
    slow_clock = only(3, {"sm_clock_hertz": 1400e6})
    assert findings(trace(60, gpu=slow_clock, with_steps=True), "monitor.straggler") == []
    assert findings(trace(60, gpu=slow_clock), "monitor.straggler")


def test_straggler_gpu_by_clock():
    f = one(trace(60, gpu=only(3, {"sm_clock_hertz": 1400e6})), "monitor.straggler")
    assert f.subject == "GPU 3" and f.evidence[3]["lags_in"] == "clock" and f.severity is Severity.WARN
    assert f.evidence[3]["value"] == 1400 and 1800 <= f.evidence[3]["others_median"] <= 1950
    assert "lags the other 7 GPUs" in f.title


def test_straggler_gpu_by_utilization():
    f = one(trace(60, gpu=only(6, {"utilization_ratio": 0.55})), "monitor.straggler")
    assert f.subject == "GPU 6" and f.evidence[6]["lags_in"] == "utilization"
    assert f.evidence[6]["value"] == pytest.approx(0.55) and "busy 55%" in f.title


def test_two_straggler_gpus_are_one_finding():
    f = one(
        trace(60, gpu=lambda t, i: {"sm_clock_hertz": 1300e6 + 50e6 * i} if i in (1, 5) else {}), "monitor.straggler"
    )
    assert f.subject == "GPUs 1,5" and "lag the other 6 GPUs of the job (worst GPU" in f.title


def test_straggler_near_misses():
    # an idle GPU outside the job (no job process, utilisation 0) is no straggler
    assert findings(trace(60, gpu=only(7, {"utilization_ratio": 0.0, "processes": []})), "monitor.straggler") == []
    # a second job on GPUs 4-7 at lower utilisation: with job_pids those GPUs are not the job's
    other_job = lambda t, i: {"utilization_ratio": 0.6, "processes": []} if i >= 4 else {}  # noqa: E731
    assert findings(trace(60, gpu=other_job), "monitor.straggler", job_pids=JOB_PIDS) == []
    # a clock 5% lower is within the spread of identical GPUs
    assert findings(trace(60, gpu=only(3, {"sm_clock_hertz": 1780e6})), "monitor.straggler") == []
    # half the GPUs lower is two groups of GPUs, not a straggler
    half = lambda t, i: {"sm_clock_hertz": 1400e6} if i < 4 else {}  # noqa: E731
    assert findings(trace(60, gpu=half), "monitor.straggler") == []


def test_input_bound_from_step_data():
    starved = lambda t, rank: {"data_s": 0.40, "time_s": 1.0}  # noqa: E731
    f = one(trace(30, steps=starved, with_steps=True), "monitor.input_bound")
    assert f.severity is Severity.WARN and f.subject == "ranks 0-7" and f.area is Area.HOST
    assert f.evidence["data_share"] == pytest.approx(0.40) and "40% of the time" in f.title
    assert "1.7x" in f.cost

    very = lambda t, rank: {"data_s": 0.65, "time_s": 1.0}  # noqa: E731
    assert one(trace(30, steps=very, with_steps=True), "monitor.input_bound").severity is Severity.FAIL


def test_input_bound_from_gpus_and_host():
    low = every({"utilization_ratio": 0.41, "clock_event_reasons": []})
    f = one(trace(60, gpu=low, host=lambda t: {"cpu_ratio": 0.97}), "monitor.input_bound")
    assert f.severity is Severity.WARN and f.subject == "GPUs 0-7"
    assert f.evidence["gpu_utilization_median"] == pytest.approx(0.41) and f.evidence["host_cpu_ratio"] == 0.97
    assert "busy only 41%" in f.title and "CPU runs at 97%" in f.title


def test_input_bound_on_storage():
    low = every({"utilization_ratio": 0.3})
    f = one(trace(60, gpu=low, host=lambda t: {"cpu_ratio": 0.25, "cpu_iowait_ratio": 0.35}), "monitor.input_bound")
    assert "waits on storage (iowait 35%)" in f.title and "NVMe" in f.fix


@pytest.mark.parametrize(
    ("gpu", "host", "with_steps"),
    [
        (None, lambda t: {"cpu_ratio": 0.97}, False),  # CPU busy, GPUs busy too: not input-bound
        (every({"utilization_ratio": 0.41}), None, False),  # GPUs half idle, host idle: something else
        (every({"utilization_ratio": 0.41}), lambda t: {"cpu_ratio": 0.97}, True),  # steps: no data wait
        (every({"utilization_ratio": 0.41}), lambda t: {"cpu_ratio": 0.97 if t < 20 else 0.3}, False),  # brief
    ],
    ids=["gpus-busy", "host-idle", "steps-say-no", "brief"],
)
def test_input_bound_near_misses(gpu, host, with_steps):
    assert findings(trace(60, gpu=gpu, host=host, with_steps=with_steps), "monitor.input_bound") == []


# ------------------------------------------------------------------------------------------ PCIe, host


def test_pcie_downgraded_under_load():
    f = one(trace(60, gpu=only(2, {"pcie_link_generation": 4})), "monitor.pcie_downgraded")
    assert f.severity is Severity.FAIL and f.subject == "GPU 2" and f.area is Area.HARDWARE
    assert f.evidence[2]["generation"] == 4 and f.evidence[2]["generation_max"] == 5
    assert "Gen4 x16 under load, capable of Gen5 x16" in f.title
    assert "31.5 of 63.0 GB/s" in f.cost


def test_pcie_different_downgrades_are_separate_findings():
    def fault(t: int, i: int) -> dict[str, Any]:
        return {1: {"pcie_link_width": 8}, 4: {"pcie_link_width": 8}, 6: {"pcie_link_generation": 3}}.get(i, {})

    found = findings(trace(60, gpu=fault), "monitor.pcie_downgraded")
    assert sorted(f.subject for f in found) == ["GPU 6", "GPUs 1,4"]


def test_pcie_downshift_while_idle_is_normal():
    idle = every({"utilization_ratio": 0.0, "pcie_link_generation": 1, "clock_event_reasons": ["gpu_idle"]})
    assert findings(trace(60, gpu=idle), "monitor.pcie_downgraded") == []
    # the link downshifts between bursts of an input-bound GPU: only the loaded seconds count
    bursty = only(2, {"utilization_ratio": 0.0, "pcie_link_generation": 1}, lambda t: t % 2 == 0)
    assert findings(trace(60, gpu=bursty), "monitor.pcie_downgraded") == []


def test_host_swapping():
    def swapping(t: int) -> dict[str, Any]:
        if t < 15:
            return {}
        return {
            "swap_in_bytes_per_second": 8 * MiB,
            "swap_out_bytes_per_second": 4 * MiB,
            "memory_used_bytes": 1980 * GiB,
        }

    f = one(trace(60, host=swapping), "monitor.host_swapping")
    assert f.severity is Severity.WARN and f.subject == "host" and f.area is Area.HOST
    assert f.evidence["swap_in_bytes_per_second"] == 8 * MiB and f.evidence["swapping_fraction"] == 0.75
    assert "12.0 MiB/s" in f.title and "75% of 60.0 s" in f.title and "memory 98% used" in f.title


@pytest.mark.parametrize(
    "host",
    [
        lambda t: {"swap_out_bytes_per_second": 50 * MiB} if t in (30, 31) else {},  # a 2 s spike
        lambda t: {"swap_in_bytes_per_second": 64 * 1024.0, "swap_out_bytes_per_second": 32 * 1024.0},  # a trickle
        lambda t: {"swap_in_bytes_per_second": None, "swap_out_bytes_per_second": None},  # not readable
    ],
    ids=["spike", "trickle", "unknown"],
)
def test_host_swapping_near_misses(host):
    assert findings(trace(60, host=host), "monitor.host_swapping") == []


def test_config_thresholds_are_honoured():
    window = trace(60, gpu=only(1, {"memory_used_bytes": 72 * GiB}))
    assert findings(window, "monitor.memory_near_full") == []
    strict = DiagnosisConfig(memory_full_ratio=0.85)
    assert one(window, "monitor.memory_near_full", config=strict).subject == "GPU 1"
