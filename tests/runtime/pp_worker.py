"""Trains a tiny model under a pipeline-parallel strategy through ``prepare(..., loss_fn=...)`` and
``run.forward_backward``, and writes what each rank holds: run by ``spawn_ranks`` (gloo) and, for the
reference, as one process.

Environment: MODEL (gpt, llama; see ``tp_worker.make_model``), STRATEGY (JSON of Strategy fields) or
REDLINE_PLAN (a plan file, as `redline run --plan` sets it), OUT (a prefix: each rank writes OUT.RANK.pt, its
parameters whole by the model's own names; rank 0 writes OUT.losses.json, the step losses; each rank
OUT.bytes.RANK, its parameter bytes), and optionally CHECKPOINT_DIR, STEPS (stop after this many optimizer
steps), GRAD_CLIP (clip the gradients' norm to this), PYTORCH_STAGE (1: PyTorch's own ``PipelineStage`` in place of
redline's ``ReleasingStage``, the reference for what it frees), MISUSE (``no_loss_fn``: prepare() without one;
``call_model``: the loop calls run.model; either way, or any BadInput, its message goes to OUT.error and the
rank exits 0).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
import tp_worker

from ranks import leave_together

LAYERS = 4  # two stages of two blocks, or four of one (interleaved over two ranks)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def train(kind: str, plan, *, steps: int | None = None, misuse: str | None = None, **settings):
    from redline.runtime.prepare import prepare

    model = tp_worker.make_model(kind, layers=LAYERS)
    loader = torch.utils.data.DataLoader(tp_worker.dataset(), batch_size=8)
    optimizer = lambda params: torch.optim.SGD(params, lr=0.5)  # noqa: E731
    given = None if misuse == "no_loss_fn" else loss_fn
    run = prepare(model, optimizer, loader, plan=plan, loss_fn=given, **settings)
    for tokens, targets in run.micro_batches():
        with run.accumulate():
            if misuse == "call_model":
                run.model(tokens)
            run.forward_backward(tokens, targets)
        if steps is not None and run.step >= steps:
            break
    run.close()
    return run, [record.loss for record in run.metrics.records]


def main() -> None:
    from redline.errors import BadInput
    from redline.plan.strategy import Strategy
    from redline.runtime.config import RunConfig
    from redline.runtime.tensor_parallel import local_parameter_bytes

    if "STORE" in os.environ:  # spawn_ranks' file rendezvous (under `redline run`, prepare() joins torchrun's)
        torch.distributed.init_process_group(
            "gloo",
            init_method="file://" + os.environ["STORE"],
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
        )
    plan = None if "REDLINE_PLAN" in os.environ else RunConfig(strategy=Strategy(**json.loads(os.environ["STRATEGY"])))
    settings = {
        "checkpoint_dir": os.environ.get("CHECKPOINT_DIR"),
        "grad_clip_norm": float(os.environ["GRAD_CLIP"]) if os.environ.get("GRAD_CLIP") else None,
    }
    steps = int(os.environ["STEPS"]) if os.environ.get("STEPS") else None
    if os.environ.get("PYTORCH_STAGE") == "1":
        from torch.distributed.pipelining import PipelineStage

        import redline.runtime.pipeline

        redline.runtime.pipeline.ReleasingStage = PipelineStage  # type: ignore[misc]
    out = os.environ["OUT"]
    try:
        run, losses = train(os.environ["MODEL"], plan, steps=steps, misuse=os.environ.get("MISUSE"), **settings)
    except BadInput as error:
        Path(f"{out}.error").write_text(str(error))
        os._exit(0)  # the other ranks may be in a collective: leave without tearing the group down
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0  # prepare() may have joined
    torch.save(tp_worker.full_weights(run.model), f"{out}.{rank}.pt")
    Path(f"{out}.bytes.{rank}").write_text(str(local_parameter_bytes(run.model)))
    if rank == 0:
        Path(f"{out}.losses.json").write_text(json.dumps(losses))
    if torch.distributed.is_initialized():
        leave_together()


if __name__ == "__main__":
    main()
