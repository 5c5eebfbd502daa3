"""A training script in the shape of nanoGPT's ``train.py``, run as gloo ranks through ``prepare()``: each rank
seeds its own generator (``1337 + rank``) before it builds the model, as nanoGPT does, and the optimizer may be
AdamW with weight decay on the weight matrices and none on the biases and norms, split by parameter name as
Hugging Face Accelerate's language-model example splits it. ``reference`` is the same loop without redline in one
process, seeded as rank 0; ``two_ranks`` runs the script and reads back what it wrote.

Environment: KIND (``mlp``; or ``gpt``, ``tp_worker``'s, for tensor and pipeline parallelism), STRATEGY (JSON of
Strategy fields), OPTIMIZER (``sgd``: a factory of one group; ``ready``: the split AdamW built on the model;
``factory``: a factory making the split from ``params.named``), SEEDS (``per-rank`` or ``alike``), OUT (each rank
writes OUT.RANK.pt, the parameters it holds, whole, by the model's names; rank 0 writes OUT.groups.json, its
optimizer's groups: weight decay, learning rate, elements), and optionally BUCKET_BYTES (the broadcast's bucket,
small to cut tensors into pieces), WIDTH_ON_RANK1 (rank 1 builds the MLP this much wider: a BadInput, whose message
goes to OUT.error.RANK).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import tp_worker
from torch import nn

from ranks import leave_together, spawn_ranks

SEED = 1337
LR, SGD_LR = 0.01, 0.1
WEIGHT_DECAY = 0.5  # large, so that a group given the wrong decay shows in four steps
# AdamW's eps, above the default 1e-8: a key's bias has no gradient in exact arithmetic (softmax ignores a shift
# every key shares), and AdamW would turn its rounding noise, which differs between ranks and one process, into
# a full step
EPS = 1e-5
MLP_SAMPLES = 64
# fp32 over gloo: gradients reduced over the ranks add in another order than one process's whole batch
TOLERANCE = {"mlp": {"rtol": 1e-5, "atol": 1e-6}, "gpt": {"rtol": 1e-4, "atol": 1e-5}}


class Mlp(nn.Module):
    """Two linear layers around a LayerNorm, and a random mixing buffer stored transposed (not contiguous, as a
    channels-last weight is not): every kind of tensor a rank builds from its seed."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.fc_in = nn.Linear(16, width)
        self.norm = nn.LayerNorm(width)
        self.fc_out = nn.Linear(width, 4)
        self.register_buffer("mix", (torch.eye(4) + 0.1 * torch.rand(4, 4)).t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(torch.tanh(self.norm(self.fc_in(x)))) @ self.mix


def build(kind: str, seed: int, width: int = 32) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "mlp":
        return Mlp(width)
    model = tp_worker.make_model("gpt", layers=4)  # it seeds itself: the rank's seed moves every weight after
    torch.manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.02 * torch.randn_like(parameter))
    return model


def dataset(kind: str) -> torch.utils.data.TensorDataset:
    if kind == "gpt":
        return tp_worker.dataset()
    generator = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(
        torch.randn(MLP_SAMPLES, 16, generator=generator), torch.randn(MLP_SAMPLES, 4, generator=generator)
    )


def loss_fn(kind: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    if kind == "gpt":
        return lambda logits, targets: F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    return F.mse_loss


def decay_groups(named: Iterable[tuple[str, nn.Parameter]]) -> list[dict[str, Any]]:
    """Weight decay on the weight matrices, none on biases and norms, told apart by name."""
    named = list(named)
    plain = [p for name, p in named if name.endswith("bias") or "norm" in name]
    decayed = [p for name, p in named if not (name.endswith("bias") or "norm" in name)]
    return [{"params": decayed, "weight_decay": WEIGHT_DECAY}, {"params": plain, "weight_decay": 0.0}]


def optimizer_for(choice: str, model: nn.Module) -> Any:
    """What the script hands ``prepare()``: a factory, or an optimizer built on the model."""
    if choice == "sgd":
        return lambda params: torch.optim.SGD(params, lr=SGD_LR)
    if choice == "factory":
        return lambda params: torch.optim.AdamW(decay_groups(params.named), lr=LR, eps=EPS)
    return torch.optim.AdamW(decay_groups(model.named_parameters()), lr=LR, eps=EPS)


def reference(kind: str, optimizer: str, global_batch: int) -> dict[str, torch.Tensor]:
    """The same training without redline, in one process seeded as rank 0: the whole global batch per step."""
    model = build(kind, SEED)
    if optimizer == "sgd":
        stepper = torch.optim.SGD(model.parameters(), lr=SGD_LR)
    else:
        stepper = torch.optim.AdamW(decay_groups(model.named_parameters()), lr=LR, eps=EPS)
    for inputs, targets in torch.utils.data.DataLoader(dataset(kind), batch_size=global_batch):
        loss_fn(kind)(tp_worker.logits(model, inputs), targets).backward()
        stepper.step()
        stepper.zero_grad()
    return {name: p.detach() for name, p in model.named_parameters()}


def two_ranks(tmp_path: Path, kind: str, strategy: dict, **env: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The script as two ranks: the parameters they hold (merged, by the model's names) and each rank's output."""
    out = tmp_path / "w"
    env = {"KIND": kind, "STRATEGY": json.dumps({"precision": "fp32"} | strategy), "OUT": str(out)} | env
    outputs = spawn_ranks(Path(__file__), 2, store=tmp_path / "store", env=env)
    weights: dict[str, torch.Tensor] = {}
    for rank in (0, 1):
        if Path(f"{out}.{rank}.pt").exists():
            held = torch.load(f"{out}.{rank}.pt")
            weights |= {name.removeprefix("module."): value for name, value in held.items()}  # DDP's prefix
    return weights, outputs


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], kind: str) -> None:
    assert want.keys() <= got.keys()  # a pipeline's tied head is also there by its own name
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, **TOLERANCE[kind], msg=lambda m, name=name: f"{name}: {m}")


def main() -> None:
    from redline.errors import BadInput
    from redline.plan.strategy import Strategy
    from redline.runtime import parallelize
    from redline.runtime.config import RunConfig
    from redline.runtime.prepare import prepare

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.distributed.init_process_group(
        "gloo", init_method="file://" + os.environ["STORE"], rank=rank, world_size=world
    )
    if os.environ.get("BUCKET_BYTES"):
        parallelize.BROADCAST_BUCKET_BYTES = int(os.environ["BUCKET_BYTES"])
    kind, out = os.environ["KIND"], os.environ["OUT"]
    seed = SEED + rank if os.environ["SEEDS"] == "per-rank" else SEED
    model = build(kind, seed, width=32 + (int(os.environ.get("WIDTH_ON_RANK1", 0)) if rank == 1 else 0))
    loader = torch.utils.data.DataLoader(dataset(kind), batch_size=8)
    plan = RunConfig(strategy=Strategy(**json.loads(os.environ["STRATEGY"])))
    try:
        run = prepare(model, optimizer_for(os.environ["OPTIMIZER"], model), loader, plan=plan, loss_fn=loss_fn(kind))
    except BadInput as error:  # every rank refuses at the same collective: they leave together
        Path(f"{out}.error.{rank}").write_text(str(error))
    else:
        for inputs, targets in run.micro_batches():
            with run.accumulate():
                run.forward_backward(inputs, targets)
        torch.save(tp_worker.full_weights(run.model), f"{out}.{rank}.pt")
        if rank == 0:
            groups = [
                {"weight_decay": g["weight_decay"], "lr": g["lr"], "elements": sum(p.numel() for p in g["params"])}
                for g in run.optimizer.param_groups
            ]
            Path(f"{out}.groups.json").write_text(json.dumps(groups))
    leave_together()


if __name__ == "__main__":
    main()
