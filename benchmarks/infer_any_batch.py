"""The exported graphs an artifact saves (batch dimension free) against the static ones `redline infer` times,
side by side in one run on this machine.

`redline infer` times every exported backend with static shapes (one build per batch size); `-o` saves the pick
exported again with its batch dimension free, so that the artifact serves any batch size. This measures what
that costs: for each model (ResNet-50, BERT-base and GPT-2 from their configs, random weights; text at 128
tokens) and batch size, ONNX Runtime and AOTInductor each built both ways and timed in interleaved rounds with
eager (``redline.infer.measure``). Reported: the static graph's p50 latency over the free one's (above 1: the
free graph is faster), and the free graph's parity against eager fp32.

    python benchmarks/infer_any_batch.py [--models resnet50,bert-base,gpt2] [--batches 1,32] [--iters 10] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

import torch
from infer_backends import SEQ_LEN, add_timing_arguments, say  # this folder is on the path

from redline.infer.backends import BACKENDS, Backend, Build, Runner
from redline.infer.measure import Settings, measure
from redline.infer.models import load_subject

EXPORTED = ("onnxruntime", "export-aoti")


def any_batch(backend: Backend) -> Backend:
    """``backend`` built as an artifact saves it: exported with the batch free, from an example of 2 rows or more
    (export pins a size of 1), then called at the measured batch."""

    def build(spec: Build) -> Runner:
        example = spec.example if spec.example.shape[0] > 1 else torch.cat([spec.example, spec.example])
        return backend.build(dataclasses.replace(spec, example=example, any_batch=True))

    return dataclasses.replace(backend, name=f"{backend.name}/any", build=build)


def run_model(name: str, batches: tuple[int, ...], iters: int, min_s: float) -> list[dict]:
    torch.manual_seed(0)
    subject = load_subject(name, seq_len=SEQ_LEN)
    backends = [BACKENDS["eager"]]
    for exported in EXPORTED:
        backends += [BACKENDS[exported], any_batch(BACKENDS[exported])]
    settings = Settings(batches, iters=iters, min_s=min_s)
    with tempfile.TemporaryDirectory(prefix="redline-any-batch-") as workdir:
        rows = measure(subject, backends, settings, Path(workdir), lambda what: say(name, what))
    by = {(r.backend, r.batch): r for r in rows}
    out = []
    for batch in batches:
        for exported in EXPORTED:
            static, free = by[(exported, batch)], by[(f"{exported}/any", batch)]
            usable = static.p50_ms and free.p50_ms and free.status == "ok"
            out.append(
                {
                    "model": name,
                    "batch": batch,
                    "backend": exported,
                    "static_p50_ms": static.p50_ms,
                    "any_batch_p50_ms": free.p50_ms,
                    "static_over_any": static.p50_ms / free.p50_ms if usable else None,
                    "any_batch_status": free.status,
                    "any_batch_note": free.note,
                    "any_batch_max_rel": free.parity.max_rel if free.parity else None,
                    "any_batch_cold_s": free.cold_s,
                    "static_cold_s": static.cold_s,
                }
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_timing_arguments(parser)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    batches = tuple(int(b) for b in args.batches.split(","))
    rows = [row for name in args.models.split(",") for row in run_model(name, batches, args.iters, args.min_s)]
    if args.json:
        print(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(), "rows": rows}, indent=1))
        return
    print(f"{'model':10} {'batch':>5} {'backend':12} {'static ms':>10} {'any ms':>9} {'static/any':>10} {'rel err':>8}")
    for r in rows:
        ratio = f"{r['static_over_any']:.2f}" if r["static_over_any"] else r["any_batch_status"]
        static = f"{r['static_p50_ms']:.1f}" if r["static_p50_ms"] else ""
        free = f"{r['any_batch_p50_ms']:.1f}" if r["any_batch_p50_ms"] else ""
        err = f"{r['any_batch_max_rel']:.1e}" if r["any_batch_max_rel"] is not None else ""
        print(f"{r['model']:10} {r['batch']:>5} {r['backend']:12} {static:>10} {free:>9} {ratio:>10} {err:>8}")
        if r["any_batch_status"] != "ok":
            print(f"{'':17} {r['any_batch_note']}")


if __name__ == "__main__":
    main()
