"""The planner's memory, step-time and search models: behaviour a user relies on, checked on presets."""

from __future__ import annotations

import dataclasses
import time

import pytest

from redline.errors import BadInput
from redline.plan.estimate import Goal, estimate, mfu_peak, model_flops_utilization
from redline.plan.hardware import catalog_cluster, parse_hardware
from redline.plan.memory import block_activation, memory_per_gpu
from redline.plan.search import Constraints, search, smallest_fitting
from redline.plan.steptime import recomputed_flops_per_sample, step_time
from redline.plan.strategy import Strategy
from redline.specs.catalog import find_gpu
from redline.units import GiB
from redline.workload.presets import preset_profile

GPT2 = preset_profile("gpt2")
LLAMA7 = preset_profile("llama-2-7b")
H100X8 = parse_hardware("8xh100-sxm")


def strategy(**fields) -> Strategy:
    return Strategy(**({"data": 8, "precision": "bf16"} | fields))


# ------------------------------------------------------------------------------------------ memory


def test_ddp_model_states_are_pytorch_fp32_params_grads_and_adam() -> None:
    memory = memory_per_gpu(LLAMA7, strategy(sharding="ddp"), gpus_per_node=8)
    params = LLAMA7.params_total
    assert memory.weights == pytest.approx(4 * params)
    assert memory.grads == pytest.approx(4 * params)
    assert memory.optimizer == pytest.approx(8 * params)
    # autocast's bf16 copies of every weight but the embedding table, a lookup autocast leaves in fp32
    shape = LLAMA7.transformer
    assert memory.weight_copies == pytest.approx(2 * (params - shape.vocab * shape.hidden))


@pytest.mark.parametrize(
    ("sharding", "sharded"),
    # ZeRO-2 as FSDP runs it (reshard_after_forward=False) shards the fp32 weights too and keeps whole 16-bit
    # copies from forward to backward: the ZeRO paper's 2 + 14/N bytes per parameter, in PyTorch's form
    [
        ("zero1", {"optimizer"}),
        ("zero2", {"optimizer", "grads", "weights"}),
        ("fsdp", {"optimizer", "grads", "weights"}),
    ],
)
def test_zero_stages_shard_what_pytorch_shards(sharding: str, sharded: set[str]) -> None:
    ddp = memory_per_gpu(LLAMA7, strategy(sharding="ddp"), gpus_per_node=8)
    zero = memory_per_gpu(LLAMA7, strategy(sharding=sharding), gpus_per_node=8)
    for part in ("weights", "grads", "optimizer"):
        expected = getattr(ddp, part) / (8 if part in sharded else 1)
        assert getattr(zero, part) == pytest.approx(expected), part
    # ZeRO-1 runs under autocast, which leaves the embedding table alone; FSDP's units cast every parameter
    table = LLAMA7.transformer.vocab * LLAMA7.transformer.hidden
    copies = {"zero1": 2 * (LLAMA7.params_total - table), "zero2": 2 * LLAMA7.params_total}
    if sharding in copies:
        assert zero.weight_copies == pytest.approx(copies[sharding])


def test_fsdp_keeps_only_two_blocks_and_the_root_unsharded() -> None:
    fsdp = memory_per_gpu(LLAMA7, strategy(sharding="fsdp"), gpus_per_node=8)
    block = LLAMA7.blocks[0].params
    root = sum(layer.params for layer in LLAMA7.layers if not layer.is_block)
    assert fsdp.weight_copies == pytest.approx(2 * (root + 2 * block))


def test_hsdp_shards_within_a_node_only() -> None:
    hsdp = memory_per_gpu(LLAMA7, strategy(data=16, sharding="hsdp"), gpus_per_node=8)
    fsdp8 = memory_per_gpu(LLAMA7, strategy(data=8, sharding="fsdp"), gpus_per_node=8)
    assert hsdp.optimizer == pytest.approx(fsdp8.optimizer)


def test_fp32_has_no_compute_copies_and_doubles_block_activations() -> None:
    fp32 = strategy(data=1, precision="fp32")
    assert memory_per_gpu(GPT2, fp32, gpus_per_node=8).weight_copies == 0
    block = GPT2.blocks[0]
    ratio = block_activation(GPT2, block, fp32, decoder=False) / block_activation(
        GPT2, block, strategy(data=1), decoder=False
    )
    # not quite 2x: dropout masks stay one byte, and autocast's norms save fp32 inputs in both
    assert 1.6 < ratio < 1.9


def test_full_checkpointing_keeps_block_inputs_only() -> None:
    none = memory_per_gpu(LLAMA7, strategy(micro_batch=4), gpus_per_node=8)
    full = memory_per_gpu(LLAMA7, strategy(micro_batch=4, checkpointing="full"), gpus_per_node=8)
    shape = LLAMA7.transformer
    # L blocks x 4 bytes (autocast keeps the residual stream in fp32) x s x h x micro-batch
    inputs = 32 * 4 * shape.seq_len * shape.hidden * 4
    head = full.activations - inputs
    assert head > 0
    assert none.activations > 7 * full.activations
    block = block_activation(LLAMA7, LLAMA7.blocks[0], strategy(micro_batch=4), decoder=False)
    # the recomputed block, its gradients and the bf16 copies of its weights its recomputation casts again
    assert full.temporary == pytest.approx(2 * block + 2 * LLAMA7.blocks[0].params)


def test_measured_working_sets_replace_what_a_block_saved() -> None:
    """A traced block's backward needs what the tracer measured on top of what it saved (without a measurement:
    all it saved, again); its forward's temporaries count while it runs."""
    from torch import nn

    from redline.workload.trace import trace_module

    class Wide(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(64, 256), nn.Linear(256, 64)

        def forward(self, x):
            return x + self.down(self.up(x).exp().sin())

    profile = trace_module(lambda: nn.Sequential(*(Wide() for _ in range(4))), (128, 64), name="wide", source="t")
    plain = strategy(data=1, precision="fp32", micro_batch=16)
    traced = memory_per_gpu(profile, plain, gpus_per_node=1)
    saved = block_activation(profile, profile.blocks[1], plain, decoder=False)
    measured = max(c + 16 * x for c, x in profile.blocks[1].backward_working["fp32"])
    assert traced.temporary == pytest.approx(measured) and measured != pytest.approx(saved)
    unmeasured = dataclasses.replace(
        profile,
        layers=tuple(dataclasses.replace(layer, forward_rise={}, backward_working={}) for layer in profile.layers),
    )
    assert memory_per_gpu(unmeasured, plain, gpus_per_node=1).temporary == pytest.approx(saved)
    # a forward far above what the blocks keep raises the peak by its excess
    rise = 100 * saved
    heavy = dataclasses.replace(
        profile,
        layers=tuple(
            dataclasses.replace(layer, forward_rise={"fp32": ((0.0, rise / 16),)}) if layer.is_block else layer
            for layer in profile.layers
        ),
    )
    assert memory_per_gpu(heavy, plain, gpus_per_node=1).allocated > traced.allocated + 0.9 * rise


def test_activations_grow_with_micro_batch_and_pipeline_in_flight() -> None:
    one = memory_per_gpu(LLAMA7, strategy(micro_batch=1), gpus_per_node=8)
    four = memory_per_gpu(LLAMA7, strategy(micro_batch=4), gpus_per_node=8)
    assert four.activations == pytest.approx(4 * one.activations)
    # 1F1B: the first of 4 stages holds 8/4 of the blocks for min(4, 16) micro-batches in flight
    piped = memory_per_gpu(LLAMA7, strategy(data=2, pipeline=4, accumulation=16), gpus_per_node=8)
    # data parallelism beside a pipeline runs under FSDP2, whose bf16 parameters keep a bf16 residual stream: each
    # block's two RMSNorms save 2 bytes a value less than the profile's figures (autocast alone's fp32 stream)
    stream = LLAMA7.tokens_per_sample * LLAMA7.transformer.hidden
    blocks = sum(layer.activation_bytes_per_sample["16bit"] - 2 * 2 * stream for layer in LLAMA7.blocks[:8])
    embedding = LLAMA7.layers[0].activation_bytes_per_sample["16bit"]
    # and two outputs of its last block (bf16), whose sends' handles the schedule still holds (the runtime frees a
    # sent output's data once the handles go; the element the dropped outputs share, 4 bytes), the gradient of one
    # received for the backward that runs; the step's inputs, all 16 micro-batches
    output = 2 * stream
    inputs = 16 * LLAMA7.layers[0].input_bytes_per_sample.get("16bit", 0.0)
    held = 2 * output + 4 + output
    assert piped.activations == pytest.approx(4 * (blocks + embedding) + held + inputs - 4 * inputs / 16)


def test_tensor_parallel_with_sequence_parallel_divides_activations() -> None:
    one = memory_per_gpu(LLAMA7, strategy(data=1), gpus_per_node=8)
    tp8 = memory_per_gpu(LLAMA7, strategy(data=1, tensor=8, sequence_parallel=True), gpus_per_node=8)
    # the blocks and the embedding's output split 8 ways; the head's not: the runtime gathers the logits whole on
    # every rank (and its input for the head's matmul)
    micro_batch = strategy(data=1).micro_batch
    head = sum(
        layer.activation_bytes_per_sample["16bit"] * micro_batch
        for layer in LLAMA7.layers
        if not layer.is_block and not layer.table_params
    )
    assert head > 0
    assert tp8.activations == pytest.approx((one.activations - head) / 8 + head)
    assert tp8.weights == pytest.approx(one.weights / 8)


def test_a_packed_bias_fsdp_keeps_whole_beside_tensor_parallelism_is_not_sharded_over_the_data_ranks() -> None:
    """Beside tensor parallelism the runtime's FSDP2 keeps GPT-2's packed c_attn bias whole on each data rank:
    its tensor-parallel share of the weights, gradients and Adam's states is not divided by the data degree."""
    bias = 3 * GPT2.transformer.hidden
    layers = [dataclasses.replace(b, replicated_beside_fsdp_params=bias) if b.is_block else b for b in GPT2.layers]
    packed = dataclasses.replace(GPT2, layers=tuple(layers))
    tp = strategy(data=4, tensor=2, sharding="fsdp")
    plain, kept = memory_per_gpu(GPT2, tp, gpus_per_node=8), memory_per_gpu(packed, tp, gpus_per_node=8)
    unsharded = len(GPT2.blocks) * bias / 2 * (1 - 1 / 4)  # each rank's half, whole instead of a quarter of it
    for part, bytes_per_param in (("weights", 4), ("grads", 4), ("optimizer", 8)):
        assert getattr(kept, part) - getattr(plain, part) == pytest.approx(bytes_per_param * unsharded), part
    # ZeRO-1 shards only the optimizer states; without tensor parallelism nothing is packed
    zero1 = strategy(data=4, tensor=2, sharding="zero1")
    assert (
        memory_per_gpu(packed, zero1, gpus_per_node=8).weights == memory_per_gpu(GPT2, zero1, gpus_per_node=8).weights
    )
    fsdp = strategy(data=4, sharding="fsdp")
    assert memory_per_gpu(packed, fsdp, gpus_per_node=8) == memory_per_gpu(GPT2, fsdp, gpus_per_node=8)


# --------------------------------------------------------------------------------------- step time


def test_step_time_parts() -> None:
    single = step_time(LLAMA7, strategy(data=1, accumulation=8), H100X8)
    assert single.data_parallel_comm == single.tensor_parallel_comm == single.bubble == 0
    ddp = step_time(LLAMA7, strategy(sharding="ddp"), H100X8)
    fsdp = step_time(LLAMA7, strategy(sharding="fsdp"), H100X8)
    assert fsdp.data_parallel_comm > ddp.data_parallel_comm > 0  # 3 passes of the parameters vs 2
    piped = step_time(LLAMA7, strategy(data=2, pipeline=4, accumulation=16), H100X8)
    per_micro_batch = piped.compute / 16
    assert piped.bubble == pytest.approx(3 * per_micro_batch)  # (p - 1) micro-batch slots
    tp = step_time(LLAMA7, strategy(data=1, tensor=8, sequence_parallel=True), H100X8)
    assert tp.tensor_parallel_comm > 0


def test_compute_scales_with_the_work() -> None:
    one = step_time(LLAMA7, strategy(micro_batch=2, accumulation=1), H100X8)
    four = step_time(LLAMA7, strategy(micro_batch=2, accumulation=4), H100X8)
    assert four.compute == pytest.approx(4 * one.compute)


def test_full_recompute_costs_one_more_forward_of_the_blocks() -> None:
    none = step_time(LLAMA7, strategy(micro_batch=4), H100X8)
    full = step_time(LLAMA7, strategy(micro_batch=4, checkpointing="full"), H100X8)
    # 4/3 of the blocks' matmuls; the memory-bound half of a forward is redone too, the head is not
    assert 1.28 < full.compute / none.compute < 1.4


def test_estimate_mfu_uses_the_dense_bf16_peak() -> None:
    goal = Goal(global_batch=64, tokens=1e9)
    result = estimate(LLAMA7, strategy(sharding="fsdp", micro_batch=1, accumulation=8), H100X8, goal)
    assert 0.2 < result.mfu < 0.75
    assert result.time_to_train_s == pytest.approx(1e9 / result.tokens_per_s)
    assert result.cost_usd is None  # no price for a bare GPU count


@pytest.mark.parametrize(
    ("flops_per_sample", "samples_per_s", "devices", "peak", "expected"),
    [
        (6e12, 16.0, 4, 100e12, 0.24),  # 96 TFLOP/s of model work over 4 x 100 TFLOP/s
        (6e12, 16.0, 1, 100e12, 0.96),
        (None, 16.0, 4, 100e12, None),  # FLOPs unknown
        (6e12, 16.0, 4, None, None),  # peak unknown (a CPU has no datasheet peak)
        (6e12, 16.0, 4, 0.0, None),  # a zero peak is none: no division by it
    ],
)
def test_model_flops_utilization(flops_per_sample, samples_per_s, devices, peak, expected) -> None:
    assert model_flops_utilization(flops_per_sample, samples_per_s, devices, peak) == pytest.approx(expected)


def test_the_plan_mfu_and_hfu_are_the_one_formula_without_and_with_recomputation() -> None:
    plan = strategy(sharding="fsdp", micro_batch=1, accumulation=8, checkpointing="full")
    result = estimate(LLAMA7, plan, H100X8, Goal(global_batch=64))
    peak = mfu_peak(H100X8, plan.precision)
    flops = LLAMA7.training_flops_per_sample
    recomputed = recomputed_flops_per_sample(LLAMA7, plan)
    assert recomputed > 0
    assert result.mfu == pytest.approx(flops * result.samples_per_s / (plan.gpus * peak))
    assert result.hfu == pytest.approx((flops + recomputed) * result.samples_per_s / (plan.gpus * peak))


# ------------------------------------------------------------------------------------------ search


def test_search_ranks_fitting_strategies_by_time() -> None:
    result = search(LLAMA7, H100X8, Goal(global_batch=64))
    times = [e.time.total for e in result.ranked]
    assert times == sorted(times)
    assert all(e.memory.device_total <= H100X8.memory_bytes for e in result.ranked)
    assert result.excluded["does not fit in GPU memory"] > 0
    assert result.closest_misfit is not None and not result.closest_misfit.fits


def test_search_excludes_impossible_layouts_with_reasons() -> None:
    # GPT-2 has 12 heads: tensor degree 8 cannot split them; a global batch of 12 cannot split over 8 ranks
    result = search(GPT2, H100X8, Goal(global_batch=12))
    reasons = set(result.excluded)
    assert "tensor degree 8 does not divide the attention heads" in reasons
    assert "global batch not divisible by the data-parallel degree" in reasons
    assert all(e.strategy.global_batch == 12 for e in result.ranked)


def test_constraints_fix_parts_of_the_strategy() -> None:
    result = search(LLAMA7, H100X8, Goal(64), Constraints(sharding="fsdp", micro_batch=2, checkpointing="full"))
    assert result.ranked
    chosen = {(e.strategy.sharding, e.strategy.micro_batch, e.strategy.checkpointing) for e in result.ranked}
    # without data parallelism (tensor x pipeline = 8) there is nothing to shard: those read "ddp dp1"
    assert chosen - {("ddp", 2, "full")} == {("fsdp", 2, "full")}
    assert all(e.strategy.data == 1 for e in result.ranked if e.strategy.sharding == "ddp")


def test_unsupported_precision_is_bad_input() -> None:
    v100 = parse_hardware("8xv100-sxm2-32gb")
    with pytest.raises(BadInput, match="no bf16 rate"):
        search(GPT2, v100, Goal(64), Constraints(precision="bf16"))


def test_70b_over_64_gpus_searches_in_seconds() -> None:
    profile = preset_profile("llama-2-70b")
    cluster = parse_hardware("8xh100-sxm").with_nodes(8)
    started = time.perf_counter()
    result = search(profile, cluster, Goal(global_batch=512))
    elapsed = time.perf_counter() - started
    assert result.ranked
    assert result.considered > 1000
    assert elapsed < 15, f"search took {elapsed:.1f} s"


@pytest.mark.slow
def test_smallest_fitting_hardware_when_nothing_fits() -> None:
    profile = preset_profile("llama-2-70b")
    t4 = catalog_cluster(find_gpu("t4"), 1, name="1xt4")
    assert not search(profile, t4, Goal(8)).ranked
    options = smallest_fitting(profile, Goal(8), Constraints())
    assert options
    for cluster, best in options:
        assert best.memory.device_total <= cluster.memory_bytes
        assert cluster.gpus * cluster.memory_bytes >= 16 * profile.params_total / 8  # at least the sharded states


def test_network_assumption_is_a_note_and_can_be_set() -> None:
    assert not H100X8.notes  # one node: the network does not matter
    assert any("assumed" in note for note in H100X8.with_nodes(2).notes)
    faster = H100X8.with_network(3200)
    assert faster.inter.busbw_bytes_per_s > H100X8.inter.busbw_bytes_per_s
    with pytest.raises(BadInput):
        H100X8.with_nodes(0)


def test_strategy_checks_its_fields() -> None:
    with pytest.raises(ValueError, match="sharding"):
        Strategy(sharding="zero4")
    with pytest.raises(ValueError, match="sequence parallelism"):
        Strategy(sequence_parallel=True)
    with pytest.raises(ValueError, match="micro_batch"):
        Strategy(micro_batch=0)
    assert Strategy.from_dict(Strategy(data=4).to_dict()) == Strategy(data=4)


def test_bigger_memory_gpu_fits_what_a_smaller_one_cannot() -> None:
    profile = LLAMA7  # 18 bytes of states per parameter: 121 GB, more than 40 GB, less than 141 GB
    a100_40 = parse_hardware("1xa100-sxm4-40gb")
    h200 = parse_hardware("1xh200-sxm")
    assert not search(profile, a100_40, Goal(8)).ranked
    assert search(profile, h200, Goal(8)).ranked[0].memory.device_total < 141 * GiB


# ------------------------------------------------------------------------------ review regressions


def test_hsdp_all_reduce_across_nodes_shares_each_nodes_network() -> None:
    from redline.plan.comm import network_share, ring_s

    cluster = parse_hardware("8xh100-sxm").with_network(400).with_nodes(4)
    hsdp = step_time(LLAMA7, Strategy(data=32, sharding="hsdp", micro_batch=1), cluster)
    grads = LLAMA7.params_total * 4
    # eight shard groups per node all-reduce their 1/8 across the 4 nodes at once, each on 1/8 of the NIC
    across = ring_s("all_reduce", grads / 8, 4, network_share(cluster.inter, 8))
    # each block's share is all-reduced as its reduce-scatter ends, beside the backward: at most the micro-batch's
    # compute hides (a whole NIC per GPU would make the all-reduce 8x shorter, all of it hidden)
    assert hsdp.data_parallel_comm >= across - hsdp.compute


def test_data_parallel_groups_never_straddle_nodes_unevenly() -> None:
    cluster = parse_hardware("8xh100-sxm").with_nodes(3)
    result = search(LLAMA7, cluster, Goal(global_batch=48), Constraints(pipeline=2))
    assert result.excluded["data-parallel groups would straddle nodes unevenly"] > 0
    for e in result.ranked:
        per_node = 8 // e.strategy.tensor
        assert e.strategy.data <= per_node or e.strategy.data % per_node == 0


def test_more_gpus_than_a_node_holds_must_be_nodes() -> None:
    with pytest.raises(BadInput, match=r"give the node and nodes, e\.g\. 8xh100-sxm nodes 8"):
        parse_hardware("64xh100-sxm")


def test_pcie_cards_ring_over_pcie_unless_bridged() -> None:
    assert "PCIe" in parse_hardware("8xa100-pcie-80gb").intra.source
    assert "NVLink" in parse_hardware("2xa100-pcie-80gb").intra.source  # one NVLink bridge joins a pair
    assert "NVLink" in parse_hardware("8xa100-sxm4-80gb").intra.source


def test_catalog_memory_is_what_a_job_can_allocate() -> None:
    assert parse_hardware("1xh100-sxm").memory_bytes < 81920 * 2**20
    assert parse_hardware("1xh100-sxm").memory_bytes >= 81400 * 2**20


def test_fixed_sharding_without_data_parallelism_is_excluded_not_ignored() -> None:
    result = search(LLAMA7, H100X8, Goal(global_batch=64), Constraints(sharding="fsdp"))
    assert result.ranked and all(e.strategy.sharding == "fsdp" for e in result.ranked)
    assert any("--sharding fsdp" in reason for reason in result.excluded)
    with pytest.raises(BadInput, match="hsdp"):
        search(LLAMA7, H100X8, Goal(global_batch=64), Constraints(sharding="hsdp"))


def test_beside_tensor_or_pipeline_parallelism_data_ranks_shard_as_the_runtime_does() -> None:
    """The runtime shards the data ranks with FSDP2 beside tensor or pipeline parallelism (DDP takes no DTensor
    parameters and no pipeline stage): the plans there are zero2 or fsdp, and a fixed ddp says why it is out."""
    ranked = search(LLAMA7, H100X8, Goal(global_batch=64), Constraints(tensor=2)).ranked
    assert ranked and {e.strategy.sharding for e in ranked if e.strategy.data > 1} <= {"zero2", "fsdp"}
    piped = search(LLAMA7, H100X8, Goal(global_batch=64), Constraints(pipeline=2)).ranked
    assert piped and {e.strategy.sharding for e in piped if e.strategy.data > 1} <= {"zero2", "fsdp"}
    refused = search(LLAMA7, H100X8, Goal(global_batch=64), Constraints(tensor=2, sharding="ddp"))
    assert not [e for e in refused.ranked if e.strategy.data > 1]
    assert "--sharding ddp needs no tensor or pipeline parallelism" in refused.excluded


def test_a_micro_batch_that_does_not_divide_is_a_reason() -> None:
    result = search(GPT2, H100X8, Goal(global_batch=64), Constraints(micro_batch=3))
    assert not result.ranked
    assert any("--micro-batch 3" in reason for reason in result.excluded)


def test_pipeline_remainder_goes_to_later_stages_and_a_tied_head_is_copied() -> None:
    from redline.plan.memory import stages

    split = stages(GPT2, 5)  # 12 blocks over 5 stages
    assert [len(s.blocks) for s in split] == [2, 2, 2, 3, 3]
    last = memory_per_gpu(GPT2, strategy(data=1, pipeline=2, accumulation=4), gpus_per_node=8)
    assert last.weights > 4 * GPT2.params_total / 2  # the last stage also holds the tied word embedding


# ------------------------------------------------------------------- ties, margins, schedules, selective


def _with(result, *, total_gib: float, step_s: float):
    """An estimate with its device total and step time set (the rest as estimated)."""
    memory = result.memory
    others = memory.device_total - memory.allocated
    time_ = dataclasses.replace(
        result.time,
        compute=step_s,
        bubble=0.0,
        data_parallel_comm=0.0,
        tensor_parallel_comm=0.0,
        pipeline_comm=0.0,
        optimizer=0.0,
    )
    return dataclasses.replace(
        result, memory=dataclasses.replace(memory, allocated=total_gib * GiB - others), time=time_
    )


def test_near_ties_in_time_go_to_the_plan_with_more_memory_headroom() -> None:
    """A plan at 79.5 of an H100's 79.6 GiB that is 0.2% faster than one at 60 GiB: within a 1% tolerance the
    one with 19.6 GiB to spare ranks first; a plan 2% slower stays behind both; without a tolerance, time alone.
    Where the fastest has a tenth of the memory to spare (70 GiB), time alone too."""
    from redline.plan.search import TIME_TOLERANCE, rank

    memory = H100X8.memory_bytes
    assert memory == pytest.approx(79.6 * GiB, rel=1e-3)
    base = estimate(LLAMA7, strategy(sharding="fsdp"), H100X8, Goal(64))
    edge = _with(base, total_gib=79.5, step_s=1.000)
    roomy = _with(base, total_gib=60.0, step_s=1.002)
    slow = _with(base, total_gib=40.0, step_s=1.020)
    assert rank([edge, slow, roomy], TIME_TOLERANCE, memory) == [roomy, edge, slow]
    assert rank([edge, slow, roomy], 0.0, memory) == [edge, roomy, slow]
    comfortable = _with(base, total_gib=70.0, step_s=1.000)
    assert rank([roomy, comfortable], TIME_TOLERANCE, memory) == [comfortable, roomy]
    assert rank([], TIME_TOLERANCE, memory) == []


def test_a_memory_margin_keeps_that_much_of_each_gpu_free() -> None:
    plain = search(LLAMA7, H100X8, Goal(64))
    margin = search(LLAMA7, H100X8, Goal(64), Constraints(memory_margin=0.25))
    limit = 0.75 * H100X8.memory_bytes
    assert all(e.memory.device_total <= limit for e in margin.ranked)
    assert any(e.memory.device_total > limit for e in plain.ranked)
    assert margin.excluded["does not fit in GPU memory"] > plain.excluded["does not fit in GPU memory"]
    with pytest.raises(ValueError, match="memory_margin must be a fraction from 0 to below 1"):
        Constraints(memory_margin=1.0)


def test_the_search_tries_selective_checkpointing_and_takes_the_users_switches() -> None:
    result = search(GPT2, H100X8, Goal(64))
    assert {e.strategy.checkpointing for e in result.ranked} == {"none", "selective", "full"}
    fixed = Constraints(tensor=4, checkpointing="selective", sequence_parallel=False, flash_attention=False)
    chosen = search(GPT2, H100X8, Goal(64), fixed).ranked
    assert chosen
    assert all(
        (e.strategy.checkpointing, e.strategy.sequence_parallel, e.strategy.flash_attention)
        == ("selective", False, False)
        for e in chosen
    )


def test_the_search_runs_pipelines_on_the_schedule_asked_for() -> None:
    interleaved = Constraints(pipeline=4, schedule="interleaved", virtual_stages=4)
    result = search(LLAMA7, H100X8, Goal(64), interleaved)
    assert result.ranked
    assert {(e.strategy.schedule, e.strategy.virtual_stages) for e in result.ranked} == {("interleaved", 4)}
    assert all(e.strategy.accumulation % 4 == 0 for e in result.ranked)
    assert result.excluded["interleaved: micro-batches per step not a multiple of the pipeline stages"] > 0
    too_deep = search(LLAMA7, H100X8, Goal(64), Constraints(pipeline=8, schedule="interleaved", virtual_stages=8))
    assert not too_deep.ranked and too_deep.excluded["fewer blocks than pipeline stages x virtual stages"] > 0
    gpipe = search(LLAMA7, H100X8, Goal(64), Constraints(schedule="gpipe"))
    assert {e.strategy.schedule for e in gpipe.ranked if e.strategy.pipeline > 1} == {"gpipe"}
    assert {e.strategy.schedule for e in gpipe.ranked if e.strategy.pipeline == 1} == {"1f1b"}
