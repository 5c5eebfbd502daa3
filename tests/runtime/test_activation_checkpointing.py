"""Activation checkpointing as the runtime applies it (``apply_activation_checkpointing``): full or selective,
on every k-th block. On the CPU in fp32 a recomputation is exact, so training comes out as without it; what
changes is what the forward leaves alive for the backward, and what the backward runs again."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from redline.errors import BadInput
from redline.plan.planfile import dump_plan, load_plan
from redline.plan.strategy import Strategy
from redline.runtime.config import RunConfig, check_settings, from_plan_file
from redline.runtime.parallelize import apply_activation_checkpointing
from redline.runtime.prepare import prepare
from redline.workload.profile import TransformerShape
from redline.workload.selective import SAVED_OPS
from redline.workload.structure import find_blocks, without_kv_cache
from reference_gpt import Gpt

transformers = pytest.importorskip("transformers")

VOCAB = 64
LAYERS = 4
aten = torch.ops.aten


def gpt(seq_len: int = 32) -> nn.Module:
    """The repo's GPT: LayerNorm, biased linears (``addmm``), SDPA (on the CPU its flash kernel), tanh GELU."""
    shape = TransformerShape(
        layers=LAYERS, hidden=64, heads=4, ffn_hidden=256, vocab=VOCAB, seq_len=seq_len, position_embeddings=seq_len
    )
    return Gpt(shape)


def llama(attention: str, dropout: float = 0.0) -> Callable[[], nn.Module]:
    """A tiny Hugging Face Llama from a config (random weights): RMSNorm, rotary, SwiGLU, two KV heads for
    four, linears without bias (``mm``); attention through SDPA or eager (two ``bmm`` and a softmax)."""

    def make() -> nn.Module:
        config = transformers.LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=LAYERS,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=VOCAB,
            attention_dropout=dropout,
            attn_implementation=attention,
        )
        model = transformers.LlamaForCausalLM(config)
        without_kv_cache(model)
        return model

    return make


MODELS: dict[str, Callable[[], nn.Module]] = {
    "gpt": gpt,
    "llama-sdpa-dropout": llama("sdpa", dropout=0.1),
    "llama-eager-dropout": llama("eager", dropout=0.1),
}


def built(make: Callable[[], nn.Module], mode: str, every: int = 1) -> nn.Module:
    torch.manual_seed(0)
    model = make()
    blocks = [block for _, block in find_blocks(model)]
    assert len(blocks) == LAYERS
    apply_activation_checkpointing(blocks, Strategy(checkpointing=mode, checkpoint_every=every))
    return model


def logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids)
    return out if isinstance(out, torch.Tensor) else out.logits


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits(model, ids)[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def token_ids(batch: int, seq_len: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq_len), generator=torch.Generator().manual_seed(1))


def train(make: Callable[[], nn.Module], mode: str, every: int = 1, steps: int = 3) -> tuple[list[float], nn.Module]:
    """``steps`` SGD steps from the same weights and RNG state (dropout draws the same masks); the losses."""
    model = built(make, mode, every).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = token_ids(4, 32)
    torch.manual_seed(2)
    losses = []
    for _ in range(steps):
        loss = lm_loss(model, ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model


def weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize(("mode", "every"), [("selective", 1), ("selective", 2), ("full", 2)])
def test_checkpointing_trains_as_without_it(model: str, mode: str, every: int) -> None:
    """fp32 on the CPU: each recomputed op runs the same kernel on the same inputs, and dropout draws the same
    mask again (the checkpoint restores the RNG state), so the losses and weights are those without."""
    plain_losses, plain = train(MODELS[model], "none")
    losses, checkpointed = train(MODELS[model], mode, every)
    assert losses == plain_losses
    torch.testing.assert_close(weights(checkpointed), weights(plain), rtol=0, atol=0)


class OpCounter(TorchDispatchMode):
    """Counts the aten ops run while it is on."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[torch._ops.OpOverload] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func] += 1
        return func(*args, **(kwargs or {}))


def recomputed(make: Callable[[], nn.Module], mode: str) -> Counter[torch._ops.OpOverload]:
    """The ops the backward runs beyond those of the backward without checkpointing: the recomputed forward."""

    def backward_ops(mode: str) -> Counter[torch._ops.OpOverload]:
        model = built(make, mode).train()
        loss = lm_loss(model, token_ids(2, 16))
        with OpCounter() as counter:
            loss.backward()
        return counter.ops

    return backward_ops(mode) - backward_ops("none")


def test_selective_keeps_the_matmuls_and_recomputes_the_rest() -> None:
    """The repo's GPT: the biased linears (``addmm``) and the attention kernel run once under selective
    checkpointing and again under full (all but the last linear, whose output no backward needs: the
    recomputation stops there); the LayerNorms and the GELU run again under both."""
    selective, full = recomputed(gpt, "selective"), recomputed(gpt, "full")
    assert not set(selective) & SAVED_OPS
    assert selective[aten.native_layer_norm.default] == 2 * LAYERS and selective[aten.gelu.default] == LAYERS
    assert full[aten.addmm.default] == 3 * LAYERS
    assert full[aten._scaled_dot_product_flash_attention_for_cpu.default] == LAYERS
    assert full[aten.native_layer_norm.default] == 2 * LAYERS


def test_selective_recomputes_an_unfused_attention_core() -> None:
    """Llama with eager attention: its seven linears a block (``mm``) are kept (full checkpointing recomputes
    all but the last), while the attention core, both
    ``bmm`` (scores and their product with the values) and the softmax between them, is recomputed with the
    RMSNorms and SwiGLU's SiLU."""
    selective, full = recomputed(llama("eager"), "selective"), recomputed(llama("eager"), "full")
    assert not set(selective) & SAVED_OPS
    assert selective[aten.bmm.default] == 2 * LAYERS and selective[aten._softmax.default] == LAYERS
    assert selective[aten.silu.default] == LAYERS and selective[aten.rsqrt.default] == 2 * LAYERS
    assert full[aten.mm.default] == 6 * LAYERS and full[aten._softmax.default] == LAYERS


class Alive(TorchDispatchMode):
    """Every storage the ops create while it is on, held weakly: what is still alive after the forward is what
    the forward left for the backward (saved tensors, selective checkpointing's kept outputs, checkpoints'
    inputs). Deterministic, unlike the process's RSS. Tensors saved inside a checkpointed block are invisible
    to ``saved_tensors_hooks`` set outside it (the checkpoint's own hooks take them), so this counts storages."""

    def __init__(self, before: list[torch.Tensor]) -> None:
        super().__init__()
        self.existing = {t.untyped_storage().data_ptr() for t in before}  # weights: their views are not new
        self.created: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() not in self.existing:
                self.created[tensor.untyped_storage()] = tensor.untyped_storage().nbytes()
        return out

    def nbytes(self) -> int:
        gc.collect()
        return sum(self.created.values())


@contextlib.contextmanager
def math_attention(on: bool) -> Iterator[None]:
    """SDPA's unfused path (as on a GPU without a fused kernel for the case): the s x s scores exist."""
    with sdpa_kernel(SDPBackend.MATH) if on else contextlib.nullcontext():
        yield


def activation_bytes(make: Callable[[], nn.Module], mode: str, every: int = 1, *, unfused: bool = False) -> int:
    """Bytes the forward leaves alive for the backward, over one sequence of 256 tokens (the backward runs:
    selective checkpointing's kept outputs are then released)."""
    model = built(make, mode, every).train()
    ids = token_ids(1, 256)
    with math_attention(unfused), Alive([*model.parameters(), ids]) as alive:
        loss = logits(model, ids).square().mean()
    kept = alive.nbytes()
    with math_attention(unfused):
        loss.backward()
    return kept


@pytest.mark.parametrize(
    ("make", "unfused"), [(lambda: gpt(256), True), (llama("eager"), False)], ids=["gpt-unfused-sdpa", "llama-eager"]
)
def test_selective_keeps_less_than_none_and_more_than_full(make: Callable[[], nn.Module], unfused: bool) -> None:
    """At 256 tokens of a 64-wide model the attention core's s x s tensors (softmax's output, per head) are
    most of a block's activations: selective checkpointing drops them, and keeps the linears' outputs that full
    checkpointing recomputes too. Checkpointing every second block keeps between none and every block."""
    none, selective, full = (activation_bytes(make, mode, unfused=unfused) for mode in ("none", "selective", "full"))
    every_second = activation_bytes(make, "selective", 2, unfused=unfused)
    scores_bytes = LAYERS * 4 * 256 * 256 * 4  # one fp32 s x s tensor per head and block
    assert none - selective >= scores_bytes
    assert none > every_second > selective > full


def test_every_k_checkpoints_the_kth_block_and_each_kth_after() -> None:
    blocks = [nn.Linear(2, 2) for _ in range(5)]
    apply_activation_checkpointing(blocks, Strategy(checkpointing="selective", checkpoint_every=2))
    assert ["forward" in vars(block) for block in blocks] == [False, True, False, True, False]


def test_checkpointing_that_would_cover_no_block_is_refused() -> None:
    with pytest.raises(BadInput, match="no repeated blocks"):
        apply_activation_checkpointing([], Strategy(checkpointing="selective"))
    with pytest.raises(BadInput, match="ac_every 3 is more than the model's 2 repeated blocks"):
        apply_activation_checkpointing(
            [nn.Linear(2, 2), nn.Linear(2, 2)], Strategy(checkpointing="full", checkpoint_every=3)
        )
    apply_activation_checkpointing([], Strategy(checkpoint_every=3))  # nothing asked, nothing to do


def test_ac_every_is_the_strategys_checkpoint_every() -> None:
    with pytest.raises(ValueError, match="checkpoint_every must be a positive integer"):
        Strategy(checkpoint_every=0)
    with pytest.raises(BadInput, match="checkpoint_every must be a positive integer"):
        check_settings({"ac_every": 0})  # `redline run --ac-every 0`, before any rank starts
    config = RunConfig(strategy=Strategy(checkpointing="full")).with_settings({"ac_every": 3})
    assert config.strategy.checkpoint_every == 3
    assert config.strategy.label().endswith("ckpt=full/3")


def selective_plan(tmp_path: Path, checkpoint_every: int) -> Path:
    """A plan file whose strategy checkpoints selectively every ``checkpoint_every``-th block, as ``redline plan
    -o`` writes one."""
    from redline.plan.estimate import Goal
    from redline.plan.hardware import parse_hardware
    from redline.plan.planfile import make_plan
    from redline.plan.search import search
    from redline.workload.presets import preset_profile

    profile, cluster, goal = preset_profile("gpt2"), parse_hardware("1xh100-sxm"), Goal(global_batch=8, tokens=1e9)
    plan = make_plan(profile, cluster, goal, search(profile, cluster, goal).ranked[0])
    strategy = Strategy(
        data=1,
        micro_batch=4,
        accumulation=2,
        precision="fp32",
        checkpointing="selective",
        checkpoint_every=checkpoint_every,
    )
    path = tmp_path / "plan.yaml"
    path.write_text(dump_plan(dataclasses.replace(plan, strategy=strategy)))
    assert load_plan(path).strategy.checkpointing == "selective"
    return path


def train_prepared(plan: Path | RunConfig, **overrides) -> tuple[nn.Module, list[nn.Module]]:
    """Two optimizer steps of the repo's GPT through ``prepare()``, under a plan made for GPT-2 on an H100: run
    anyway (``plan_anyway``), as what is tested is the plan's checkpointing."""
    torch.manual_seed(0)
    model = gpt()
    blocks = [block for _, block in find_blocks(model)]
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(token_ids(16, 32)), batch_size=8)
    run = prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), loader, plan=plan, plan_anyway=True, **overrides)
    for (ids,) in run.micro_batches():
        with run.accumulate():
            run.backward(lm_loss(run.model, ids))
    return model, blocks


def test_prepare_runs_a_plan_that_checkpoints_selectively(tmp_path: Path, monkeypatch) -> None:
    """The plan file's ``checkpointing: selective``, on every second block from its strategy and
    every third from ``redline run --ac-every 3`` ($REDLINE_RUNTIME): trained as without checkpointing."""
    path = selective_plan(tmp_path, checkpoint_every=2)
    assert from_plan_file(path).strategy.checkpoint_every == 2
    plain, _ = train_prepared(RunConfig(strategy=dataclasses.replace(load_plan(path).strategy, checkpointing="none")))

    selective, blocks = train_prepared(path)
    assert ["forward" in vars(block) for block in blocks] == [False, True, False, True]
    torch.testing.assert_close(weights(selective), weights(plain), rtol=0, atol=0)

    monkeypatch.setenv("REDLINE_RUNTIME", '{"ac_every": 3}')
    third, blocks = train_prepared(path, ac_every=1)  # the command line's option wins over the keyword
    assert ["forward" in vars(block) for block in blocks] == [False, False, True, False]
    torch.testing.assert_close(weights(third), weights(plain), rtol=0, atol=0)
