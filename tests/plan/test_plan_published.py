"""The planner's pure functions reproduce published numbers: ZeRO's model-state memory (Fig. 1, Table 2),
DeepSpeed's and accelerate's estimators, Megatron-scale throughput and training-time anchors, and the alpha-beta
cost of collectives. Each expected number names its source; none is read from disk at run time.

Tolerance is 2% unless a case says otherwise: the papers round to two or three significant figures.
"""

from __future__ import annotations

import pytest

from builders import megatron_gpt
from redline.plan.comm import Link, collective_s, p2p_s, ring_s
from redline.plan.model_states import StateBytes, max_params_that_fit, zero_state_bytes
from redline.workload.presets import TRANSFORMER_PRESETS
from redline.workload.profile import TransformerShape
from redline.workload.transformer import count_params, largest_module_params, narayanan_step_flops

TOL = 0.02
GB = 1e9
GIB = 2**30
MIB = 2**20
DAY = 86400.0

# ZeRO paper (Rajbhandari et al. 2020) mixed-precision Adam: fp16 weights (2) and gradients (2), K = 12 bytes of
# fp32 master weights, momentum and variance
ZERO_PAPER = StateBytes(weights=2, grads=2, optimizer=12)

# ------------------------------------------------------------------------------------- ZeRO paper Fig. 1

ZERO_FIG1 = [  # Psi = 7.5B, N = 64: GB per GPU of model states
    (0, 120.0),  # baseline, 16 Psi
    (1, 31.4),  # Pos, 4 Psi + K Psi / N
    (2, 16.6),  # Pos+g, 2 Psi + (2 + K) Psi / N
    (3, 1.88),  # Pos+g+p, (4 + K) Psi / N
]


@pytest.mark.parametrize(("stage", "expected_gb"), ZERO_FIG1, ids=[f"stage{s}" for s, _ in ZERO_FIG1])
def test_zero_fig1_model_state_memory(stage: int, expected_gb: float) -> None:
    got = zero_state_bytes(7.5e9, ZERO_PAPER, stage, 64) / GB
    assert got == pytest.approx(expected_gb, rel=TOL)


def test_zero_stages_are_the_papers_formulas() -> None:
    psi, n, k = 7.5e9, 64, 12
    assert zero_state_bytes(psi, ZERO_PAPER, 0, n) == pytest.approx(16 * psi, rel=1e-12)
    assert zero_state_bytes(psi, ZERO_PAPER, 1, n) == pytest.approx(4 * psi + k * psi / n, rel=1e-12)
    assert zero_state_bytes(psi, ZERO_PAPER, 2, n) == pytest.approx(2 * psi + (2 + k) * psi / n, rel=1e-12)
    assert zero_state_bytes(psi, ZERO_PAPER, 3, n) == pytest.approx((4 + k) * psi / n, rel=1e-12)
    with pytest.raises(ValueError):
        zero_state_bytes(psi, ZERO_PAPER, 4, n)


# ------------------------------------------------------------------------------------ ZeRO paper Table 2

ZERO_TABLE2 = [  # 32 GB V100, model states only: the largest model, parameters ("theory" columns)
    pytest.param(1, 64, 7.6e9, TOL, id="n64-pos"),
    pytest.param(2, 64, 14.4e9, TOL, id="n64-pos+g"),
    pytest.param(3, 64, 128e9, TOL, id="n64-pos+g+p"),
    # "~2T" in the paper; the formula gives 32e9 x 1024 / 16 = 2.048e12
    pytest.param(3, 1024, 2.05e12, 0.03, id="n1024-pos+g+p"),
]


@pytest.mark.parametrize(("stage", "dp", "expected", "tol"), ZERO_TABLE2)
def test_zero_table2_largest_model(stage: int, dp: int, expected: float, tol: float) -> None:
    assert max_params_that_fit(32e9, ZERO_PAPER, stage, dp) == pytest.approx(expected, rel=tol)


# --------------------------------------------------------------------------------- DeepSpeed estimators

# deepspeed/runtime/zero/stage_1_and_2.py estimate_zero2_model_states_mem_needs (since PR #5099):
#   "2 = params_16bit, 18 = 2_grads_16bit + 4_grads_32bit + 4_params_32bit + 8_optimizer_states_32bit"
#   gpu_mem = 2 Psi + 18 Psi / N
# i.e. under ZeRO-2 the fp16 weights stay replicated and everything else is sharded: grads 2 + 4, master 4, Adam 8.
DEEPSPEED_ZERO2 = StateBytes(weights=2, grads=2 + 4, optimizer=8, master=4)
# docs/code-docs/source/memory.rst still shows the older 4 Psi + 16 Psi / N: 2 fp16 weights and 2 fp16 grads
# replicated, 16 sharded (4 fp32 grads + 4 fp32 params + 8 Adam) -- ZeRO stage-1 accounting of these states.
DEEPSPEED_ZERO2_OLD = StateBytes(weights=2, grads=2, optimizer=8, master=4 + 4)
# deepspeed/runtime/zero/stage3.py estimate_zero3_model_states_mem_needs: gpu_mem = 4 LL + 18 Psi / N (no offload),
# 4 LL + 2 Psi / N (optimizer offloaded: only the fp16 weight shard stays), 4 LL (both offloaded). memory.rst:
# "18: 4b params, 4b grads, 4b momentum and 4b variance (fp32), +2b for fp16 params", all sharded; 4 LL is the
# largest layer gathered whole (2 fp16 params + 2 fp16 grads).
DEEPSPEED_ZERO3 = StateBytes(weights=2, grads=4, optimizer=8, master=4)
DEEPSPEED_ZERO3_OPT_OFFLOAD = StateBytes(weights=2, grads=0, optimizer=0)

T5_3B = TRANSFORMER_PRESETS["t5-3b"]
T5_3B_PSI = count_params(T5_3B)
T5_3B_LL = largest_module_params(T5_3B)
T5_LARGE_PARAMS = 737_668_096  # memory.rst: "total params: 737.67M" (test_workload_transformer counts it)
T5_LARGE_LL = 32_899_072  # memory.rst: "largest layer params: 32.90M" (32128 x 1024 shared embedding)


def test_t5_3b_counts_are_deepspeeds() -> None:
    # memory.rst: "2851M total params, 32M largest layer params" (the 32128 x 1024 embedding, 32.9M)
    assert T5_3B_PSI == 2_851_598_336
    assert T5_3B_LL == 32128 * 1024


def deepspeed_zero3_bytes(params: float, largest_layer: float, dp: int, states: StateBytes | None) -> float:
    """stage3.py: 4 LL + the sharded states (none when both are offloaded)."""
    sharded = zero_state_bytes(params, states, 3, dp) if states is not None else 0.0
    return 4 * largest_layer + sharded


def test_deepspeed_state_bytes() -> None:
    assert zero_state_bytes(1.0, DEEPSPEED_ZERO2, 2, 8) == pytest.approx(2 + 18 / 8, rel=1e-12)
    assert zero_state_bytes(1.0, DEEPSPEED_ZERO2_OLD, 1, 8) == pytest.approx(4 + 16 / 8, rel=1e-12)
    assert zero_state_bytes(1.0, DEEPSPEED_ZERO3, 3, 8) == pytest.approx(18 / 8, rel=1e-12)
    assert zero_state_bytes(1.0, DEEPSPEED_ZERO3_OPT_OFFLOAD, 3, 8) == pytest.approx(2 / 8, rel=1e-12)


# The planner reference's figures (GiB per GPU, 2%): t5-3b on 8 GPUs, t5-large (MiB) on 4
DEEPSPEED_REFERENCE = [
    pytest.param(lambda: deepspeed_zero3_bytes(T5_3B_PSI, T5_3B_LL, 8, DEEPSPEED_ZERO3) / GIB, 6.09, id="t5-3b-zero3"),
    pytest.param(lambda: zero_state_bytes(T5_3B_PSI, DEEPSPEED_ZERO2, 2, 8) / GIB, 11.28, id="t5-3b-zero2-current"),
    pytest.param(
        lambda: deepspeed_zero3_bytes(T5_LARGE_PARAMS, T5_LARGE_LL, 4, DEEPSPEED_ZERO3) / MIB, 3291, id="t5-large-zero3"
    ),
]


@pytest.mark.parametrize(("compute", "expected"), DEEPSPEED_REFERENCE)
def test_deepspeed_estimators_within_2pct(compute, expected: float) -> None:
    assert compute() == pytest.approx(expected, rel=TOL)


def gib_2f(n: float) -> str:
    """How the estimators print GPU memory: f"{gpu_mem / 2**30:.2f}GB" of an int."""
    return f"{int(n) / GIB:.2f}"


def mb_shift(n: float) -> str:
    """How memory.rst's t5-large example prints: f"{case >> 20}MB"."""
    return str(int(n) >> 20)


# memory.rst printouts, reproduced to the digit. "live" rows use the real model's counts (redline's t5-3b preset);
# "cold" rows DeepSpeed's rounded inputs total_params=2851e6, largest_layer_params=32e6.
DEEPSPEED_PRINTOUTS = [
    pytest.param(
        lambda: deepspeed_zero3_bytes(T5_3B_PSI, T5_3B_LL, 8, DEEPSPEED_ZERO3), gib_2f, "6.10", id="3b-z3-live"
    ),
    pytest.param(
        lambda: deepspeed_zero3_bytes(T5_3B_PSI, T5_3B_LL, 8, DEEPSPEED_ZERO3_OPT_OFFLOAD),
        gib_2f,
        "0.79",
        id="3b-z3-live-offload-opt",
    ),
    pytest.param(
        lambda: deepspeed_zero3_bytes(T5_3B_PSI, T5_3B_LL, 8, None), gib_2f, "0.12", id="3b-z3-live-offload-all"
    ),
    pytest.param(lambda: deepspeed_zero3_bytes(2851e6, 32e6, 8, DEEPSPEED_ZERO3), gib_2f, "6.09", id="3b-z3-cold"),
    pytest.param(
        lambda: deepspeed_zero3_bytes(2851e6, 32e6, 8, DEEPSPEED_ZERO3_OPT_OFFLOAD),
        gib_2f,
        "0.78",
        id="3b-z3-cold-offload-opt",
    ),
    pytest.param(lambda: deepspeed_zero3_bytes(2851e6, 32e6, 8, None), gib_2f, "0.12", id="3b-z3-cold-offload-all"),
    # ZeRO-2 printouts predate PR #5099 (4 Psi + 16 Psi / N); optimizer offload keeps the 2-byte weights only
    pytest.param(lambda: zero_state_bytes(T5_3B_PSI, DEEPSPEED_ZERO2_OLD, 1, 8), gib_2f, "15.93", id="3b-z2-docs-live"),
    pytest.param(lambda: zero_state_bytes(2851e6, DEEPSPEED_ZERO2_OLD, 1, 8), gib_2f, "15.93", id="3b-z2-docs-cold"),
    pytest.param(lambda: 2 * T5_3B_PSI, gib_2f, "5.31", id="3b-z2-live-offload-opt"),
    pytest.param(
        lambda: deepspeed_zero3_bytes(T5_LARGE_PARAMS, T5_LARGE_LL, 4, DEEPSPEED_ZERO3), mb_shift, "3291", id="large-z3"
    ),
    pytest.param(
        lambda: deepspeed_zero3_bytes(T5_LARGE_PARAMS, T5_LARGE_LL, 4, DEEPSPEED_ZERO3_OPT_OFFLOAD),
        mb_shift,
        "477",
        id="large-z3-offload-opt",
    ),
    pytest.param(
        lambda: deepspeed_zero3_bytes(T5_LARGE_PARAMS, T5_LARGE_LL, 4, None), mb_shift, "125", id="large-z3-all"
    ),
]


@pytest.mark.parametrize(("compute", "printed", "expected"), DEEPSPEED_PRINTOUTS)
def test_deepspeed_printouts_to_the_digit(compute, printed, expected: str) -> None:
    assert printed(compute()) == expected


# ----------------------------------------------------------------------------------- accelerate estimate

BERT_BASE = TRANSFORMER_PRESETS["bert-base"]


def test_accelerate_bert_base_cased_fp32_size() -> None:
    # huggingface/accelerate docs/source/usage_guides/model_size_estimator.md: bert-base-cased, float32 total
    # size 413.18 MB (MiB). accelerate also counts BertModel's buffers (position_ids and token_type_ids, 512
    # int64 each, 8 KiB), so parameters alone give 413.17: within 0.1%.
    assert count_params(BERT_BASE) * 4 / MIB == pytest.approx(413.18, rel=1e-3)


def test_accelerate_bert_base_cased_training_with_adam() -> None:
    # same page: "Training using Adam" 1.61 GB (GiB) in float32 = 4x the model (weights, grads, Adam m and v)
    assert 16 * count_params(BERT_BASE) / GIB == pytest.approx(1.61, rel=TOL)


# ------------------------------------------------------------------------- throughput and training time


def mt_nlg_step_flops() -> float:
    # MT-NLG 530B (Smith et al. 2022): h 20480, L 105, s 2048, V 51200, batch 1920, full recompute
    return narayanan_step_flops(1920, 2048, 105, 20480, 51200, recompute=True)


MT_NLG = [  # MT-NLG paper section 2.4 (A100 40GB): GPUs, seconds per iteration, TFLOP/s per GPU
    (2240, 60.1, 126),
    (2800, 50.2, 121),
    (3360, 44.4, 113),
]


@pytest.mark.parametrize(("gpus", "seconds", "tflops"), MT_NLG, ids=[f"{g}gpus" for g, _, _ in MT_NLG])
def test_mt_nlg_throughput_per_gpu(gpus: int, seconds: float, tflops: float) -> None:
    assert mt_nlg_step_flops() / (seconds * gpus) / 1e12 == pytest.approx(tflops, rel=TOL)


NARAYANAN_8TP = [  # Narayanan et al. 2021 section 5.1: T_train ~ 8 T P / (n X)
    pytest.param(megatron_gpt(12288, 96, 96), 300e9, 1024, 140e12, 34, id="gpt3-175b"),
    pytest.param(megatron_gpt(25600, 128, 160), 450e9, 3072, 163e12, 84, id="gpt-1t"),
]


@pytest.mark.parametrize(("shape", "tokens", "gpus", "flops_per_gpu", "days"), NARAYANAN_8TP)
def test_narayanan_training_time_rule(
    shape: TransformerShape, tokens: float, gpus: int, flops_per_gpu: float, days: float
) -> None:
    params = count_params(shape)  # 174.6B and 1008.0B (the paper's Table 1)
    assert 8 * tokens * params / (gpus * flops_per_gpu) / DAY == pytest.approx(days, rel=TOL)


NARAYANAN_TABLE2 = [  # Narayanan Table 2, PTD-P, 300B tokens, batch 1536: GPUs, TFLOP/s per GPU, days
    pytest.param(megatron_gpt(12288, 96, 96), 384, 153, 84, id="174.6b-384gpus"),
    pytest.param(megatron_gpt(12288, 96, 96), 768, 149, 43, id="174.6b-768gpus"),
    pytest.param(megatron_gpt(12288, 96, 96), 1536, 141, 23, id="174.6b-1536gpus"),
    pytest.param(megatron_gpt(20480, 105, 128), 560, 171, 156, id="529.6b-560gpus"),
    pytest.param(megatron_gpt(20480, 105, 128), 1120, 167, 80, id="529.6b-1120gpus"),
    pytest.param(megatron_gpt(20480, 105, 128), 2240, 159, 42, id="529.6b-2240gpus"),
]


@pytest.mark.parametrize(("shape", "gpus", "tflops", "days"), NARAYANAN_TABLE2)
def test_narayanan_table2_training_days(shape: TransformerShape, gpus: int, tflops: float, days: float) -> None:
    batch, s = 1536, shape.seq_len
    steps = 300e9 / (batch * s)
    step_flops = narayanan_step_flops(batch, s, shape.layers, shape.hidden, shape.vocab, recompute=True)
    got = steps * step_flops / (gpus * tflops * 1e12) / DAY
    # rel 2.5%: the paper gives whole days (23 days is +-2.2%)
    assert got == pytest.approx(days, rel=0.025)


# ------------------------------------------------------------------------------------ collectives (comm)

NVLINK = Link(busbw_bytes_per_s=300e9 * 0.65, latency_s=10e-6, source="Calculon a100_80g.json NVLink")
IB = Link(busbw_bytes_per_s=8 * 25e9 * 0.9, latency_s=20e-6, source="Calculon a100_80g.json IB, 8 NICs")
SIZES = [1e6, 256e6, 4e9]
RANKS = [2, 4, 8]


@pytest.mark.parametrize("size", SIZES, ids=[f"{s:.0e}B" for s in SIZES])
@pytest.mark.parametrize("n", RANKS, ids=[f"n{n}" for n in RANKS])
def test_ring_all_reduce_alpha_beta(n: int, size: float) -> None:
    # nccl-tests doc/PERFORMANCE.md: all-reduce busbw = algbw x 2(n-1)/n
    expected = NVLINK.latency_s + 2 * (n - 1) / n * size / NVLINK.busbw_bytes_per_s
    assert ring_s("all_reduce", size, n, NVLINK) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter"])
@pytest.mark.parametrize("n", RANKS, ids=[f"n{n}" for n in RANKS])
def test_ring_all_gather_reduce_scatter_alpha_beta(kind: str, n: int) -> None:
    # nccl-tests: all-gather and reduce-scatter busbw = algbw x (n-1)/n, S the full buffer
    size = 256e6
    expected = NVLINK.latency_s + (n - 1) / n * size / NVLINK.busbw_bytes_per_s
    assert ring_s(kind, size, n, NVLINK) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("kind", ["all_reduce", "all_gather", "reduce_scatter"])
def test_one_rank_or_empty_buffer_costs_nothing(kind: str) -> None:
    assert ring_s(kind, 1e9, 1, NVLINK) == 0.0
    assert ring_s(kind, 0, 8, NVLINK) == 0.0
    single = collective_s(kind, 1e9, ranks_per_node=1, nodes=1, intra=NVLINK, inter=None, gpus_per_node=8)
    assert single == 0.0


@pytest.mark.parametrize("kind", ["all_reduce", "all_gather", "reduce_scatter"])
def test_collective_within_one_node_is_the_ring(kind: str) -> None:
    got = collective_s(kind, 1e9, ranks_per_node=8, nodes=1, intra=NVLINK, inter=None, gpus_per_node=8)
    assert got == ring_s(kind, 1e9, 8, NVLINK)


@pytest.mark.parametrize(("kind", "factor"), [("all_reduce", 2.0), ("all_gather", 1.0), ("reduce_scatter", 1.0)])
@pytest.mark.parametrize(("ranks_per_node", "nodes"), [(8, 2), (8, 16), (4, 4)], ids=["8x2", "8x16", "4x4"])
def test_collective_across_nodes_is_hierarchical(kind: str, factor: float, ranks_per_node: int, nodes: int) -> None:
    # NVLink ring over the node's g ranks on S, then a ring over the nodes on S/g, each GPU driving 1/8 of the
    # node's network (rail-optimised: the other groups run the same collective at once)
    size, g = 1e9, ranks_per_node
    intra = NVLINK.latency_s + factor * (g - 1) / g * size / NVLINK.busbw_bytes_per_s
    inter = IB.latency_s + factor * (nodes - 1) / nodes * (size / g) / (IB.busbw_bytes_per_s / 8)
    got = collective_s(kind, size, ranks_per_node=g, nodes=nodes, intra=NVLINK, inter=IB, gpus_per_node=8)
    assert got == pytest.approx(intra + inter, rel=1e-12)


def test_hierarchical_all_reduce_moves_what_a_flat_ring_does() -> None:
    # bandwidth terms only (alpha = 0), equal link speeds: the hierarchical all-reduce over g x n ranks moves
    # 2(g-1)/g S + 2(n-1)/n S/g = 2(gn-1)/(gn) S, the flat ring's volume
    link = Link(busbw_bytes_per_s=100e9, latency_s=0.0, source="test")
    node_link = Link(busbw_bytes_per_s=8 * 100e9, latency_s=0.0, source="test: 8 GPUs' worth per node")
    size, g, n = 1e9, 8, 4
    got = collective_s("all_reduce", size, ranks_per_node=g, nodes=n, intra=link, inter=node_link, gpus_per_node=8)
    assert got == pytest.approx(ring_s("all_reduce", size, g * n, link), rel=1e-12)


def test_collective_across_nodes_needs_a_network() -> None:
    with pytest.raises(ValueError, match="inter-node link"):
        collective_s("all_reduce", 1e9, ranks_per_node=8, nodes=2, intra=NVLINK, inter=None, gpus_per_node=8)


def test_p2p_is_one_hop() -> None:
    assert p2p_s(1e9, IB) == pytest.approx(IB.latency_s + 1e9 / IB.busbw_bytes_per_s, rel=1e-12)
    assert p2p_s(0, IB) == 0.0
