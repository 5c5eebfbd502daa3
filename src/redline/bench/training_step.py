"""Real training steps of the user's model on this machine's device: what `redline plan --calibrate` fits.

One step is what the runtime runs: autocast (without its weight cache) around the forward, the loss the
tracer uses (cross-entropy on fp32 logits for a language model, else the sum of the outputs) and the
backward, then a fused AdamW step (foreach on the CPU). The forward+backward and the optimizer step are
timed apart (CUDA events on a GPU, one synchronisation a step; wall time on a CPU), medians over ``steps``
after ``warmup`` steps; the peak is ``torch.cuda.max_memory_allocated`` over the timed steps (None off CUDA).
Synthetic inputs: token ids below the vocabulary, or standard-normal images.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from redline.errors import BadInput
from redline.workload.user_model import input_kind, training_loss, unpack_build


@dataclass(frozen=True)
class StepMeasurement:
    micro_batch: int
    compute_s: float  # forward + backward, median
    optimizer_s: float  # optimizer step + zero_grad, median
    peak_bytes: int | None


def measure_training_steps(
    build: Callable[[], Any],
    input_shape: tuple[int, ...] | None,
    micro_batches: tuple[int, ...],
    *,
    device: str,
    precision: str,
    steps: int = 5,
    warmup: int = 2,
    name: str = "model",
) -> list[StepMeasurement]:
    """One model, built once, timed at each micro-batch size in turn."""
    torch.manual_seed(0)
    module, built_shape = unpack_build(build(), name)
    shape = input_shape or built_shape
    if shape is None:
        raise BadInput(f"{name}: give the shape of one sample's input (--input-shape)")
    model = module.to(device).train()
    input_dtype, vocab_size, _ = input_kind(model, None, None)
    cuda = device.startswith("cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=cuda, foreach=None if cuda else True)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    if precision == "fp16" and not cuda:
        raise BadInput("fp16 training needs a GPU: calibrate with --precision bf16 or fp32")

    def inputs(batch: int) -> torch.Tensor:
        if input_dtype.is_floating_point:
            return torch.randn(batch, *shape, device=device)
        return torch.randint(0, vocab_size or 2, (batch, *shape), device=device)

    def mark() -> Any:
        if not cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1e3 if cuda else end - start

    results = []
    for micro_batch in micro_batches:
        batch = inputs(micro_batch)
        compute, optimize = [], []
        for index in range(warmup + steps):
            if index == warmup and cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            start = mark()
            # as redline.prepare runs a micro-batch: autocast without its weight cache, the backward inside it
            with torch.autocast(device.split(":")[0], dtype=dtype, enabled=dtype is not None, cache_enabled=False):
                loss = training_loss(model(batch), batch, vocab_size)
                if loss is None:
                    raise BadInput(f"{name}: its output has nothing to call backward on")
                loss.backward()
            middle = mark()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            end = mark()
            if cuda:
                end.synchronize()
            if index >= warmup:
                compute.append(seconds(start, middle))
                optimize.append(seconds(middle, end))
        peak = int(torch.cuda.max_memory_allocated()) if cuda else None
        results.append(StepMeasurement(micro_batch, statistics.median(compute), statistics.median(optimize), peak))
        del batch, loss
        gc.collect()
    return results
