"""The cost of redline's loop: the examples' models trained by a hand-written loop, by redline.prepare(),
and by Hugging Face Accelerate, same settings (one process, fp32, the same micro-batch and accumulation),
side by side, rounds alternating, median seconds per optimizer step.

    python benchmarks/runtime_overhead.py [--rounds 5] [--steps 20]

redline's loop does more per step than the hand-written one (metrics, the OOM guard, micro-batch
splitting); the issue's budget is 2%.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import train_cnn
import train_gpt

from redline.plan.strategy import Strategy
from redline.runtime.config import RunConfig
from redline.runtime.prepare import prepare

MICRO, ACCUMULATION = 16, 2


def cases():
    def gpt_loss(model, batch):
        tokens, targets = batch
        return F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())

    def cnn_loss(model, batch):
        images, labels = batch
        return F.cross_entropy(model(images), labels)

    return {
        "gpt": (train_gpt.Gpt, lambda: train_gpt.synthetic_tokens(4096, 64, 512), gpt_loss),
        "cnn": (train_cnn.SmallResNet, lambda: train_cnn.synthetic_images(4096), cnn_loss),
    }


def by_hand(build, data, loss_fn, steps: int) -> float:
    torch.manual_seed(0)
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(data, batch_size=MICRO, shuffle=True, drop_last=True)
    batches = iter(loader)
    start, done = time.perf_counter(), 0
    while done < steps:
        for _ in range(ACCUMULATION):
            (loss_fn(model, next(batches)) / ACCUMULATION).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        done += 1
    return (time.perf_counter() - start) / steps


def with_redline(build, data, loss_fn, steps: int) -> float:
    torch.manual_seed(0)
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(data, batch_size=MICRO * ACCUMULATION, shuffle=True)
    config = RunConfig(strategy=Strategy(micro_batch=MICRO, accumulation=ACCUMULATION, precision="fp32"))
    run = prepare(model, optimizer, loader, plan=config, metrics_interval_s=3600)
    start = time.perf_counter()
    for batch in run.micro_batches(epochs=10**6):
        with run.accumulate():
            run.backward(loss_fn(run.model, batch))
        if run.step >= steps:
            break
    return (time.perf_counter() - start) / steps


def with_accelerate(build, data, loss_fn, steps: int) -> float:
    from accelerate import Accelerator

    torch.manual_seed(0)
    accelerator = Accelerator(gradient_accumulation_steps=ACCUMULATION, cpu=True)
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(data, batch_size=MICRO, shuffle=True, drop_last=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    batches = iter(loader)
    start, done = time.perf_counter(), 0
    while done < steps:
        for _ in range(ACCUMULATION):
            with accelerator.accumulate(model):
                accelerator.backward(loss_fn(model, next(batches)))
                optimizer.step()
                optimizer.zero_grad()
        done += 1
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    loops = {"hand": by_hand, "redline": with_redline}
    try:
        import accelerate  # noqa: F401

        loops["accelerate"] = with_accelerate
    except ImportError:
        print("accelerate not installed: its column is skipped")
    for name, (build, data_fn, loss_fn) in cases().items():
        data = data_fn()
        times: dict[str, list[float]] = {loop: [] for loop in loops}
        for _ in range(args.rounds):
            for loop, fn in loops.items():
                times[loop].append(fn(build, data, loss_fn, args.steps))
        hand = statistics.median(times["hand"])
        row = "  ".join(
            f"{loop} {statistics.median(t) * 1e3:7.1f} ms ({statistics.median(t) / hand:.3f})"
            for loop, t in times.items()
        )
        print(f"{name}: {row}", flush=True)


if __name__ == "__main__":
    main()
