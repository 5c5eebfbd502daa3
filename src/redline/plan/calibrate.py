"""Calibrate the planner on the model itself: real steps measured on this device against the planner's own
prediction of the same steps (``redline plan --calibrate``).

The roofline knows the FLOPs and bytes of each block but not what eager PyTorch adds around them (small
kernels, launches, a BatchNorm pass, an fp32 copy of the logits), and those differ by model. A few real
steps at two micro-batch sizes on one device pin both down: ``Calibration`` (``redline.workload.profile``)
keeps the measured and predicted lines, and the step-time and memory models correct every strategy with
them. The corrections are per device: they describe this model on this GPU (or CPU), so a calibrated profile
is only planned on ``--hardware local``.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

from redline.bench.training_step import StepMeasurement
from redline.errors import BadInput
from redline.plan.hardware import Cluster
from redline.plan.memory import memory_per_gpu
from redline.plan.steptime import step_time
from redline.plan.strategy import Strategy
from redline.workload.profile import Calibration, WorkloadProfile


def one_device(micro_batch: int, precision: str) -> Strategy:
    """The run a calibration measures: one device, no accumulation, no checkpointing."""
    return Strategy(micro_batch=micro_batch, precision=precision)


def calibration_sizes(micro_batch: int) -> tuple[int, ...]:
    """The micro-batches ``plan --calibrate`` times: 1 (the floor), half of ``micro_batch``, and itself."""
    return (1, micro_batch // 2, micro_batch) if micro_batch >= 4 else (1, max(2, micro_batch))


def fit(profile: WorkloadProfile, cluster: Cluster, precision: str, measured: Sequence[StepMeasurement]) -> Calibration:
    """The calibration of ``profile`` against the uncalibrated model, from measurements at increasing micro-batch
    sizes: the last two give the lines; the first, at micro-batch 1, also the floor."""
    if len(measured) not in (2, 3) or any(a.micro_batch >= b.micro_batch for a, b in itertools.pairwise(measured)):
        raise ValueError("a calibration needs two or three measurements at increasing micro-batch sizes")
    floor = measured[0].compute_s if measured[0].micro_batch == 1 else None
    measured = measured[-2:]
    bare = dataclasses.replace(profile, calibration=None)
    predicted = [
        (
            step_time(bare, one_device(m.micro_batch, precision), cluster),
            memory_per_gpu(bare, one_device(m.micro_batch, precision), 1),
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


def calibrate(
    profile: WorkloadProfile, cluster: Cluster, precision: str, measured: Sequence[StepMeasurement]
) -> WorkloadProfile:
    if cluster.name != "local":
        raise BadInput("--calibrate measures this machine: plan with --hardware local")
    return dataclasses.replace(profile, calibration=fit(profile, cluster, precision, measured))
