"""redline infer's backends against eager PyTorch, side by side in one run on this machine.

For each model (ResNet-50, BERT-base and GPT-2, built from their configs with random weights; text at 128
tokens), every backend is built at each batch size and timed in interleaved rounds with the others
(``redline.infer.measure``: a slow spell of the machine falls on all of them), so each latency ratio is of two
medians taken over the same minutes. Reported per model, batch and backend: eager's p50 latency over the
backend's (above 1: faster than eager), the backend's cold start (export/compile), and its parity against eager
fp32 (largest error over the reference's largest magnitude; top-1 agreement for the classifier and the LM).
For GPT-2, generation with a static KV cache, eager and compiled: prefill latency and decode tokens/s.

    python benchmarks/infer_backends.py [--models resnet50,bert-base,gpt2] [--batches 1,32] [--iters 10] [--json]
        [--device cuda] [--backends eager,compile,onnxruntime,onnxruntime-trt,tensorrt] [--precision bf16]

The issue's bar: ONNX Runtime and torch.compile each beat eager somewhere (a ratio above 1), or the report says
why not; the summary lines say which.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from redline.infer.backends import BACKENDS as ALL
from redline.infer.generate import generation
from redline.infer.measure import Settings, measure, selected, speedups
from redline.infer.models import load_subject

# on the CPU: max-autotune's GEMM search takes many minutes here, and the TensorRT ones need a GPU
CPU_BACKENDS = ["eager", "compile", "export-aoti", "onnxruntime", "int8-dynamic"]
SEQ_LEN = 128
NEW_TOKENS = 32
LINE = "{:10} {:>5} {:14} {:>10} {:>8} {:>7} {:>9} {:>6}"


def run_model(
    name: str, batches: tuple[int, ...], iters: int, min_s: float, device: str, backends: list[str], precision: str
) -> dict:
    torch.manual_seed(0)
    subject = load_subject(name, seq_len=SEQ_LEN)
    settings = Settings(batches, precision=precision, device=device, iters=iters, min_s=min_s)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="redline-infer-bench-") as workdir:
        chosen = selected(backends, device)
        rows = measure(subject, chosen, settings, Path(workdir), lambda what: say(name, what))
    speedup = speedups(rows)
    result = {
        "model": name,
        "seconds": time.perf_counter() - started,
        "rows": [
            {
                "backend": r.backend,
                "batch": r.batch,
                "status": r.status,
                "note": r.note,
                "p50_ms": r.p50_ms,
                "p99_ms": r.p99_ms,
                "speedup_vs_eager": speedup.get((r.backend, r.batch)),
                "cold_s": r.cold_s,
                "calls": r.calls,
                "max_rel": r.parity.max_rel if r.parity else None,
                "top1": r.parity.top1 if r.parity else None,
            }
            for r in rows
        ],
    }
    if subject.kind == "lm":
        say(name, f"generation, {NEW_TOKENS} new tokens")
        prompt = SEQ_LEN - NEW_TOKENS
        result["generation"] = [dataclasses.asdict(g) for g in generation(subject, 1, prompt, NEW_TOKENS, device)[0]]
    return result


def say(model: str, what: str) -> None:
    print(f"  {model}: {what}", file=sys.stderr, flush=True)


def summary(results: list[dict], backends: list[str]) -> list[str]:
    """Whether each backend (ONNX Runtime and compile above all) beat eager anywhere, and where it did best."""
    lines = []
    for backend in backends[1:]:
        wins = [
            (row["speedup_vs_eager"], result["model"], row["batch"])
            for result in results
            for row in result["rows"]
            if row["backend"] == backend and row["status"] == "ok" and (row["speedup_vs_eager"] or 0) > 1
        ]
        if wins:
            best = max(wins)
            lines.append(
                f"{backend}: faster than eager in {len(wins)} case(s); best {best[0]:.2f}x ({best[1]}, b{best[2]})"
            )
        else:
            lines.append(f"{backend}: faster than eager nowhere here")
    return lines


def add_timing_arguments(parser: argparse.ArgumentParser) -> None:
    """The options the inference benchmarks share: the models, the batch sizes, how long each is timed."""
    parser.add_argument("--models", default="resnet50,bert-base,gpt2")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--iters", type=int, default=10, help="timed calls per backend and batch, at least")
    parser.add_argument("--min-s", type=float, default=2.0, help="seconds of timed calls per backend, at least")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_timing_arguments(parser)
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument(
        "--backends",
        default=None,
        help=f"comma-separated (default: {','.join(CPU_BACKENDS)} on the CPU, every backend on a GPU)",
    )
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    batches = tuple(int(b) for b in args.batches.split(","))
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    backends = args.backends.split(",") if args.backends else (CPU_BACKENDS if device == "cpu" else list(ALL))
    results = [
        run_model(name, batches, args.iters, args.min_s, device, backends, args.precision)
        for name in args.models.split(",")
    ]
    if args.json:
        meta = {"torch": torch.__version__, "threads": torch.get_num_threads(), "device": device}
        lines = summary(results, backends)
        print(json.dumps({**meta, "precision": args.precision, "results": results, "summary": lines}, indent=1))
        return
    print(LINE.format("model", "batch", "backend", "p50 ms", "x eager", "cold s", "rel err", "top-1"))
    for result in results:
        for r in result["rows"]:
            if r["status"] == "absent":
                continue
            speed = f"{r['speedup_vs_eager']:.2f}" if r["speedup_vs_eager"] else r["status"]
            p50 = f"{r['p50_ms']:.1f}" if r["p50_ms"] else ""
            cold = f"{r['cold_s']:.1f}" if r["cold_s"] else ""
            rel = f"{r['max_rel']:.1e}" if r["max_rel"] is not None else ""
            top1 = f"{r['top1']:.0%}" if r["top1"] is not None else ""
            print(LINE.format(result["model"], r["batch"], r["backend"], p50, speed, cold, rel, top1))
        for g in result.get("generation", []):
            print(
                f"{result['model']:10} generation {g['mode']}: prefill {g['prefill_ms'] or 0:.1f} ms, "
                f"decode {g['decode_tokens_per_s'] or 0:.1f} tokens/s, cold {g['cold_s'] or 0:.1f} s {g['note']}"
            )
    for line in summary(results, backends):
        print(line)


if __name__ == "__main__":
    main()
