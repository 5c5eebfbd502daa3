"""Matmul time by shape (issue 44, items 4 and 7): wave quantisation and a size ramp on a GPU from its catalog SM
count, a CPU's rate by size from its saved bench sweep, every product of a transformer layer timed by its shape.
Before, one efficiency (0.75 x 0.79) held for every matrix: predicted MFU stopped near 59%, and on a CPU every split
of the batch took the same time, so the plan picked 32 micro-batches of 1 (3x slower, measured, than one of 32)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from conftest import FIXTURES
from redline.bench import store
from redline.hw.snapshot import HostInfo, Snapshot
from redline.plan.estimate import Goal, estimate
from redline.plan.gemm import TILE_COLS, TILE_ROWS, Gemm, GemmDevice, swept_flops, wave_efficiency
from redline.plan.hardware import MATMUL_EFFICIENCY, Cluster, catalog_cluster, local_cluster, parse_hardware
from redline.plan.inputs import Target
from redline.plan.planner import plan_training
from redline.plan.steptime import gemm_at
from redline.plan.strategy import Strategy
from redline.specs.catalog import find_gpu
from redline.workload.profile import LayerGemm, TransformerShape
from redline.workload.transformer import block_forward_flops, block_gemms, transformer_profile

H100 = parse_hardware("h100-sxm")
SMS = H100.gpu.sm_count if H100.gpu else 0
# the example GPT of examples/train_gpt.py (vocabulary 512, width 128, 4 blocks of 4 heads, 64 tokens)
EXAMPLE = TransformerShape(
    layers=4, hidden=128, heads=4, ffn_hidden=512, vocab=512, seq_len=64, position_embeddings=64, dropout=False
)


def device(cluster: Cluster = H100, precision: str = "bf16") -> GemmDevice:
    return cluster.gemm_device(precision)


# ------------------------------------------------------------------------------------------- the GPU model


def test_the_catalog_knows_each_gpus_streaming_multiprocessors() -> None:
    assert (find_gpu("h100-sxm").sm_count, find_gpu("a100-sxm4-80gb").sm_count) == (132, 108)


def test_a_last_wave_partly_empty_costs_a_whole_wave() -> None:
    gpu = device()
    assert SMS == 132  # 11 x 12 tiles fill one wave
    full = Gemm(11 * TILE_ROWS, 12 * TILE_COLS, 8192)
    over = Gemm(11 * TILE_ROWS, 13 * TILE_COLS, 8192)  # 143 tiles: a second wave of 11
    two = Gemm(11 * TILE_ROWS, 12 * TILE_COLS, 8192, batch=2)  # 264 tiles: two full waves
    assert gpu.seconds(over) == pytest.approx(gpu.seconds(two))
    assert gpu.efficiency(over) < 0.6 * gpu.efficiency(full)
    assert wave_efficiency(full.m, full.n, 1, SMS) == 1.0
    # a batched product fills waves with its batch too
    assert wave_efficiency(TILE_ROWS, TILE_COLS, SMS, SMS) == 1.0


@pytest.mark.parametrize("cluster", [H100, parse_hardware("a100-sxm4-80gb")], ids=["h100", "a100"])
def test_efficiency_ramps_up_with_size(cluster: Cluster) -> None:
    gpu = device(cluster)
    # squares of about 1, 4 and 16 waves of tiles
    sides = [TILE_ROWS * math.isqrt(waves * gpu.sm_count) for waves in (1, 4, 16)]
    small = Gemm(64, 64, 64)
    rates = [gpu.efficiency(Gemm(64, 64, 64))] + [gpu.efficiency(Gemm(s, s, s)) for s in sides]
    assert rates == sorted(rates)
    # a small product takes a wave of one tile, on one SM of many, and no less than its bytes take to move
    assert gpu.seconds(small) > gpu.element_bytes * 3 * 64 * 64 / gpu.memory_bytes_per_s
    assert rates[0] < 0.05
    # a short K (an attention head's dimension) runs below a long one at the same output
    wide = TILE_ROWS * 66
    assert (
        gpu.efficiency(Gemm(wide, wide, 128))
        < gpu.efficiency(Gemm(wide, wide, 1024))
        < gpu.efficiency(Gemm(wide, wide, 8192))
    )


def test_a_skinny_product_is_bound_by_its_bytes() -> None:
    """128 tokens by a 16384-wide layer on an H100 (222 FLOP per byte at its full-wave rate): reading the weights
    takes longer than the arithmetic."""
    gpu = device()
    skinny = Gemm(128, 16384, 16384)
    moved = gpu.element_bytes * (128 * 16384 * 2 + 16384 * 16384) / gpu.memory_bytes_per_s
    assert gpu.seconds(skinny) == pytest.approx(moved)


def test_a_fused_attention_product_is_bound_by_its_waves_alone() -> None:
    gpu = device()
    scores = Gemm(4096, 4096, 128, 64)
    fused = dataclasses.replace(scores, fused=True)
    waves = wave_efficiency(4096, 4096, 64, gpu.sm_count or 1)
    assert gpu.seconds(fused) == pytest.approx(scores.flops / gpu.sustained_flops / waves)
    assert gpu.seconds(fused) < gpu.seconds(scores)


@pytest.mark.parametrize("gpu_key", ["h100-sxm", "a100-sxm4-80gb"])
def test_a_large_well_shaped_gemm_reaches_what_published_runs_reached(gpu_key: str) -> None:
    """The old single efficiency, 0.75 x 0.79 = 0.59 of the peak, held for every GEMM; a well-shaped one now runs at
    the fitted full-wave rate (MATMUL_EFFICIENCY of the datasheet peak), less only its tiles' output writes."""
    cluster = parse_hardware(gpu_key)
    gpu = device(cluster)
    big = Gemm(TILE_ROWS * gpu.sm_count, TILE_COLS * 8, 16384)  # 8 tiles per SM: eight full waves
    assert wave_efficiency(big.m, big.n, 1, gpu.sm_count) == 1.0
    share_of_peak = big.flops / gpu.seconds(big) / cluster.peak_flops["bf16"]
    assert 0.62 < share_of_peak <= MATMUL_EFFICIENCY


def test_a_wide_models_predicted_mfu_rises_above_the_old_ceiling() -> None:
    """A GEMM-heavy model (width 8192) on one A100: main predicted 0.57-0.58, capped by 0.75 x 0.79 below 0.59."""
    shape = TransformerShape(
        layers=4,
        hidden=8192,
        heads=64,
        ffn_hidden=32768,
        vocab=32768,
        seq_len=4096,
        bias=False,
        dropout=False,
        norm="rmsnorm",
        residual_bytes=2,
        tied_embeddings=False,
    )
    profile = transformer_profile(shape, name="wide", source="test")
    strategy = Strategy(micro_batch=4, accumulation=4, precision="bf16")
    mfu = estimate(profile, strategy, parse_hardware("a100-sxm4-80gb"), Goal(16)).mfu
    assert mfu is not None and mfu > 0.6


# ------------------------------------------------------------------------------------ a layer's products


@pytest.mark.parametrize(
    "shape",
    [
        EXAMPLE,
        TransformerShape(
            layers=2, hidden=512, heads=8, kv_heads=2, ffn_hidden=1376, vocab=1000, seq_len=128, gated_mlp=True
        ),
        TransformerShape(
            layers=2, hidden=512, heads=8, head_dim=32, ffn_hidden=2048, vocab=1000, seq_len=128, decoder_layers=1
        ),
    ],
    ids=["gpt", "gated-gqa", "encoder-decoder"],
)
def test_a_blocks_products_are_its_flops(shape: TransformerShape) -> None:
    for decoder in (False, True):
        gemms = block_gemms(shape, shape.seq_len, decoder=decoder)
        assert sum(g.flops_per_sample for g in gemms) == block_forward_flops(shape, shape.seq_len, decoder=decoder)
    head = transformer_profile(shape, name="m", source="test").layers[-1]
    assert sum(g.flops_per_sample for g in head.gemms) == head.forward_flops_per_sample


def test_tensor_parallelism_and_the_micro_batch_shape_each_product() -> None:
    qkv, down = LayerGemm(2048, 3 * 12288, 12288), LayerGemm(2048, 12288, 49152, tensor_split="inner")
    core = LayerGemm(2048, 2048, 128, 96, batched=True, tensor_split="count", attention_core=True)
    assert gemm_at(qkv, 2, 8) == Gemm(4096, 4608, 12288)  # column-parallel: N / t, the micro-batch's tokens as M
    assert gemm_at(down, 2, 8) == Gemm(4096, 12288, 6144)  # row-parallel: K / t
    assert gemm_at(core, 2, 8, fused=True) == Gemm(2048, 2048, 128, 24, fused=True)  # heads / t, per sample


# --------------------------------------------------------------------------------------------- the CPU


def cpu_from_fixture() -> Cluster:
    """``--hardware local`` without a GPU, with the ceilings a saved ``redline bench compute memory`` run holds: a
    fixture file of a 2-core VM's figures (fp32 from 6 GFLOP/s at 64^3 to 80 at 1024^3; bf16 emulated)."""
    run = store.load(FIXTURES / "bench-cpu-sweep.json")
    snapshot = Snapshot(host=HostInfo(hostname="cpu-box", cpu_model="Test CPU", memory_total_bytes=16 * 2**30))
    return local_cluster(snapshot, run)


def test_a_cpus_rate_by_size_comes_from_its_saved_sweep() -> None:
    gpu_less = cpu_from_fixture()
    assert gpu_less.on_cpu and gpu_less.matmul_sweep["fp32"][0] == (64, 0.006e12)
    assert gpu_less.matmul_sweep["fp32"][-1] == (1024, 0.08e12)  # the main size ends the sweep
    fp32 = gpu_less.gemm_device("fp32")
    assert fp32.seconds(Gemm(64, 64, 64)) == pytest.approx(2 * 64**3 / 0.006e12)
    assert fp32.efficiency(Gemm(64, 64, 64)) < fp32.efficiency(Gemm(512, 512, 512)) < 1.0
    assert swept_flops(fp32.sweep, 4096) == 0.08e12  # flat past the largest side measured
    between = swept_flops(fp32.sweep, math.sqrt(64 * 128))  # halfway between 64 and 128 in log(side)
    assert between == pytest.approx((0.006e12 + 0.02e12) / 2)


def test_a_cpu_plan_prefers_the_bigger_micro_batch() -> None:
    """The example GPT, 32 sequences a step, on a CPU: small products run slower per FLOP there, so one micro-batch
    of 32 beats 32 of 1 (measured 3x faster); main predicted both the same and picked mb1x32. And never bf16, which
    this CPU emulates."""
    cluster = cpu_from_fixture()
    profile = transformer_profile(EXAMPLE, name="example gpt", source="test")
    whole = estimate(profile, Strategy(micro_batch=32, accumulation=1, precision="fp32"), cluster, Goal(32))
    split = estimate(profile, Strategy(micro_batch=1, accumulation=32, precision="fp32"), cluster, Goal(32))
    assert split.time.compute > 1.5 * whole.time.compute
    best = plan_training(profile, cluster, Target(global_batch=32)).ranked[0].strategy
    assert best.micro_batch == 32 and best.precision == "fp32"


def test_a_bench_saved_without_a_sweep_still_plans_at_its_one_rate() -> None:
    run = store.load(FIXTURES / "bench-cpu-sweep.json")
    for m in run.measurements:
        m.extra.pop("sweep", None)
    snapshot = Snapshot(host=HostInfo(hostname="cpu-box", cpu_model="Test CPU", memory_total_bytes=16 * 2**30))
    fp32 = local_cluster(snapshot, run).gemm_device("fp32")
    assert fp32.sweep == ((1024, 0.08e12),)
    assert fp32.seconds(Gemm(64, 64, 64)) == pytest.approx(2 * 64**3 / 0.08e12)


def test_a_local_gpus_measured_rate_counts_per_full_wave() -> None:
    """bench compute times an 8192^3 product, whose last wave on an H100 is partly empty (64 x 64 tiles over 132
    SMs: 31.03 waves, 32 run): the full-wave rate the model multiplies by is the measured one over that share."""
    from redline.bench.model import BenchRun, Measurement
    from redline.hw.snapshot import Gpu, GpuSection

    spec = find_gpu("h100-sxm")
    h100 = Gpu(index=0, name="NVIDIA H100 80GB HBM3", memory_total_bytes=spec.memory_bytes)
    snapshot = Snapshot(gpu=GpuSection(gpus=[h100]))
    measured = Measurement(
        "compute", "matmul_bf16", 700.0, "TFLOP/s", "test", device="cuda:0", size={"m": 8192, "n": 8192, "k": 8192}
    )
    cluster = local_cluster(snapshot, BenchRun("f", {}, "2026-12-07T12:00:00+00:00", [measured]))
    filled = wave_efficiency(8192, 8192, 1, 132)
    assert cluster.matmul["bf16"].value == pytest.approx(700e12 / filled)
    assert catalog_cluster(spec, 1, name="h100").matmul["bf16"].value == pytest.approx(989.4e12 * MATMUL_EFFICIENCY)
