"""redline plan's predictions next to real training steps on this machine (CPU, or CUDA when present).

Calibration is what `redline bench compute memory --save` measured here (matmul FLOP/s, memory
bandwidth); the benchmark runs those suites into a scratch REDLINE_HOME first, plans each model for
``--hardware local``, then trains the real module for a few steps and compares:

- step time: median of timed steps vs the plan's ``step_time_s.total``;
- peak memory (CUDA only): ``torch.cuda.max_memory_allocated`` vs the plan's ``allocated``;
- after calibration as ``plan --calibrate`` does it (micro-batch 1, half the batch, the batch), the same at
  micro-batches it did not measure: a quarter of the batch and twice it.

    python benchmarks/plan_vs_measured.py [--steps 5] [--json] [--out DIR]

Models: ViT-B/16 and ResNet-50 from redline.workload.zoo, and GPT-2 small from transformers when it is
installed, also with every block checkpointed as the runtime does it (memory and uncalibrated step time
only). Sizes are kept small on a CPU so the whole run takes a few minutes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from redline.bench import store
from redline.hw.probe import take_snapshot
from redline.plan.estimate import Goal, estimate
from redline.plan.hardware import local_cluster
from redline.plan.strategy import Strategy
from redline.workload import zoo
from redline.workload.presets import preset_profile
from redline.workload.structure import find_blocks, without_kv_cache


def calibrate(home: Path, device: str) -> None:
    env = os.environ | {"REDLINE_HOME": str(home)}
    suites = ["compute", "memory"]
    cmd = [sys.executable, "-m", "redline", "bench", *suites, "--save", "--quick"]
    if device != "cpu":
        cmd += ["--device", device]
    subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)


def models(device: str) -> list[dict]:
    cuda = device != "cpu"
    out = [
        {
            "name": "vit-b-16",
            "build": zoo.vit_b_16,
            "input": lambda b: torch.randn(b, 3, 224, 224),
            "shape": (3, 224, 224),
            "batch": 64 if cuda else 4,
        },
        {
            "name": "resnet50",
            "build": zoo.resnet50,
            "input": lambda b: torch.randn(b, 3, 224, 224),
            "shape": (3, 224, 224),
            "batch": 128 if cuda else 8,
        },
    ]
    try:
        import transformers
    except ImportError:
        return out
    seq = 1024 if cuda else 256

    def gpt2():
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_positions=1024))
        without_kv_cache(model)  # as the runtime trains it
        return model

    def gpt2_checkpointed():
        from redline.runtime.parallelize import checkpoint_blocks

        model = gpt2()
        checkpoint_blocks([block for _, block in find_blocks(model)])
        return model

    lm = {"input": lambda b: torch.randint(0, 50257, (b, seq)), "shape": (seq,), "seq_len": seq, "profile": "gpt2"}
    out.append(lm | {"name": "gpt2", "build": gpt2, "batch": 16 if cuda else 4})
    # every block checkpointed as the runtime does it: memory and uncalibrated time only
    out.append(
        lm
        | {
            "name": "gpt2+ckpt",
            "build": gpt2_checkpointed,
            "batch": 16 if cuda else 4,
            "checkpointing": "full",
            "calibrate": False,
        }
    )
    return out


def profile_of(spec: dict):
    """The zoo models are presets (traced); GPT-2 is profiled as a user would: from its config.json, which
    traces the very Hugging Face module trained here (the analytic preset describes a fused implementation)."""
    if spec.get("profile") != "gpt2":
        return preset_profile(spec["name"])
    from redline.workload.load import load_workload

    with tempfile.TemporaryDirectory() as folder:
        config = Path(folder) / "config.json"
        config.write_text(
            json.dumps(
                {
                    "model_type": "gpt2",
                    "n_embd": 768,
                    "n_layer": 12,
                    "n_head": 12,
                    "n_positions": 1024,
                    "vocab_size": 50257,
                }
            )
        )
        return load_workload(str(config), seq_len=spec["seq_len"])


def measure(spec: dict, device: str, precision: str, steps: int) -> dict:
    torch.manual_seed(0)
    model = spec["build"]().to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device != "cpu")
    batch = spec["input"](spec["batch"]).to(device)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    # as redline.prepare runs a micro-batch: autocast without its weight cache, the backward inside it
    autocast = torch.autocast(device.split(":")[0], dtype=dtype, enabled=precision != "fp32", cache_enabled=False)
    is_lm = "seq_len" in spec

    def step() -> None:
        with autocast:
            out = model(batch, labels=batch) if is_lm else model(batch)
            loss = out.loss if is_lm else out.float().logsumexp(-1).mean()
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def sync() -> None:
        if device != "cpu":
            torch.cuda.synchronize()

    for _ in range(2):
        step()
    sync()
    if device != "cpu":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() if device != "cpu" else None
    return {"step_s": statistics.median(times), "steps": steps, "peak_allocated_bytes": peak}


def calibrated(spec: dict, profile, cluster, device: str, precision: str, steps: int) -> dict:
    """`plan --calibrate` as the CLI does it (micro-batch 1 for the floor, half the batch, the batch), then its
    predictions at micro-batches it did not measure, a quarter of the batch and twice it, against real steps
    there, timed the same way. A held-out size the device cannot hold is left out and said so."""
    from redline.bench.training_step import measure_training_steps
    from redline.plan.calibrate import calibrate as fit_profile
    from redline.plan.calibrate import measure as measure_calibration

    b = spec["batch"]
    runs = measure_calibration(
        spec["build"], spec["shape"], b, device=device, precision=precision, steps=steps, name=spec["name"]
    )
    profile = fit_profile(profile, dataclasses.replace(cluster, name="local"), precision, runs)
    checks, skipped = [], []
    for m in sorted({max(2, b // 4), 2 * b} - {run.micro_batch for run in runs}):
        try:
            (run,) = measure_training_steps(
                spec["build"], spec["shape"], (m,), device=device, precision=precision, steps=steps, name=spec["name"]
            )
        except torch.cuda.OutOfMemoryError:
            skipped.append(m)
            continue
        finally:
            if device != "cpu":
                torch.cuda.empty_cache()
        predicted = estimate(profile, Strategy(data=1, precision=precision, micro_batch=m), cluster, Goal(m))
        measured_s = run.compute_s + run.optimizer_s
        checks.append(
            {
                "micro_batch": m,
                "predicted_step_s": predicted.time.total,
                "measured_step_s": measured_s,
                "step_ratio": predicted.time.total / measured_s,
                "memory_ratio": predicted.memory.allocated / run.peak_bytes if run.peak_bytes else None,
            }
        )
    return {"calibration": profile.calibration.to_dict(), "held_out": checks, "held_out_too_large": skipped}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    precision = "bf16" if device != "cpu" else "fp32"
    with tempfile.TemporaryDirectory() as home:
        calibrate(Path(home), device)
        os.environ["REDLINE_HOME"] = home
        snapshot = take_snapshot()
        cluster = local_cluster(snapshot, store.latest(store.fingerprint(snapshot)[0]))
    if device != "cpu":
        cluster = cluster.with_nodes(1)
    rows = []
    profiles = {}
    for spec in models(device):
        key = spec.get("profile", spec["name"])
        profile = profiles[key] = profiles.get(key) or profile_of(spec)
        strategy = Strategy(
            data=1, precision=precision, micro_batch=spec["batch"], checkpointing=spec.get("checkpointing", "none")
        )
        predicted = estimate(profile, strategy, cluster, Goal(spec["batch"]))
        measured = measure(spec, device, precision, args.steps)
        row = {
            "model": spec["name"],
            "device": device,
            "batch": spec["batch"],
            "predicted_step_s": predicted.time.total,
            "measured_step_s": measured["step_s"],
            "step_ratio": predicted.time.total / measured["step_s"],
            "predicted_allocated_bytes": predicted.memory.allocated,
            "measured_peak_allocated_bytes": measured["peak_allocated_bytes"],
            "checkpointing": strategy.checkpointing,
            "ceilings": {p: c.source for p, c in cluster.matmul.items()},
        }
        if measured["peak_allocated_bytes"]:
            row["memory_ratio"] = predicted.memory.allocated / measured["peak_allocated_bytes"]
        if spec.get("calibrate", True):
            row |= calibrated(spec, profile, cluster, device, precision, args.steps)
        else:
            row |= {"held_out": [], "held_out_too_large": []}
        rows.append(row)
        if not args.json:
            memory = f"  memory {row['memory_ratio']:.2f}" if "memory_ratio" in row else ""
            after = "  calibrated, held out:" + ",".join(
                f" b={check['micro_batch']} step {check['step_ratio']:.2f}"
                + (f" memory {check['memory_ratio']:.2f}" if check["memory_ratio"] else "")
                for check in row["held_out"]
            )
            after = after if row["held_out"] else ""
            print(
                f"{row['model']:10} b={row['batch']:<4} predicted {row['predicted_step_s']:.3f} s  "
                f"measured {row['measured_step_s']:.3f} s  ratio {row['step_ratio']:.2f}{memory}{after}",
                flush=True,
            )
    if args.json:
        print(json.dumps(rows, indent=2))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "plan_vs_measured.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
