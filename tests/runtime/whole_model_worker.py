"""A tiny Hugging Face GPT-2 trained through ``prepare()`` the way public scripts use the model beside the loop:
an EMA kept as ``copy.deepcopy`` of the model, updated from the live weights after each step; the model saved
whole with ``torch.save``; ``model.module``; the whole state dict for ``save_pretrained``. The helpers are the
one-process side of ``test_whole_model.py``; run as gloo ranks by ``spawn_ranks``, ``main`` writes what rank 0
saw to OUT (a ``torch.save``'d dict).

Environment (ranks): SHARDING (ddp, fsdp; pipeline or tensor: two stages or a tensor-parallel pair, untrained),
OUT, STORE (the rendezvous file).
"""

from __future__ import annotations

import copy
import io
import os
import pickle
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ranks import leave_together
from redline.plan.strategy import Strategy
from redline.runtime.config import RunConfig
from redline.runtime.prepare import Run, prepare

VOCAB, SEQ, SAMPLES = 64, 16, 32
GLOBAL_BATCH = 8
LR = 0.5
EMA_DECAY = 0.5  # large moves, so that the EMA's weights differ from the live ones by far more than rounding


def gpt2() -> nn.Module:
    """GPT-2 from a config, random weights (seeded), no dropout: ranks and the one-process loop draw alike."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0
    )
    config.attn_pdrop = 0.0
    return GPT2LMHeadModel(config)


def token_ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=torch.Generator().manual_seed(1))


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return next_token_loss(model(ids).logits, ids)


@torch.no_grad()
def ema_update(ema: nn.Module, live: nn.Module) -> None:
    """The EMA's weights moved toward the live model's: what an EMA or a mean teacher does after each step."""
    for averaged, current in zip(ema.parameters(), live.parameters(), strict=True):
        averaged.lerp_(current, 1 - EMA_DECAY)


def plain_loop() -> tuple[nn.Module, nn.Module]:
    """The loop without redline, one process, the global batch per step: the trained model and its EMA."""
    model = gpt2()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    ema = copy.deepcopy(model)
    for (ids,) in torch.utils.data.DataLoader(torch.utils.data.TensorDataset(token_ids()), batch_size=GLOBAL_BATCH):
        lm_loss(model, ids).backward()
        optimizer.step()
        optimizer.zero_grad()
        ema_update(ema, model)
    return model, ema


def prepared(
    world: int = 1, *, sharding: str = "ddp", checkpointing: str = "none", pipeline: int = 1, tensor: int = 1
) -> Run:
    """``prepare()`` over GPT-2 in fp32 with the global batch shared out over ``world`` ranks (``pipeline``
    stages: the batch in as many micro-batches, the loss on the last stage; ``tensor``: a tensor-parallel group)."""
    model = gpt2()
    data = world // pipeline // tensor
    per_rank = GLOBAL_BATCH // data
    strategy = Strategy(
        data=data,
        pipeline=pipeline,
        tensor=tensor,
        micro_batch=per_rank // pipeline,
        accumulation=pipeline,
        sharding=sharding,
        checkpointing=checkpointing,
        precision="fp32",
    )
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(token_ids()), batch_size=per_rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    return prepare(model, optimizer, loader, plan=RunConfig(strategy=strategy), loss_fn=next_token_loss)


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def train_with_ema(run: Run, *, unwrap: bool) -> nn.Module:
    """The prepared loop, an EMA kept as a deep copy of the model updated after each step: the EMA. ``unwrap``:
    of ``run.model.module``, as a DDP script writes it (the model under any wrapper), else of ``run.model``."""
    live = run.model.module if unwrap else run.model
    ema = copy.deepcopy(live)
    for (ids,) in run.micro_batches():
        with run.accumulate():
            run.backward(lm_loss(run.model, ids))
        ema_update(ema, live)
    return ema


def shares_model(handle: nn.Module, model: nn.Module) -> bool:
    """``handle`` is ``model`` but for its identity: the same parameters, submodules and hooks, no ``module``."""
    same_parameters = all(a is b for a, b in zip(handle.parameters(), model.parameters(), strict=True))
    same_parts = handle._modules is model._modules and handle._forward_pre_hooks is model._forward_pre_hooks
    return handle is not model and same_parameters and same_parts and not hasattr(handle, "module")


def pickling_error(obj: Any) -> str | None:
    """What ``torch.save(obj)`` says when it refuses (None: it saved)."""
    try:
        torch.save(obj, io.BytesIO())
    except (pickle.PicklingError, TypeError, AttributeError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def copy_error(obj: Any) -> str | None:
    try:
        copy.deepcopy(obj)
    except (pickle.PicklingError, TypeError, AttributeError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def main() -> None:
    sharding = os.environ["SHARDING"]
    torch.distributed.init_process_group(
        "gloo", init_method="file://" + os.environ["STORE"], rank=int(os.environ["RANK"]), world_size=2
    )
    rank = torch.distributed.get_rank()
    layout = {"pipeline": {"pipeline": 2}, "tensor": {"tensor": 2}}.get(sharding, {"sharding": sharding})
    run = prepared(2, **layout)
    seen: dict[str, Any] = {
        "module_shares_model": shares_model(run.model.module, run.model),
        "module_class": type(run.model.module).__name__,
        "module_has_module": hasattr(run.model.module, "module"),
        "save_refused": pickling_error(run.model),
        "copy_refused": None if sharding == "ddp" else copy_error(run.model),  # DDP's own copy: not ours to test
        "module_copy_refused": None if sharding == "ddp" else copy_error(run.model.module),
    }
    if sharding == "ddp":
        seen["ema"] = train_with_ema(run, unwrap=True).state_dict()
        seen["module_save_refused"] = pickling_error(run.model.module)
    elif sharding == "fsdp":
        for (ids,) in run.micro_batches():
            with run.accumulate():
                run.backward(lm_loss(run.model, ids))
    if rank == 0:  # the loop without redline, here: a fresh process, as the ranks are (see the test)
        reference, reference_ema = plain_loop() if sharding in ("ddp", "fsdp") else (gpt2(), None)
        seen["reference"] = reference.state_dict()
        seen["reference_ema"] = reference_ema.state_dict() if reference_ema is not None else None
    whole = run.state_dict()
    seen["state_dict"] = whole
    if rank == 0 and sharding in ("ddp", "fsdp"):  # what the state dict is for
        run.model.module.save_pretrained(os.environ["OUT"] + ".hf", state_dict=dict(whole))  # it empties the dict
    with torch.no_grad():  # wipe the weights, then put them back from rank 0's whole state dict
        for param in run.model.parameters():
            param.zero_()
    run.load_state_dict(whole if rank == 0 else {})
    seen["reloaded"] = run.state_dict()
    if rank == 1:
        torch.save(whole, os.environ["OUT"] + ".rank1")
    torch.distributed.barrier()
    if rank == 0:
        torch.save(seen, os.environ["OUT"])
    leave_together()


if __name__ == "__main__":
    main()
