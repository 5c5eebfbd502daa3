"""Trains the example GPT under an fp8 strategy with torchao emulating the float8 GEMM on the CPU, the fp8
check opened (the product refuses fp8 on a CPU): run by ``spawn_ranks`` (gloo) to see the float8 layers go
through DDP, FSDP2 and a pipeline's stages.

Environment: STRATEGY (JSON of Strategy fields), OUT (a prefix: each rank writes OUT.RANK.json, the number of
float8 layers it holds and its step losses, None where its pipeline stage computes none).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torchao.float8 import Float8LinearConfig, float8_linear_utils
from torchao.float8.float8_linear import Float8Linear

from redline.plan.strategy import Strategy
from redline.runtime import fp8
from redline.runtime.config import RunConfig
from redline.runtime.prepare import prepare

sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
from train_gpt import Gpt, synthetic_tokens


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def main() -> None:
    fp8.unavailable = lambda strategy, device=None: None
    float8_linear_utils.Float8LinearConfig = lambda: Float8LinearConfig(emulate=True)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", init_method="file://" + os.environ["STORE"], rank=rank, world_size=2)
    torch.manual_seed(0)
    model = Gpt(vocab=64, width=32, layers=2, heads=2, seq=8)
    loader = torch.utils.data.DataLoader(synthetic_tokens(128, 8, 64), batch_size=16)
    plan = RunConfig(strategy=Strategy(**json.loads(os.environ["STRATEGY"]) | {"precision": "fp8"}))
    run = prepare(model, lambda params: torch.optim.AdamW(params, lr=1e-2), loader, plan=plan, loss_fn=loss_fn)
    losses = []
    for tokens, targets in run.micro_batches(epochs=2):
        with run.accumulate():
            loss = run.forward_backward(tokens, targets)
            losses.append(None if loss is None else loss.item())
    float8 = sum(isinstance(m, Float8Linear) for m in run.model.modules())
    Path(f"{os.environ['OUT']}.{rank}.json").write_text(json.dumps({"float8": float8, "losses": losses}))
    dist.barrier()  # leave together: a gloo group torn down under a busy peer can abort it
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # the results are written: skip the interpreter's teardown (gloo's threads, see test_prepare)


if __name__ == "__main__":
    main()
