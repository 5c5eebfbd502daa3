"""Calibrate the planner on the model itself: real steps measured on this device against the planner's own
prediction of the same steps (``redline plan --calibrate``).

The roofline knows the FLOPs and bytes of each block but not what eager PyTorch adds around them (small
kernels, launches, a BatchNorm pass, an fp32 copy of the logits), and those differ by model. A few real
steps at two micro-batch sizes on one device pin both down, and a step at micro-batch 1 the floor no
micro-batch goes below: ``Calibration`` (``redline.workload.profile``)
keeps the measured and predicted lines, and the step-time and memory models correct every strategy with
them. The corrections are per device: they describe this model on this GPU (or CPU), so a calibrated profile
is only planned on ``--hardware local``.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from redline.plan.hardware import Cluster
from redline.plan.memory import memory_per_gpu
from redline.plan.messages import refuse
from redline.plan.steptime import step_time
from redline.plan.strategy import Strategy
from redline.workload.profile import Calibration, WorkloadProfile

if TYPE_CHECKING:
    from redline.bench.training_step import StepMeasurement


def one_device(micro_batch: int, precision: str) -> Strategy:
    """The run a calibration measures: one device, no accumulation, no checkpointing."""
    return Strategy(micro_batch=micro_batch, precision=precision)


def line_sizes(micro_batch: int) -> tuple[int, int]:
    """The two micro-batches the calibration's lines go through: half of ``micro_batch`` and itself."""
    return (micro_batch // 2, micro_batch) if micro_batch >= 4 else (1, max(2, micro_batch))


def measure(
    build: Callable[[], Any],
    input_shape: tuple[int, ...] | None,
    micro_batch: int,
    *,
    device: str,
    precision: str,
    name: str,
    steps: int = 5,
) -> list[StepMeasurement]:
    """Real steps for a calibration around ``micro_batch``: the two sizes of ``line_sizes``, preceded by
    micro-batch 1 for the floor when the line does not start there. Some models cannot take a batch of one
    (a BatchNorm1d): they are calibrated without a floor."""
    from redline.bench.training_step import measure_training_steps  # torch: only when measuring

    sizes = line_sizes(micro_batch)
    run = functools.partial(
        measure_training_steps, build, input_shape, device=device, precision=precision, steps=steps, name=name
    )
    measured = run(sizes)
    if sizes[0] == 1:
        return measured
    try:
        return run((1,)) + measured
    except (RuntimeError, ValueError):
        return measured


def fit(profile: WorkloadProfile, cluster: Cluster, precision: str, measured: Sequence[StepMeasurement]) -> Calibration:
    """The calibration of ``profile`` against the uncalibrated model, from measurements at increasing micro-batch
    sizes: the last two give the lines; the first, at micro-batch 1, also the floor."""
    if len(measured) not in (2, 3) or any(a.micro_batch >= b.micro_batch for a, b in itertools.pairwise(measured)):
        raise ValueError("a calibration needs two or three measurements at increasing micro-batch sizes")
    if len(measured) == 3 and measured[0].micro_batch != 1:
        raise ValueError("the first of three calibration measurements is the floor, at micro-batch 1")
    floor = measured[0].compute_s if measured[0].micro_batch == 1 else None
    measured = measured[-2:]
    bare = dataclasses.replace(profile, calibration=None)
    predicted = [
        (
            step_time(bare, one_device(m.micro_batch, precision), cluster),
            memory_per_gpu(bare, one_device(m.micro_batch, precision), 1, cpu=cluster.on_cpu),
        )
        for m in measured
    ]
    peaks = [m.peak_bytes for m in measured]
    return Calibration(
        device=cluster.device,
        precision=precision,
        micro_batches=(measured[0].micro_batch, measured[1].micro_batch),
        measured_compute_s=(measured[0].compute_s, measured[1].compute_s),
        predicted_compute_s=(predicted[0][0].compute, predicted[1][0].compute),
        # the larger run's optimizer step: the same work at either size, timed on more settled clocks
        measured_optimizer_s=measured[1].optimizer_s,
        predicted_optimizer_s=predicted[1][0].optimizer,
        measured_peak_bytes=None if None in peaks else (int(peaks[0]), int(peaks[1])),  # type: ignore[arg-type]
        predicted_peak_bytes=(predicted[0][1].allocated, predicted[1][1].allocated),
        measured_floor_s=floor,
    )


def check_this_machine(cluster: Cluster) -> None:
    """A calibration describes the device it ran on: it corrects plans for this machine only."""
    if cluster.name != "local":
        raise refuse("{calibration} measures this machine: plan with {hardware} local")


def calibrate(
    profile: WorkloadProfile, cluster: Cluster, precision: str, measured: Sequence[StepMeasurement]
) -> WorkloadProfile:
    check_this_machine(cluster)
    return dataclasses.replace(profile, calibration=fit(profile, cluster, precision, measured))
