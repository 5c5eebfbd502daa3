"""Activation checkpointing of every k-th block in the planner (the runtime's ``checkpoint_every``, ``--ac-every``):
memory and recomputation in between checkpointing every block and none, the search trying it, and what a pipeline
stage holds under FSDP (``torch.distributed.pipelining`` keeps its gradients whole through the step)."""

from __future__ import annotations

import dataclasses

import pytest

from conftest import run_cli
from redline.plan.estimate import Goal
from redline.plan.hardware import parse_hardware
from redline.plan.memory import covered_blocks, memory_per_gpu, stage_memory, stages
from redline.plan.planfile import load_plan
from redline.plan.search import Constraints, search
from redline.plan.steptime import recomputed_flops_per_sample, step_time
from redline.plan.strategy import Strategy
from redline.workload.presets import preset_profile

GPT2 = preset_profile("gpt2")  # 12 identical blocks
H100X8 = parse_hardware("8xh100-sxm")


@pytest.mark.parametrize(("every", "covered"), [(1, 12), (2, 6), (4, 3), (5, 2)])
def test_every_kth_block_is_covered_as_the_runtime_picks_them(every: int, covered: int) -> None:
    strategy = Strategy(checkpointing="full", checkpoint_every=every)
    (stage,) = stages(GPT2, 1)
    names = covered_blocks(strategy, stage)
    assert len(names) == covered
    assert names == {block.name for block in stage.blocks[every - 1 :: every]}  # the k-th, the 2k-th...
    assert covered_blocks(Strategy(checkpoint_every=every), stage) == frozenset()  # nothing without checkpointing


def test_checkpointing_every_second_block_keeps_half_of_each() -> None:
    """Memory: the covered blocks keep their input, the others all they save: exactly halfway, per block."""
    b = 4
    none, half, full = (
        memory_per_gpu(GPT2, Strategy(micro_batch=b, checkpointing=c, checkpoint_every=k), gpus_per_node=8)
        for c, k in (("none", 1), ("full", 2), ("full", 1))
    )
    assert half.activations == pytest.approx((none.activations + full.activations) / 2)
    assert full.activations < half.activations < none.activations


def test_checkpointing_every_second_block_recomputes_half() -> None:
    none, half, full = (
        step_time(GPT2, Strategy(micro_batch=8, checkpointing=c, checkpoint_every=k), H100X8).compute
        for c, k in (("none", 1), ("full", 2), ("full", 1))
    )
    assert half - none == pytest.approx((full - none) / 2)
    every_block = recomputed_flops_per_sample(GPT2, Strategy(checkpointing="full"))
    assert recomputed_flops_per_sample(GPT2, Strategy(checkpointing="full", checkpoint_every=4)) == every_block / 4


def test_the_search_checkpoints_fewer_blocks_where_memory_allows() -> None:
    """GPT-2 at 80 x 1024 tokens on one 80 GB GPU: nothing fits without checkpointing, checkpointing every block
    leaves memory unused, so the fastest plan checkpoints every second; fixing ``checkpoint_every`` keeps the
    search to it."""
    one_gpu, goal = parse_hardware("1xh100-sxm"), Goal(global_batch=480)
    ranked = search(GPT2, one_gpu, goal, Constraints(micro_batch=80)).ranked
    assert [e.strategy.label() for e in ranked] == ["ddp dp1 mb80x6 bf16 ckpt=full/2", "ddp dp1 mb80x6 bf16 ckpt=full"]
    assert ranked[0].time.total < ranked[1].time.total
    fixed = search(GPT2, one_gpu, goal, Constraints(micro_batch=80, checkpoint_every=1)).ranked
    assert [e.strategy.label() for e in fixed] == ["ddp dp1 mb80x6 bf16 ckpt=full"]


def test_a_pipeline_stage_holds_fsdps_whole_gradients_and_weights() -> None:
    """Under a pipeline, torch.distributed.pipelining turns FSDP's per-micro-batch reduce-scatter and resharding
    off until the last micro-batch: a stage holds its whole fp32 gradients and 16-bit weights, and reduce-scatters
    once a step, however many micro-batches; without a pipeline the runtime reduce-scatters every micro-batch."""
    profile = preset_profile("llama-2-7b")
    piped = Strategy(data=4, pipeline=2, sharding="fsdp", micro_batch=1, accumulation=4)
    (first, _) = stages(profile, 2)
    memory = stage_memory(profile, piped, first, gpus_per_node=8)
    params = sum(layer.params for layer in (*first.blocks, *first.fixed))
    assert memory.grads == pytest.approx(4 * params)  # whole, fp32
    assert memory.weight_copies == pytest.approx(2 * params)  # whole, bf16
    alone = stage_memory(
        profile, Strategy(data=4, sharding="fsdp", micro_batch=1, accumulation=4), first, gpus_per_node=8
    )
    assert alone.grads == pytest.approx(4 * params / 4)  # sharded four ways

    def dp_s(strategy: Strategy) -> float:
        return step_time(profile, strategy, parse_hardware("8xh100-sxm").with_nodes(2)).data_parallel_comm

    assert dp_s(piped) == pytest.approx(
        dp_s(Strategy(data=4, pipeline=2, sharding="fsdp", micro_batch=1, accumulation=8))
    )
    unpiped = Strategy(data=8, sharding="fsdp", micro_batch=1, accumulation=4)
    assert dp_s(dataclasses.replace(unpiped, accumulation=8)) > dp_s(unpiped)


def test_plan_ac_every_fixes_it_and_refuses_it_without_checkpointing(tmp_path) -> None:
    out = tmp_path / "plan.yaml"
    args = ["plan", "-m", "gpt2", "--hardware", "1xh100-sxm", "--global-batch", "480", "--micro-batch", "80"]
    result = run_cli(*args, "--checkpointing", "full", "--ac-every", "2", "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert load_plan(out).strategy.checkpoint_every == 2
    refused = run_cli(*args, "--checkpointing", "none", "--ac-every", "2")
    assert refused.returncode == 2 and "--ac-every" in refused.stderr and "Traceback" not in refused.stderr
    too_far = run_cli(*args, "--ac-every", "13")  # GPT-2 has 12 blocks
    assert too_far.returncode == 2 and "--ac-every 13: a pipeline rank holds 12 blocks" in too_far.stderr
