"""Step metrics: phases land where they ran, records round-trip through JSON lines, MFU and the comparison
with a plan are the stated arithmetic, output is throttled and rank 0's, and peaks come from the catalog
and from this machine's saved bench run."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from redline.bench import store
from redline.bench.model import BenchRun, Measurement
from redline.errors import BadInput
from redline.runtime.metrics import StepMetrics, StepRecord, explain, peak_flops, rank_path
from redline.runtime.step_lines import SPLIT_LEGEND, format_step


class FakeClock:
    """A host clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def fake_steps(metrics: StepMetrics, clock: FakeClock, seconds: list[float], samples: int = 8) -> list[StepRecord]:
    """One step per entry of ``seconds``: a data wait of 10% of it, compute for the rest."""
    records = []
    for i, step_s in enumerate(seconds):
        with metrics.data_wait():
            clock.now += 0.1 * step_s
        with metrics.compute():
            clock.now += 0.9 * step_s
        records.append(metrics.end_step(samples=samples, loss=1.0 / (i + 1), micro_batch=samples, accumulation=1))
    return records


@pytest.fixture
def redline_home(tmp_path, monkeypatch):
    monkeypatch.setenv("REDLINE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


# ------------------------------------------------------------------------------------------- phases


def test_phases_are_attributed_where_they_ran():
    metrics = StepMetrics(device=torch.device("cpu"), console=None)
    with metrics.data_wait():
        time.sleep(0.03)
    for _ in range(2):  # two micro-batches
        with metrics.compute():
            time.sleep(0.02)
    with metrics.optimizer():
        time.sleep(0.01)
    metrics.add_comm(0.005)
    time.sleep(0.01)  # outside every phase: only the step time sees it
    record = metrics.end_step(samples=4, loss=2.5, micro_batch=2, accumulation=2)

    slack = 0.05  # a loaded CI machine oversleeps; never undersleeps
    assert 0.03 <= record.data_s < 0.03 + slack
    assert 0.04 <= record.compute_s < 0.04 + slack
    assert 0.01 <= record.optimizer_s < 0.01 + slack
    assert record.comm_s == 0.005
    assert record.time_s >= record.data_s + record.compute_s + record.optimizer_s + 0.01
    assert record.peak_memory_bytes is None  # CPU
    assert (record.step, record.loss, record.micro_batch, record.accumulation, record.rank) == (1, 2.5, 2, 2, 0)

    # the next step starts where this one ended, with its phases at zero and no communication reported
    with metrics.compute():
        time.sleep(0.01)
    second = metrics.end_step(samples=4, loss=None, micro_batch=2, accumulation=2, skipped=True)
    assert second.step == 2 and second.data_s == 0.0 and second.optimizer_s == 0.0 and second.comm_s is None
    assert second.loss is None and second.skipped


def test_an_exception_inside_a_phase_still_closes_it():
    clock = FakeClock()
    metrics = StepMetrics(device=torch.device("cpu"), console=None, clock=clock)
    with pytest.raises(torch.OutOfMemoryError), metrics.compute():
        clock.now += 1.0
        raise torch.OutOfMemoryError("fake")
    with metrics.compute():
        clock.now += 2.0
    assert metrics.end_step(samples=1, loss=None, micro_batch=1, accumulation=1).compute_s == 3.0


def test_steps_tile_the_wall_clock():
    clock = FakeClock()
    metrics = StepMetrics(device=torch.device("cpu"), console=None, clock=clock)
    clock.now += 100.0  # model set-up before the first phase is not the first step's
    first = fake_steps(metrics, clock, [2.0])[0]
    clock.now += 5.0  # between steps (a checkpoint save): the next step's
    second = fake_steps(metrics, clock, [1.0])[0]
    assert first.time_s == pytest.approx(2.0)
    assert second.time_s == pytest.approx(6.0)
    assert metrics.summary()["total"]["time_s"] == pytest.approx(8.0)


def test_loss_may_be_a_tensor_read_after_the_steps_sync():
    metrics = StepMetrics(device=torch.device("cpu"), console=None)
    record = metrics.end_step(samples=1, loss=torch.tensor(0.25), micro_batch=1, accumulation=1)
    assert record.loss == 0.25 and type(record.loss) is float


# ---------------------------------------------------------------------------------------------- files


def test_json_lines_parse_and_match_the_records(tmp_path):
    path = tmp_path / "logs" / "steps.jsonl"  # the folder is created
    clock = FakeClock()
    metrics = StepMetrics(
        device=torch.device("cpu"),
        path=path,
        console=None,
        clock=clock,
        flops_per_sample=1e9,
        peak_flops_measured=1e12,
    )
    records = fake_steps(metrics, clock, [1.0, 0.5, 0.25])
    lines = path.read_text().splitlines()  # line-buffered: readable before close
    assert [json.loads(line) for line in lines] == [r.to_dict() for r in records]
    metrics.close()
    parsed = json.loads(lines[1])
    assert parsed["step"] == 2 and parsed["time_s"] == 0.5 and parsed["mfu_catalog"] is None
    assert set(parsed) == set(StepRecord.__dataclass_fields__)


def test_json_lines_append_so_a_resumed_run_keeps_the_first_attempt(tmp_path):
    path = tmp_path / "steps.jsonl"
    for _ in range(2):
        clock = FakeClock()
        metrics = StepMetrics(device=torch.device("cpu"), path=path, console=None, clock=clock)
        fake_steps(metrics, clock, [1.0])
        metrics.close()
    assert len(path.read_text().splitlines()) == 2


@pytest.mark.parametrize(
    ("path", "rank", "expected"),
    [
        (None, 0, None),
        ("m.jsonl", 0, "m.jsonl"),
        ("m.jsonl", 3, None),
        ("m-{rank}.jsonl", 0, "m-0.jsonl"),
        ("m-{rank}.jsonl", 3, "m-3.jsonl"),
    ],
)
def test_rank_path(path, rank, expected):
    assert rank_path(path, rank) == (None if expected is None else Path(expected))


def test_other_ranks_write_and_print_nothing_unless_the_path_names_them(tmp_path):
    lines: list[str] = []
    shared = tmp_path / "steps.jsonl"
    clock = FakeClock()
    silent = StepMetrics(
        device=torch.device("cpu"), world_size=2, rank=1, path=shared, console=lines.append, clock=clock
    )
    fake_steps(silent, clock, [1.0, 1.0])
    silent.close()
    assert not shared.exists() and lines == []

    per_rank = StepMetrics(
        device=torch.device("cpu"), world_size=2, rank=1, path=tmp_path / "steps-{rank}.jsonl", console=None
    )
    per_rank.end_step(samples=4, loss=None, micro_batch=4, accumulation=1)
    per_rank.close()
    written = (tmp_path / "steps-1.jsonl").read_text().splitlines()
    assert [json.loads(line)["rank"] for line in written] == [1]
    assert json.loads(written[0])["samples"] == 8  # global: 4 on each of 2 ranks


def test_mfu_of_a_step_is_global_samples_over_all_devices_peak():
    clock = FakeClock()
    metrics = StepMetrics(
        device=torch.device("cpu"),
        world_size=4,
        rank=0,
        flops_per_sample=6e12,
        tokens_per_sample=2048,
        peak_flops_catalog=100e12,
        peak_flops_measured=80e12,
        console=None,
        clock=clock,
    )
    with metrics.compute():
        clock.now += 2.0
    record = metrics.end_step(samples=8, loss=None, micro_batch=4, accumulation=2)  # 8 per rank
    assert record.samples == 32 and record.tokens == 32 * 2048
    assert record.samples_per_s == pytest.approx(16.0) and record.tokens_per_s == pytest.approx(16.0 * 2048)
    assert record.mfu_catalog == pytest.approx(6e12 * 16 / (4 * 100e12))  # 0.24
    assert record.mfu_measured == pytest.approx(6e12 * 16 / (4 * 80e12))  # 0.30


# --------------------------------------------------------------------------------------------- summary


PREDICTED = {
    "step_time_s": {"compute": 0.7, "total": 0.8},
    "samples_per_s": 40.0,
    "tokens_per_s": 40.0 * 1024,
    "memory_bytes": {"allocated": 2e9, "device_total": 3e9},
    "mfu": 0.5,
}


def test_summary_medians_skip_warm_up_and_compare_with_the_plan():
    clock = FakeClock()
    metrics = StepMetrics(
        device=torch.device("cpu"),
        world_size=4,
        flops_per_sample=1e12,
        tokens_per_sample=1024,
        peak_flops_catalog=200e12,
        console=None,
        clock=clock,
    )
    fake_steps(metrics, clock, [10.0, 5.0, 1.0, 1.0, 1.2, 0.9], samples=8)
    summary = metrics.summary(PREDICTED)

    assert summary["steps"] == 6 and summary["warmup_steps"] == 2 and summary["skipped_steps"] == 0
    median = summary["median"]
    assert median["time_s"] == pytest.approx(1.0)  # of 1.0, 1.0, 1.2, 0.9: the slow first two left out
    assert median["samples_per_s"] == pytest.approx(32.0)  # 8 per rank x 4 ranks per second
    assert median["tokens_per_s"] == pytest.approx(32.0 * 1024)
    assert median["data_s"] == pytest.approx(0.1) and median["compute_s"] == pytest.approx(0.9)
    assert median["comm_s"] is None and median["mfu_measured"] is None
    assert median["mfu_catalog"] == pytest.approx(1e12 * 32 / (4 * 200e12))  # 0.04
    assert summary["total"]["time_s"] == pytest.approx(19.1) and summary["total"]["samples"] == 6 * 32
    assert summary["peak_memory_bytes"] is None

    versus = summary["vs_predicted"]
    assert versus["step_time_s"] == {"predicted": 0.8, "measured": pytest.approx(1.0), "ratio": pytest.approx(1.25)}
    assert versus["samples_per_s"]["ratio"] == pytest.approx(32.0 / 40.0)
    assert versus["tokens_per_s"]["ratio"] == pytest.approx(0.8)
    assert versus["mfu"]["ratio"] == pytest.approx(0.04 / 0.5)
    # a CPU has no allocator peak: the prediction stays, with nothing to compare
    assert versus["peak_memory_bytes"] == {"predicted": 2e9, "measured": None, "ratio": None}


def test_few_steps_keep_every_step_and_no_steps_summarise_to_none():
    clock = FakeClock()
    metrics = StepMetrics(device=torch.device("cpu"), console=None, clock=clock)
    assert metrics.summary()["median"]["time_s"] is None and metrics.summary()["steps"] == 0
    fake_steps(metrics, clock, [4.0, 1.0, 1.0, 1.0])
    summary = metrics.summary()
    assert summary["warmup_steps"] == 0 and summary["median"]["time_s"] == pytest.approx(1.0)
    assert "vs_predicted" not in summary


def test_summary_reads_a_real_plans_predictions():
    from redline.plan.estimate import Goal
    from redline.plan.hardware import parse_hardware
    from redline.plan.planfile import make_plan
    from redline.plan.search import search
    from redline.workload.presets import preset_profile

    profile = preset_profile("gpt2")
    cluster = parse_hardware("8xa100-sxm4-80gb")
    goal = Goal(global_batch=64, tokens=1e9)
    plan = make_plan(profile, cluster, goal, search(profile, cluster, goal).ranked[0])
    clock = FakeClock()
    metrics = StepMetrics(device=torch.device("cpu"), world_size=8, tokens_per_sample=1024, console=None, clock=clock)
    fake_steps(metrics, clock, [0.1] * 3, samples=8)
    versus = metrics.summary(plan.predicted)["vs_predicted"]
    assert versus["step_time_s"]["predicted"] == plan.predicted["step_time_s"]["total"]
    assert versus["tokens_per_s"]["predicted"] == plan.predicted["tokens_per_s"]
    assert versus["samples_per_s"]["ratio"] == pytest.approx(640.0 / plan.predicted["samples_per_s"])
    assert versus["peak_memory_bytes"]["predicted"] == plan.predicted["memory_bytes"]["allocated"]


# --------------------------------------------------------------------------------------------- console


def test_console_prints_the_first_step_then_at_most_every_interval():
    lines: list[str] = []
    clock = FakeClock()
    metrics = StepMetrics(device=torch.device("cpu"), interval_s=10.0, console=lines.append, clock=clock)
    fake_steps(metrics, clock, [3.0] * 8)  # steps end at 3, 6, ..., 24 s after the first phase
    # the first step (at 3 s), then the first to end 10 s or more after it: step 5 (at 15 s); next would be step 9
    steps = [line.split(" | ")[0] for line in lines if line.startswith("step ")]
    assert steps == ["step 1", "step 5"] and lines[1] == SPLIT_LEGEND  # explained once, under the first line
    metrics.close()
    assert lines[-1].startswith("redline: 8 steps (2 warm-up), median 3.0 s/step")
    metrics.close()  # twice: nothing more
    assert len(lines) == 4


def test_console_line_says_loss_split_throughput_mfu_and_memory():
    record = StepRecord(
        step=120,
        time_s=0.4,
        data_s=0.012,
        compute_s=0.324,
        optimizer_s=0.036,
        comm_s=0.016,
        samples=64,
        tokens=64 * 2048,
        samples_per_s=160.0,
        tokens_per_s=160.0 * 2048,
        mfu_catalog=0.412,
        mfu_measured=0.52,
        peak_memory_bytes=61 * 2**30,
        loss=2.34567,
        micro_batch=8,
        accumulation=1,
        skipped=False,
        rank=0,
    )
    line = format_step(record, tokens_per_sample=2048)
    assert line == (
        "step 120 | loss 2.346 | 400 ms/step (data 3%, compute 81%, optimizer 9%, comm 4%, other 3%) | "
        "328k tokens/s | MFU 41.2%, 52.0% of measured peak | peak mem 61.0 GiB"
    )
    plain = format_step(StepRecord(**(record.to_dict() | {"mfu_catalog": None, "mfu_measured": None})), 1)
    assert "160 samples/s" in plain and "MFU" not in plain


def test_close_prints_the_ratios_to_the_plan():
    lines: list[str] = []
    clock = FakeClock()
    metrics = StepMetrics(device=torch.device("cpu"), world_size=4, console=lines.append, clock=clock)
    fake_steps(metrics, clock, [1.0] * 3)
    metrics.close(PREDICTED)
    assert "measured/predicted: step_time_s 1.25x, samples_per_s 0.8x" in lines[-3]
    # then why, the largest gap first: compute 0.9 s against 0.7 s, then a data wait the plan did not expect
    # (communication is not measured here, so compute is judged together with it)
    assert lines[-2].startswith("redline: compute+comm 900 ms/step against 700 ms planned (+25% of the planned step)")
    assert "redline bench --save" in lines[-2]
    assert lines[-1].startswith("redline: data 100 ms/step against 0 ms planned (+13% of the planned step)")
    assert "num_workers" in lines[-1]


def test_why_leaves_out_parts_within_five_percent_and_parts_not_measured():
    summary = {"median": {"time_s": 1.0, "data_s": 0.02, "compute_s": 0.73, "optimizer_s": 0.1, "comm_s": None}}
    predicted = {"step_time_s": {"compute": 0.7, "optimizer": 0.02, "data_parallel_comm": 0.3, "total": 1.02}}
    # data 2% of the step off: no reason; comm not measured, so compute is judged with it (0.73 s against
    # 0.7 + 0.3 planned: faster); the optimizer is 8% slower
    assert [r.split(" (")[0] for r in explain(summary, predicted)] == [
        "compute+comm 730 ms/step against 1.0 s planned",
        "optimizer 100 ms/step against 20 ms planned",
    ]
    summary["median"]["comm_s"] = 0.28  # measured (DDP): compute 3% off, comm 2% off, nothing to say but the optimizer
    assert [r.split(" (")[0] for r in explain(summary, predicted)] == ["optimizer 100 ms/step against 20 ms planned"]
    assert explain(summary, {"step_time_s": 1.0}) == []  # no breakdown in the plan: nothing to say


def test_an_exposed_comm_span_moves_from_compute_to_comm():
    clock = FakeClock()
    metrics = StepMetrics(device=torch.device("cpu"), console=None, clock=clock)
    with metrics.compute():
        clock.now += 0.6
        ready = metrics.mark()  # the last gradient bucket is ready
        clock.now += 0.4  # the backward waits for the all-reduce
        metrics.add_comm_span(ready, metrics.mark())
    record = metrics.end_step(samples=8, loss=None, micro_batch=8, accumulation=1)
    assert record.compute_s == pytest.approx(0.6) and record.comm_s == pytest.approx(0.4)
    assert record.time_s == pytest.approx(1.0)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="rank"):
        StepMetrics(device=torch.device("cpu"), world_size=2, rank=2)
    with pytest.raises(ValueError, match="world_size"):
        StepMetrics(device=torch.device("cpu"), world_size=0)


# ----------------------------------------------------------------------------------------------- peaks


def save_cpu_bench(fingerprint: str, machine: dict, taken_at: str, fp32_tflops: float) -> None:
    store.save(
        BenchRun(
            fingerprint,
            machine,
            taken_at,
            [
                Measurement("compute", "matmul_fp32", fp32_tflops, "TFLOP/s", "torch.matmul", device="cpu"),
                Measurement("compute", "matmul_bf16", 0.031, "TFLOP/s", "torch.matmul", device="cpu"),
                Measurement("compute", "matmul_bf16", 700.0, "TFLOP/s", "torch.matmul", device="cuda:0"),
            ],
        )
    )


def test_peak_flops_on_a_cpu_reads_this_machines_saved_bench(redline_home):
    cpu = torch.device("cpu")
    assert peak_flops(cpu, "fp32") == (None, None)  # nothing saved: no measured peak, not an error

    from redline.hw.probe import take_snapshot

    # the fingerprint `redline bench --save` files runs under, from a full snapshot
    fingerprint, machine = store.fingerprint(take_snapshot())
    save_cpu_bench("0123456789ab", {"hostname": "elsewhere"}, "2026-11-29T09:00:00+00:00", 9.9)  # another machine
    save_cpu_bench(fingerprint, machine, "2026-11-29T10:00:00+00:00", 0.150)
    save_cpu_bench(fingerprint, machine, "2026-11-29T11:00:00+00:00", 0.175)  # the newest

    assert peak_flops(cpu, "fp32") == (None, pytest.approx(0.175e12))
    assert peak_flops("cpu", "bf16") == (None, pytest.approx(0.031e12))  # the cuda:0 figure is not the CPU's
    assert peak_flops(cpu, "fp8") == (None, pytest.approx(0.031e12))  # fp8 MFU is quoted against bf16
    assert peak_flops(cpu, "fp16") == (None, None)  # not measured


def test_peak_flops_survives_a_broken_saved_run(redline_home):
    from redline.hw.probe import take_snapshot

    fingerprint, _ = store.fingerprint(take_snapshot())
    folder = redline_home / "bench" / fingerprint
    folder.mkdir(parents=True)
    (folder / "2026-11-29T120000Z.json").write_text("not json")
    assert peak_flops(torch.device("cpu"), "fp32") == (None, None)


def test_peak_flops_refuses_an_unknown_precision():
    with pytest.raises(BadInput, match="unknown precision 'int4'"):
        peak_flops(torch.device("cpu"), "int4")


# -------------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_cuda_phases_are_device_time_with_one_sync_per_step():
    device = torch.device("cuda:0")
    a = torch.randn(8192, 8192, device=device)
    out = torch.empty_like(a)
    # warm-up: each kernel's first launch loads its module (lazy loading), which synchronises the device;
    # cuBLAS also allocates its workspace
    torch.matmul(a, a, out=out)
    out.add_(1).sum()
    torch.cuda.synchronize()
    metrics = StepMetrics(device=device, console=None)
    host_start = time.perf_counter()
    with metrics.compute():
        for _ in range(20):  # hundreds of ms of fp32 GEMMs, queued in microseconds (no allocation: cudaMalloc
            torch.matmul(a, a, out=out)  # may synchronise by itself)
    with metrics.optimizer():
        out.add_(1)
    host_queued_s = time.perf_counter() - host_start
    record = metrics.end_step(samples=1, loss=out.sum(), micro_batch=1, accumulation=1)

    # the phases did not wait for the GPU: entering and leaving them cost the host next to nothing
    assert host_queued_s < 0.5 * record.compute_s, (host_queued_s, record)
    assert record.compute_s > 0.05 and 0 < record.optimizer_s < record.compute_s
    assert record.compute_s + record.optimizer_s <= record.time_s * 1.01
    assert isinstance(record.loss, float)

    with metrics.compute():
        big = torch.empty(2**30, dtype=torch.uint8, device=device)  # 1 GiB, freed before the step ends
        del big
    assert metrics.end_step(samples=1, loss=None, micro_batch=1, accumulation=1).peak_memory_bytes >= 2**30
    # the peak statistics were reset at the step's end: the next step does not see the 1 GiB
    with metrics.compute():
        torch.matmul(a, a, out=out)
    assert metrics.end_step(samples=1, loss=None, micro_batch=1, accumulation=1).peak_memory_bytes < 2**30


@pytest.mark.gpu
def test_cuda_peak_flops_from_the_catalog_follows_tf32(redline_home):
    from redline.specs.catalog import match_gpu

    device = torch.device("cuda:0")
    props = torch.cuda.get_device_properties(device)
    spec = match_gpu(torch.cuda.get_device_name(device), props.total_memory)
    if spec is None:
        pytest.skip(f"{torch.cuda.get_device_name(device)} is not in the catalog")
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert peak_flops(device, "fp32")[0] == (spec.peak_flops("tf32") or spec.peak_flops("fp32"))
        torch.set_float32_matmul_precision("highest")
        assert peak_flops(device, "fp32")[0] == spec.peak_flops("fp32")
    finally:
        torch.set_float32_matmul_precision(before)
    assert peak_flops(device, "bf16")[0] == spec.peak_flops("bf16")
    assert peak_flops(device, "fp8")[0] == spec.peak_flops("bf16")

    from redline.hw.probe import take_snapshot

    fingerprint, machine = store.fingerprint(take_snapshot())
    gemm = Measurement("compute", "matmul_bf16", 700.0, "TFLOP/s", "torch.matmul", device="cuda:0")
    store.save(BenchRun(fingerprint, machine, "2026-11-29T12:00:00+00:00", [gemm]))
    assert peak_flops(device, "bf16") == (spec.peak_flops("bf16"), pytest.approx(700e12))
