"""FSDP's collectives hide unit by unit: what a block's compute cannot cover at a small micro-batch is exposed, and
the collectives that start and end a micro-batch are exposed at any micro-batch (redline's runtime: FSDP2 on each
block, then the root, reduce-scattering every micro-batch)."""

from __future__ import annotations

import pytest

from redline.plan.comm import Collective, collective_s
from redline.plan.hardware import Cluster, parse_hardware
from redline.plan.memory import stages
from redline.plan.steptime import GRAD_REDUCE_BYTES, _micro_batch_compute_s, step_time
from redline.plan.strategy import Strategy
from redline.workload.presets import preset_profile

LLAMA7 = preset_profile("llama-2-7b")
STAGE = stages(LLAMA7, 1)[0]
BLOCKS = len(STAGE.blocks)
BLOCK_PARAMS = sum(block.params for block in STAGE.blocks) / BLOCKS
ROOT_PARAMS = sum(layer.params for layer in STAGE.fixed)  # embedding, final norm, head: FSDP2's root unit
# four nodes on a slow network: a block's bf16 gather takes longer than its forward at micro-batch 1 and less at 16
CLUSTER = parse_hardware("8xh100-sxm").with_network(100).with_nodes(4)


def fsdp(micro_batch: int, sharding: str = "fsdp", accumulation: int = 1) -> Strategy:
    return Strategy(data=32, sharding=sharding, micro_batch=micro_batch, accumulation=accumulation)


def over_the_group(kind: Collective, size_bytes: float, cluster: Cluster = CLUSTER) -> float:
    return collective_s(
        kind,
        size_bytes,
        ranks_per_node=8,
        nodes=cluster.nodes,
        intra=cluster.intra,
        inter=cluster.inter,
        gpus_per_node=8,
    )


def block_forward_s(micro_batch: int) -> float:
    """One block's forward: the stage's forward times the blocks' share of its FLOPs, over the blocks."""
    forward, _ = _micro_batch_compute_s(LLAMA7, fsdp(micro_batch), STAGE, CLUSTER)
    block_flops = sum(block.forward_flops_per_sample for block in STAGE.blocks)
    stage_flops = block_flops + sum(layer.forward_flops_per_sample for layer in STAGE.fixed)
    return forward * block_flops / stage_flops / BLOCKS


GATHER_S = over_the_group("all_gather", 2 * BLOCK_PARAMS)  # gathered in bf16
# nothing runs beside them: the root's gather and the first block's start the forward, the last block's re-gather
# starts the backward, the first block's and the root's reduce-scatters (fp32) end it
ENDS_S = (
    over_the_group("all_gather", 2 * ROOT_PARAMS)
    + 2 * GATHER_S
    + over_the_group("reduce_scatter", GRAD_REDUCE_BYTES * BLOCK_PARAMS)
    + over_the_group("reduce_scatter", GRAD_REDUCE_BYTES * ROOT_PARAMS)
)


def exposed_s(strategy: Strategy) -> float:
    return step_time(LLAMA7, strategy, CLUSTER).data_parallel_comm


def test_the_premise_a_blocks_gather_outlasts_its_forward_at_micro_batch_1_and_not_at_16() -> None:
    assert block_forward_s(1) < GATHER_S < block_forward_s(16)


def test_a_big_micro_batch_hides_all_but_the_collectives_that_start_and_end_it() -> None:
    exposed = exposed_s(fsdp(16))
    assert exposed >= ENDS_S
    # and no more than the compute slowed beside the hidden ones (Calculon's 15% over NVLink, 2% over the network)
    every_collective_s = BLOCKS * (2 * GATHER_S + over_the_group("reduce_scatter", GRAD_REDUCE_BYTES * BLOCK_PARAMS))
    assert exposed <= ENDS_S + 0.15 * every_collective_s


def test_halving_the_micro_batch_below_the_cover_exposes_each_blocks_gather() -> None:
    small, big = exposed_s(fsdp(1)), exposed_s(fsdp(16))
    # every block after the first waits for its gather where its predecessor's forward ends first
    assert small >= ENDS_S + (BLOCKS - 1) * (GATHER_S - block_forward_s(1))
    assert small > big + (BLOCKS - 1) * (GATHER_S - block_forward_s(1)) * 0.9


def test_accumulation_repeats_it_every_micro_batch() -> None:
    """The runtime reduce-scatters every micro-batch and reshards after each backward."""
    assert exposed_s(fsdp(1, accumulation=4)) == pytest.approx(4 * exposed_s(fsdp(1)))


def test_zero2_keeps_the_gathered_blocks_for_the_backward() -> None:
    """ZeRO-2 (``reshard_after_forward=False``) gathers once per micro-batch: its backward waits for no gather."""
    zero2, full = exposed_s(fsdp(1, "zero2")), exposed_s(fsdp(1))
    assert zero2 <= full - GATHER_S


def test_hsdp_all_reduces_each_block_behind_the_backward_of_the_last_micro_batch() -> None:
    """HSDP all-reduces each block's shard across the nodes as its reduce-scatter ends (on the step's last micro-batch):
    a big micro-batch's backward hides most of what a whole-model all-reduce after the backward would expose."""
    cluster = parse_hardware("8xh100-sxm").with_network(400).with_nodes(4)
    grads = LLAMA7.params_total * GRAD_REDUCE_BYTES
    across = collective_s(
        "all_reduce", grads / 8, ranks_per_node=1, nodes=4, intra=cluster.intra, inter=cluster.inter, gpus_per_node=8
    )
    hsdp = step_time(LLAMA7, Strategy(data=32, sharding="hsdp", micro_batch=16), cluster).data_parallel_comm
    assert hsdp < across / 2
