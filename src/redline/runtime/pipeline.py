"""Pipeline parallelism over the user's own model, cut where the plan's stages say: ``torch.distributed.pipelining``
runs the schedule (GPipe, 1F1B, interleaved 1F1B); redline cuts the model into stages without tracing it and
without a change to its code.

The cut. The model's repeated blocks (``find_blocks``) are split over ``pipeline x virtual_stages`` stages as
the planner splits them (``plan.memory.block_counts``: evenly, the remainder on the last stages). The first
stage also holds what runs before the blocks (the embedding), the last what runs after (the final norm, the
output head). Stage ``s`` runs on pipeline rank ``s mod pipeline``: under the interleaved schedule each rank
holds ``virtual_stages`` of them, looped. A ``Stage`` holds its parts under their own names in the model
(``model.layers.3.mlp.up_proj``), so the optimizer, the tensor-parallel plan and checkpoints (DCP writes each
stage's parameters from its rank) see the model's own names; what this rank's stages do not hold is moved to
the meta device, its memory freed.

How a stage computes (``StageLayout``), first match wins:

1. the model's own: a method ``redline_pp_stage(x, blocks, *, first, last)`` computing one stage's share of the
   forward (on the first stage ``x`` is the model's input, elsewhere the previous stage's output; ``blocks``
   are the stage's blocks, in order) and an attribute ``redline_pp_modules = {"first": (paths...), "last":
   (paths...)}`` naming the modules the first and the last stage use besides the blocks
   (``examples/train_gpt.py`` has both);
2. Hugging Face Llama, Mistral, Qwen2 and GPT-2 (found by their module names), with or without the LM head:
   each stage computes the positions, the causal mask and the rotary embedding itself, as the model's forward
   does; the last stage returns the logits.

The loss runs on the last stage, ``loss_fn(output, target)`` per micro-batch, each micro-batch's gradient
scaled by 1/micro-batches (the mean, as accumulation takes it). A weight both the first and the last stage use
(an embedding tied to the output head) is held by both, its gradient summed over the two after each backward,
as Megatron does. Each stage holds what Megatron-LM's stages hold (``pipeline_stage.ReleasingStage``): a sent
output's data is freed, and receive buffers are lent to the micro-batches in flight.
"""

from __future__ import annotations

import functools
import inspect
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
from torch import nn

from redline.errors import BadInput
from redline.plan.memory import block_counts
from redline.runtime.pipeline_stage import ReleasingStage
from redline.workload.structure import find_blocks, module_prefix

# run(model, x, blocks, first, last): one stage's share of the model's forward
StageForward = Callable[[nn.Module, Any, Sequence[nn.Module], bool, bool], Any]
LossFn = Callable[[Any, Any], torch.Tensor]  # loss_fn(output, target)


@dataclass(frozen=True)
class StageLayout:
    """How a model runs in stages: the modules the first stage uses before its blocks, the last after them,
    every stage (buffers only: rotary frequencies), and a stage's share of the forward."""

    family: str
    first: tuple[str, ...]
    last: tuple[str, ...]
    every: tuple[str, ...]
    run: StageForward


# --------------------------------------------------------------------------------------------- layouts


class _OwnStages(Protocol):
    """A model that computes its own stages (``find_layout``'s first choice)."""

    def redline_pp_stage(self, x: Any, blocks: Sequence[nn.Module], *, first: bool, last: bool) -> Any: ...


def _own_stage(model: nn.Module, x: Any, blocks: Sequence[nn.Module], first: bool, last: bool) -> Any:
    own = cast(_OwnStages, model)  # find_layout picked this layout because the model has the method
    return own.redline_pp_stage(x, blocks, first=first, last=last)


def _llama_stage(model: nn.Module, x: Any, blocks: Sequence[nn.Module], first: bool, last: bool, *, base: str) -> Any:
    body = model.get_submodule(base.removesuffix("."))
    part = body.get_submodule  # the modules by name (FAMILIES found them there), each an nn.Module to call
    h = part("embed_tokens")(x) if first else x
    positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
    mask = _causal_mask(body.config, h, positions)
    rotary = part("rotary_emb")(h, position_ids=positions)
    for block in blocks:
        h = _hidden(block(h, attention_mask=mask, position_embeddings=rotary, position_ids=positions))
    if last:
        h = part("norm")(h)
        h = model.get_submodule("lm_head")(h) if base else h
    return h


def _gpt2_stage(model: nn.Module, x: Any, blocks: Sequence[nn.Module], first: bool, last: bool, *, base: str) -> Any:
    body = model.get_submodule(base.removesuffix("."))
    part = body.get_submodule  # the modules by name (FAMILIES found them there), each an nn.Module to call
    positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
    h = part("drop")(part("wte")(x) + part("wpe")(positions)) if first else x
    mask = _causal_mask(body.config, h, positions)
    for block in blocks:
        h = _hidden(block(h, attention_mask=mask, position_ids=positions))
    if last:
        h = part("ln_f")(h)
        h = model.get_submodule("lm_head")(h) if base else h
    return h


def _llama_layout(model: nn.Module, base: str) -> StageLayout:
    head = ("lm_head",) if base else ()
    return StageLayout(
        "Llama/Mistral/Qwen2",
        first=(f"{base}embed_tokens",),
        last=(f"{base}norm", *head),
        every=(f"{base}rotary_emb",),
        run=functools.partial(_llama_stage, base=base),
    )


def _gpt2_layout(model: nn.Module, base: str) -> StageLayout:
    head = ("lm_head",) if base else ()
    first = (f"{base}wte", f"{base}wpe", f"{base}drop")
    return StageLayout("GPT-2", first, (f"{base}ln_f", *head), (), functools.partial(_gpt2_stage, base=base))


# the families found by their module names (under one prefix: "model." in LlamaForCausalLM, "transformer." in
# GPT2LMHeadModel, "" in the bare bodies), and their layouts
FAMILIES: tuple[tuple[str, tuple[str, ...], Callable[[nn.Module, str], StageLayout]], ...] = (
    ("Llama/Mistral/Qwen2", ("embed_tokens", "layers.0", "rotary_emb", "norm"), _llama_layout),
    ("GPT-2", ("wte", "wpe", "h.0", "ln_f"), _gpt2_layout),
)


def find_layout(model: nn.Module) -> StageLayout:
    """The model's own stage layout (``redline_pp_stage`` and ``redline_pp_modules``), else its family's;
    BadInput naming what a model can do where there is none."""
    name = type(model).__name__
    if callable(getattr(model, "redline_pp_stage", None)):
        modules = getattr(model, "redline_pp_modules", None)
        if not isinstance(modules, dict) or not set(modules) <= {"first", "last", "every"}:
            raise BadInput(
                f"{name}.redline_pp_modules is {modules!r}: give {{'first': (module paths...), 'last': (...)}}"
            )
        parts = {key: tuple(modules.get(key, ())) for key in ("first", "last", "every")}
        return StageLayout(name, parts["first"], parts["last"], parts["every"], _own_stage)
    for _, names, build in FAMILIES:
        base = module_prefix(model, names)
        if base is not None:
            return build(model, base)
    known = ", ".join(family for family, _, _ in FAMILIES)
    raise BadInput(
        f"no pipeline stage layout for {name}: redline knows {known}; give the model a "
        "redline_pp_stage(x, blocks, *, first, last) method and a redline_pp_modules attribute, or plan with --pp 1"
    )


def _causal_mask(config: Any, hidden: torch.Tensor, positions: torch.Tensor) -> Any:
    """The causal mask a Hugging Face model's forward builds for a batch without padding (None where its
    attention implementation makes it causal itself), whichever keywords this transformers version takes."""
    from transformers.masking_utils import create_causal_mask

    offered = {
        "config": config,
        "inputs_embeds": hidden,
        "input_embeds": hidden,
        "attention_mask": None,
        "cache": None,
        "past_key_values": None,
        "position_ids": positions,
        "cache_position": positions[0],
    }
    accepted = inspect.signature(create_causal_mask).parameters
    return create_causal_mask(**{key: value for key, value in offered.items() if key in accepted})


def _hidden(output: Any) -> torch.Tensor:
    """A decoder layer's hidden states: older transformers return them in a tuple."""
    return output[0] if isinstance(output, tuple) else output


# ------------------------------------------------------------------------------------------ the cut


class Stage(nn.Module):
    """One pipeline stage: its blocks and parts registered under their names in the model, and its share of the
    forward (``layout.run`` on the model)."""

    def __init__(
        self,
        model: nn.Module,
        layout: StageLayout,
        parts: dict[str, nn.Module],
        blocks: list[nn.Module],
        *,
        index: int,
        first: bool,
        last: bool,
    ) -> None:
        super().__init__()
        register_parts(self, parts)
        # plain attributes (the modules are registered above, under their names), named apart from those
        self.held_parts, self.held_blocks = parts, tuple(blocks)
        self.stage_index, self.is_first, self.is_last = index, first, last
        self._run = functools.partial(layout.run, model)

    def forward(self, x: Any) -> Any:
        return self._run(x, self.held_blocks, self.is_first, self.is_last)


class RankModel(nn.Module):
    """Every stage this pipeline rank holds, under the model's own names: what the optimizer, checkpoints and
    the step metrics see as the model. The schedule runs the stages; calling this is a mistake, said."""

    def __init__(self, stages: Sequence[Stage]) -> None:
        super().__init__()
        register_parts(self, {path: part for stage in stages for path, part in stage.held_parts.items()})

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise BadInput(
            "under pipeline parallelism the stages run inside the schedule: call run.forward_backward(inputs, "
            "target) in the loop, not run.model(...)"
        )


def register_parts(root: nn.Module, parts: dict[str, nn.Module]) -> None:
    """Each module of ``parts`` registered under ``root`` at its dotted path, plain containers made on the way."""
    for path, module in parts.items():
        *parents, name = path.split(".")
        node = root
        for part in parents:
            child = node._modules.get(part)
            if child is None:
                child = nn.Module()
                node.add_module(part, child)
            node = child
        node.add_module(name, module)


def split(
    model: nn.Module,
    layout: StageLayout,
    *,
    pipeline: int,
    virtual: int,
    pp_rank: int,
    rank_blocks: Sequence[int] | None = None,
) -> list[Stage]:
    """This pipeline rank's stages of ``model``, first to last; the modules they do not hold moved to the meta
    device. ``rank_blocks``: the blocks each pipeline rank holds, as the plan says (None: as evenly as they go)."""
    named_blocks = find_blocks(model)
    sizes = stage_sizes(len(named_blocks), pipeline=pipeline, virtual=virtual, rank_blocks=rank_blocks)
    if 0 in sizes:
        raise BadInput(
            f"the plan cuts {type(model).__name__} into {len(sizes)} pipeline stages, and it has {len(named_blocks)} "
            "repeated blocks: plan with fewer --pp x --virtual-stages"
        )
    starts = list(itertools.accumulate([0, *sizes]))
    stages = []
    for index in range(pp_rank, len(sizes), pipeline):
        blocks = named_blocks[starts[index] : starts[index + 1]]
        first, last = index == 0, index == len(sizes) - 1
        paths = (*layout.every, *(layout.first if first else ()), *(layout.last if last else ()))
        parts = {path: _submodule(model, path, layout) for path in paths} | dict(blocks)
        modules = [block for _, block in blocks]
        stages.append(Stage(model, layout, parts, modules, index=index, first=first, last=last))
    free_unheld(model, stages)
    return stages


def stage_sizes(blocks: int, *, pipeline: int, virtual: int, rank_blocks: Sequence[int] | None = None) -> list[int]:
    """The blocks of each of the ``pipeline x virtual`` stages, in model order: pipeline rank ``r`` holds
    ``rank_blocks[r]`` (by default the planner's even split, ``block_counts``), as ``virtual`` stages
    ``r, r + pipeline, ...`` split as evenly as they go. A plan's counts that do not add up to this model's
    blocks (a plan for another model) give way to the even split."""
    if rank_blocks is None or len(rank_blocks) != pipeline or sum(rank_blocks) != blocks:
        rank_blocks = block_counts(blocks, pipeline)
    chunks = [block_counts(count, virtual) for count in rank_blocks]
    return [chunks[rank][round_] for round_ in range(virtual) for rank in range(pipeline)]


def _submodule(model: nn.Module, path: str, layout: StageLayout) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError:
        model_name = type(model).__name__
        raise BadInput(f"the {layout.family} stage layout names {path!r}, which {model_name} has not") from None


def free_unheld(model: nn.Module, stages: Sequence[nn.Module]) -> None:
    """Every parameter and buffer of ``model`` that no stage holds replaced by an empty one on the meta device
    (same shape, no memory)."""
    held = {id(t) for stage in stages for t in itertools.chain(stage.parameters(), stage.buffers())}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and id(param) not in held:
                module._parameters[name] = nn.Parameter(_meta_like(param), param.requires_grad)
        for name, buffer in module._buffers.items():
            if buffer is not None and id(buffer) not in held:
                module._buffers[name] = _meta_like(buffer)


def _meta_like(tensor: torch.Tensor) -> torch.Tensor:
    """An empty tensor of ``tensor``'s shape and dtype on the meta device: no memory."""
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")


def tied_names(model: nn.Module, layout: StageLayout) -> list[tuple[str, str]]:
    """(name on the first stage, name on the last) of each parameter both use: an embedding tied to the head."""

    def named(paths: tuple[str, ...]) -> list[tuple[str, nn.Parameter]]:
        return [(f"{path}.{name}", p) for path in paths for name, p in model.get_submodule(path).named_parameters()]

    first = {id(p): name for name, p in named(layout.first)}
    return [(first[id(p)], name) for name, p in named(layout.last) if id(p) in first]


# --------------------------------------------------------------------------------------- the schedule

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B"}


class Pipeline:
    """This rank's stages and the schedule running them: ``step`` is one batch's forward and backward over its
    micro-batches; then ``clip_grad_norm_`` if asked, and the optimizer's step as without a pipeline."""

    def __init__(
        self,
        stages: list[Stage],
        *,
        schedule: str,
        pp_group: dist.ProcessGroup,
        device: torch.device,
        loss_fn: LossFn,
        tied: list[tuple[str, str]],
        tied_group: dist.ProcessGroup | None,
    ) -> None:
        self.stages = stages
        self.schedule = schedule
        self.group = pp_group
        self.first = any(stage.is_first for stage in stages)
        self.last = any(stage.is_last for stage in stages)
        self._device = device
        self._loss_fn = loss_fn
        self._tied = tied
        self._tied_group = tied_group
        self._pipeline_stages: list[Any] = []
        self._schedules: dict[int, Any] = {}

    def step(self, inputs: Any, target: Any, micro_batches: int) -> torch.Tensor | None:
        """One batch through the schedule in ``micro_batches`` parts: the first stage takes ``inputs``, the last
        ``target``; the mean of the micro-batches' losses on the last stage (None elsewhere)."""
        schedule = self._schedule(micro_batches)
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.first else ()
        extra = {"target": target, "losses": losses} if self.last else {}
        schedule.step(*args, return_outputs=False, **extra)
        self._sum_tied_grads()
        return torch.stack(losses).mean().detach() if losses else None

    def _schedule(self, micro_batches: int) -> Any:
        """The schedule for this many micro-batches (made on first use: after an out-of-memory the run comes
        back with more of them)."""
        if micro_batches in self._schedules:
            return self._schedules[micro_batches]
        from torch.distributed import pipelining

        count = dist.get_world_size(self.group) * len(self.stages)
        if not self._pipeline_stages:
            # PyTorch's stage, releasing a sent output's data and lending receive buffers as Megatron does
            self._pipeline_stages = [
                ReleasingStage(stage, stage.stage_index, count, self._device, group=self.group) for stage in self.stages
            ]
        cls = getattr(pipelining, SCHEDULES[self.schedule])
        held = self._pipeline_stages if self.schedule == "interleaved" else self._pipeline_stages[0]
        try:
            built = cls(held, n_microbatches=micro_batches, loss_fn=self._loss_fn)
        except ValueError as exc:
            raise BadInput(
                f"the {self.schedule} schedule over {count} stages cannot run {micro_batches} micro-batches: "
                f"{' '.join(str(exc).split())} (plan with another --accumulation or --schedule)"
            ) from None
        self._schedules[micro_batches] = built
        return built

    def _tied_params(self, *, on: str) -> list[nn.Parameter]:
        """This rank's tied parameters, by their names on the first stage or the last (``on``)."""
        found = []
        for stage in self.stages:
            if stage.is_first and on in ("first", "any"):
                found += [stage.get_parameter(first) for first, _ in self._tied]
            if stage.is_last and on in ("last", "any"):
                found += [stage.get_parameter(last) for _, last in self._tied]
        return found

    def _sum_tied_grads(self) -> None:
        """The first and the last stage's gradients of a weight both use, summed: what one process's autograd
        adds up from its two uses."""
        if self._tied_group is None:
            return
        for param in self._tied_params(on="any"):
            if param.grad is None:  # both stages use the weight: each backward gives it a gradient
                raise RuntimeError("a weight tied across the first and last stages has no gradient after the backward")
            dist.all_reduce(_local(param.grad), group=self._tied_group)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """``clip_grad_norm_`` over the whole model: the norms of this rank's gradients (made whole over the
        data and tensor ranks where they are sharded) summed over the pipeline ranks, a tied weight counted
        once, as one process counts it."""
        from redline.runtime.distributed import clip_grad_norm

        counted_elsewhere = {id(p) for p in self._tied_params(on="last")}
        params = list({id(p): p for stage in self.stages for p in stage.parameters() if p.grad is not None}.values())
        counted = [p for p in params if id(p) not in counted_elsewhere]
        total = clip_grad_norm(counted, max_norm, group=self.group)
        scale = min(1.0, max_norm / (total.item() + 1e-6))
        if scale < 1.0:  # the tied copy on the last stage, which the norm counted on the first
            for param in params:
                if id(param) in counted_elsewhere and param.grad is not None:  # (params: those with a gradient)
                    param.grad.mul_(scale)
        return total


def tied_group(world: Any, tied: list[tuple[str, str]]) -> dist.ProcessGroup | None:
    """The group of this rank and its peer on the other end of the pipeline (same data and tensor place),
    where the model ties weights across the first and last stages; every rank makes every pair's group, as
    ``new_group`` needs."""
    if not tied:
        return None
    ranks = world.mesh.reshape(world.mesh.shape[0], -1)  # the pipeline dimension is the outermost
    own = None
    for first, last in zip(ranks[0].tolist(), ranks[-1].tolist(), strict=True):
        group = dist.new_group([first, last])
        if dist.get_rank() in (first, last):
            own = group
    return own


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor
