"""`redline plan --calibrate`: real steps of the model on this machine correct the planner's step time (and, on
CUDA, its memory). The fit itself is checked exactly on synthetic measurements; the measurement and the CLI
on this machine's CPU, with a small model."""

from __future__ import annotations

import dataclasses
import os
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from conftest import run_cli
from redline.bench.training_step import StepMeasurement, measure_training_steps
from redline.cli.plan import FLAGS
from redline.errors import BadInput
from redline.plan.calibrate import calibrate, line_sizes, measure, one_device
from redline.plan.hardware import parse_hardware
from redline.plan.memory import memory_per_gpu
from redline.plan.steptime import step_time
from redline.workload.presets import preset_profile

CLUSTER = dataclasses.replace(parse_hardware("1xh100-sxm"), name="local")


def synthetic(profile, sizes, time_scale, time_offset, memory_scale, memory_offset):
    """What a device would measure if it ran each micro-batch time_scale x slower than predicted plus a fixed
    cost, and its memory grew memory_scale x faster than predicted, from a fixed part memory_offset larger."""
    runs = []
    for m in sizes:
        strategy = one_device(m, "bf16")
        t = step_time(profile, strategy, CLUSTER)
        memory = memory_per_gpu(profile, strategy, 1)
        peak = memory.allocated + (memory_scale - 1) * (memory.activations + memory.temporary) + memory_offset
        runs.append(StepMeasurement(m, t.compute * time_scale + time_offset, t.optimizer * 1.5, int(peak)))
    return runs


def test_the_fit_recovers_the_devices_line_and_extrapolates_along_it() -> None:
    profile = preset_profile("gpt2", seq_len=512)
    truth = synthetic(profile, (2, 4, 16), time_scale=1.7, time_offset=0.004, memory_scale=1.3, memory_offset=2**30)
    calibrated = calibrate(profile, CLUSTER, "bf16", truth[:2])
    scale, offset = calibrated.calibration.compute
    assert scale == pytest.approx(1.7) and offset == pytest.approx(0.004)
    assert calibrated.calibration.optimizer_scale == pytest.approx(1.5)
    held_out = one_device(16, "bf16")  # not a calibration size
    assert step_time(calibrated, held_out, CLUSTER).compute == pytest.approx(truth[2].compute_s)
    assert step_time(calibrated, held_out, CLUSTER).optimizer == pytest.approx(truth[2].optimizer_s)
    assert memory_per_gpu(calibrated, held_out, 1).allocated == pytest.approx(truth[2].peak_bytes, rel=0.02)
    # and the corrections reach every strategy: accumulation 4 costs 4 calibrated micro-batches
    four = dataclasses.replace(held_out, accumulation=4)
    assert step_time(calibrated, four, CLUSTER).compute == pytest.approx(4 * truth[2].compute_s)


def test_a_step_at_micro_batch_1_is_the_floor_no_micro_batch_goes_below() -> None:
    """A fast GPU under eager PyTorch: a small micro-batch takes as long as launching its kernels does."""
    profile = preset_profile("gpt2", seq_len=512)
    line = synthetic(profile, (1, 2, 8, 16), time_scale=1.3, time_offset=0.002, memory_scale=1.0, memory_offset=0)
    floor = line[1].compute_s * 1.5  # micro-batches 1 and 2 are launch-bound, 8 and 16 are not
    device = [dataclasses.replace(run, compute_s=max(run.compute_s, floor)) for run in line]
    calibrated = calibrate(profile, CLUSTER, "bf16", [device[0], device[2], device[3]])
    fitted = calibrated.calibration
    assert fitted.micro_batches == (8, 16) and fitted.measured_floor_s == pytest.approx(floor)
    assert fitted.compute == pytest.approx((1.3, 0.002))  # the line comes from the two larger sizes only
    assert not fitted.launch_bound
    for run in device[1:]:  # the floor where the line would go under it, the line above it
        assert step_time(calibrated, one_device(run.micro_batch, "bf16"), CLUSTER).compute == pytest.approx(
            run.compute_s
        )
    # a line through a launch-bound size is said to be uncertain, and so is one that starts at the floor
    assert calibrate(profile, CLUSTER, "bf16", device[:3]).calibration.launch_bound
    assert calibrate(profile, CLUSTER, "bf16", device[:2]).calibration.launch_bound


def test_the_floor_applies_to_a_pipeline_stage_by_its_share_of_the_layers() -> None:
    profile = preset_profile("gpt2", seq_len=512)
    line = synthetic(profile, (1, 8, 16), time_scale=1.0, time_offset=0.0, memory_scale=1.0, memory_offset=0)
    floor = 10 * line[2].compute_s  # far above every line value: the floor decides
    calibrated = calibrate(profile, CLUSTER, "bf16", [dataclasses.replace(line[0], compute_s=floor), *line[1:]])
    whole = step_time(calibrated, one_device(8, "bf16"), CLUSTER).compute
    assert whole == pytest.approx(floor)
    # four stages: each launches about a quarter of the model's kernels, once per micro-batch in flight
    piped = dataclasses.replace(one_device(8, "bf16"), pipeline=4, accumulation=4)
    per_micro_batch = step_time(calibrated, piped, CLUSTER).compute / 4
    assert floor / 6 < per_micro_batch < floor / 3


def test_line_sizes() -> None:
    assert line_sizes(64) == (32, 64)
    assert line_sizes(5) == (2, 5)
    assert line_sizes(3) == (1, 3)
    assert line_sizes(1) == (1, 2)


def test_a_model_that_cannot_take_a_batch_of_one_is_calibrated_without_a_floor() -> None:
    from torch import nn

    def build():
        return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 2)), (8,)

    runs = measure(build, None, 4, device="cpu", precision="fp32", name="bn", steps=1)
    assert [run.micro_batch for run in runs] == [2, 4]  # batch norm refuses a batch of one in training
    with_floor = measure(lambda: (nn.Linear(8, 2), (8,)), None, 4, device="cpu", precision="fp32", name="l", steps=1)
    assert [run.micro_batch for run in with_floor] == [1, 2, 4]


def test_without_a_measured_peak_memory_is_left_as_predicted() -> None:
    profile = preset_profile("gpt2", seq_len=512)
    runs = [dataclasses.replace(r, peak_bytes=None) for r in synthetic(profile, (2, 4), 2.0, 0.0, 1.0, 0)]
    calibrated = calibrate(profile, CLUSTER, "bf16", runs)
    assert calibrated.calibration.memory is None
    strategy = one_device(8, "bf16")
    assert memory_per_gpu(calibrated, strategy, 1) == memory_per_gpu(profile, strategy, 1)


def test_calibration_is_for_this_machine_only() -> None:
    profile = preset_profile("gpt2", seq_len=512)
    runs = synthetic(profile, (2, 4), 1.0, 0.0, 1.0, 0)
    with pytest.raises(BadInput, match="calibration measures this machine: plan with hardware local") as refused:
        calibrate(profile, parse_hardware("1xh100-sxm"), "bf16", runs)
    assert refused.value.render(FLAGS) == "--calibrate measures this machine: plan with --hardware local"


def tiny_lm():
    import torch
    from torch import nn

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(100, 32)
            self.blocks = nn.ModuleList(
                nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(2)
            )
            self.head = nn.Linear(32, 100)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            x = self.embed(ids)
            for block in self.blocks:
                x = x + block(x)
            return self.head(x)

    return Tiny(), (16,)


def test_real_steps_are_timed_per_micro_batch_on_the_cpu() -> None:
    runs = measure_training_steps(tiny_lm, None, (2, 8), device="cpu", precision="fp32", steps=3, warmup=1)
    assert [r.micro_batch for r in runs] == [2, 8]
    assert all(r.compute_s > 0 and r.optimizer_s > 0 and r.peak_bytes is None for r in runs)


MODELS = textwrap.dedent(
    """
    import torch
    from torch import nn

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(100, 32)
            self.blocks = nn.ModuleList(
                nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(2)
            )
            self.head = nn.Linear(32, 100)

        def forward(self, ids):
            x = self.embed(ids)
            for block in self.blocks:
                x = x + block(x)
            return self.head(x)

    def build():
        return Tiny(), (16,)
    """
)


@pytest.mark.slow
def test_plan_calibrate_on_this_machine_writes_the_calibration_into_the_plan(
    tmp_path: Path, measured_home: Path
) -> None:
    (tmp_path / "tinymodels.py").write_text(MODELS)
    path = str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", "")
    env = {"REDLINE_HOME": str(measured_home), "PYTHONPATH": path}
    args = ["plan", "-m", "tinymodels:build", "--hardware", "local", "--global-batch", "8", "--tokens", "1M"]
    started = time.perf_counter()
    result = run_cli(*args, "--calibrate", "--precision", "fp32", "-o", str(tmp_path / "plan.yaml"), env=env)
    assert result.returncode == 0, result.stderr
    assert time.perf_counter() - started < 120
    calibration = yaml.safe_load((tmp_path / "plan.yaml").read_text())["model"]["calibration"]
    assert calibration["precision"] == "fp32" and calibration["measured_peak_bytes"] is None
    assert calibration["compute_scale"] > 0 and len(calibration["micro_batches"]) == 2
    assert "calibrated on" in result.stdout
    # the bad combinations, one line each
    for extra, message in (
        (["--calibrate-micro-batch", "4"], "goes with --calibrate"),
        (["--calibrate", "--calibrate-micro-batch", "0"], "at least 1"),
    ):
        bad = run_cli(*args, *extra, env=env)
        assert bad.returncode == 2 and message in bad.stderr and "Traceback" not in bad.stderr


def test_calibrate_needs_a_module_and_this_machine() -> None:
    for args, message in (
        (["-m", "gpt2", "--hardware", "1xh100-sxm", "--calibrate"], "--hardware local"),
        (["--params", "7B", "--hardware", "1xh100-sxm", "--calibrate"], "--model"),
    ):
        result = run_cli("plan", *args)
        assert result.returncode == 2 and message in result.stderr, result.stderr
