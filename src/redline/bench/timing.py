"""Timing done the way the reference tools do it: warm up, repeat, take the median, sync the device."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def time_calls(fn: Callable[[], Any], *, warmup: int, repeats: int, device: str = "cpu") -> list[float]:
    """Seconds per call of ``fn``, ``repeats`` times after ``warmup`` untimed calls.

    On CUDA each call is bracketed by events on the current stream (launches are asynchronous, so a host
    clock would time the launch, not the work); on the CPU by perf_counter.
    """
    for _ in range(warmup):
        fn()
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)
        # record on the measured device's stream: the current device may be another GPU
        stream = torch.cuda.current_stream(device)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        for start, end in zip(starts, ends, strict=True):
            start.record(stream)
            fn()
            end.record(stream)
        torch.cuda.synchronize(device)
        return [s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends, strict=True)]
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return samples
