"""Trains a tiny model under a strategy through ``prepare()`` and writes its whole weights and step losses:
run as one process by the tests, and as ranks by ``spawn_ranks`` (tensor parallelism over gloo).

Environment: MODEL (gpt, llama, bert, gpt2, reference_gpt), STRATEGY (JSON of Strategy fields) or
REDLINE_PLAN (a plan file, as `redline run --plan` sets it), OUT (the weights file; the losses go to
OUT.losses.json, each rank's parameter bytes to OUT.bytes.RANK), and optionally CHECKPOINT_DIR, STEPS (stop
after this many optimizer steps), MOMENTUM (SGD's; 0 unless given), GRAD_CLIP (clip the gradients' norm to
this), NORM (a norm's module path: the sequence rows each of its forwards computed on go to OUT.rows.RANK).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ranks import leave_together

EXAMPLES = Path(__file__).parents[2] / "examples"
VOCAB, SEQ, SAMPLES = 64, 16, 32
NORM_ROWS: list[int] = []  # the sequence rows of each forward of the norm NORM names, on this rank


def make_model(kind: str, layers: int = 2) -> nn.Module:
    torch.manual_seed(0)
    if kind == "gpt":
        sys.path.insert(0, str(EXAMPLES))
        from train_gpt import Gpt

        return Gpt(vocab=VOCAB, width=32, layers=layers, heads=4, seq=SEQ)
    if kind == "reference_gpt":  # a packed q/k/v in nn.Linear, the output projection the embedding's weight
        from redline.workload.profile import TransformerShape
        from reference_gpt import Gpt as ReferenceGpt

        shape = TransformerShape(
            layers=layers, hidden=32, heads=4, ffn_hidden=64, vocab=VOCAB, seq_len=SEQ, position_embeddings=SEQ
        )
        return ReferenceGpt(shape)
    if kind == "bert":  # a masked-LM head tied to the word embedding; no dropout: ranks would draw their own
        from transformers import BertConfig, BertForMaskedLM

        config = BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=layers,
            num_attention_heads=4,
            max_position_embeddings=SEQ,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        return BertForMaskedLM(config)
    if kind == "gpt2":  # Conv1D projections, a packed q/k/v, the head tied to the token embedding
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            vocab_size=VOCAB,
            n_embd=32,
            n_layer=layers,
            n_head=4,
            n_positions=SEQ,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        return GPT2LMHeadModel(config)
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
    )
    return LlamaForCausalLM(config)


def dataset() -> torch.utils.data.TensorDataset:
    tokens = torch.randint(0, VOCAB, (SAMPLES, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])


def logits(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    out = model(tokens)
    return out if isinstance(out, torch.Tensor) else out.logits


def local_share(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's share of a DTensor, a plain tensor as it is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (a DTensor gathered), by name without wrappers' prefixes."""
    return {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for name, p in model.named_parameters()
    }


def train(kind: str, plan, *, checkpoint_dir: str | None = None, steps: int | None = None):
    from redline.runtime.prepare import prepare

    model = make_model(kind)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=8)
    run = prepare(
        model,
        lambda params: torch.optim.SGD(params, lr=0.5, momentum=float(os.environ.get("MOMENTUM", 0))),
        loader,
        plan=plan,
        checkpoint_dir=checkpoint_dir,
        grad_clip_norm=float(os.environ["GRAD_CLIP"]) if os.environ.get("GRAD_CLIP") else None,
    )
    if os.environ.get("NORM"):
        run.model.get_submodule(os.environ["NORM"]).register_forward_hook(
            lambda module, inputs, output: NORM_ROWS.append(local_share(output).shape[1])
        )
    for tokens, targets in run.micro_batches():
        with run.accumulate():
            run.backward(F.cross_entropy(logits(run.model, tokens).flatten(0, 1), targets.flatten()))
        if steps is not None and run.step >= steps:
            break
    run.close()
    return run, [record.loss for record in run.metrics.records]


def main() -> None:
    from redline.plan.strategy import Strategy
    from redline.runtime.config import RunConfig

    if "STORE" in os.environ:  # spawn_ranks' file rendezvous: prepare() finds the group made (under
        # `redline run`, prepare() joins torchrun's)
        torch.distributed.init_process_group(
            "gloo",
            init_method="file://" + os.environ["STORE"],
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
        )
    plan = None if "REDLINE_PLAN" in os.environ else RunConfig(strategy=Strategy(**json.loads(os.environ["STRATEGY"])))
    steps = int(os.environ["STEPS"]) if os.environ.get("STEPS") else None
    run, losses = train(os.environ["MODEL"], plan, checkpoint_dir=os.environ.get("CHECKPOINT_DIR"), steps=steps)
    weights = full_weights(run.model)
    from redline.runtime.tensor_parallel import local_parameter_bytes

    local = local_parameter_bytes(run.model)
    if torch.distributed.is_initialized():
        rank = torch.distributed.get_rank()
        Path(f"{os.environ['OUT']}.bytes.{rank}").write_text(str(local))
        if os.environ.get("NORM"):
            Path(f"{os.environ['OUT']}.rows.{rank}").write_text(json.dumps(NORM_ROWS))
        if rank == 0:
            torch.save(weights, os.environ["OUT"])
            Path(os.environ["OUT"] + ".losses.json").write_text(json.dumps(losses))
            Path(os.environ["OUT"] + ".samples.json").write_text(json.dumps([r.samples for r in run.metrics.records]))
        leave_together()


if __name__ == "__main__":
    main()
