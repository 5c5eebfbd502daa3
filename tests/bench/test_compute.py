"""compute suite: the TFLOP/s formula, CPU runs at tiny sizes, precision selection, and the GPU-only
helpers that can be checked without a GPU (PCI matching, fp8 operands, L2 rotation)."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch

from builders import healthy_server
from conftest import run_cli
from redline.bench import compute
from redline.bench.context import BenchContext
from redline.errors import BadInput


def test_tflops_is_two_m_n_k_over_time():
    # 1000 x 3000 @ 3000 x 2000 in 0.5 s: 2*1000*2000*3000 = 1.2e10 FLOP / 0.5 s = 2.4e10 FLOP/s
    assert compute.tflops(1000, 2000, 3000, 0.5) == pytest.approx(0.024)
    assert compute.tflops(8192, 8192, 8192, 1e-3) == pytest.approx(2 * 8192**3 / 1e-3 / 1e12)


def test_cpu_run_measures_fp32_and_bf16_without_a_peak(monkeypatch):
    monkeypatch.setattr(compute, "CPU_SIZE", {True: 256, False: 256})
    monkeypatch.setattr(compute, "CPU_TIMING", {True: (0.05, 3), False: (0.05, 3)})
    seen = []
    ctx = BenchContext(quick=True, progress=lambda description, done, total: seen.append((done, total)))
    measurements = compute.run(ctx)
    assert [m.name for m in measurements] == ["matmul_fp32", "matmul_bf16"]
    for m in measurements:
        assert m.suite == "compute" and m.unit == "TFLOP/s" and m.device == "cpu"
        assert m.value > 0 and m.repeats == 3
        assert m.spread.minimum <= m.value <= m.spread.maximum
        assert m.peak is None and m.ratio is None
        assert "no catalog peak for CPUs" in m.method
        assert m.size == {"m": 256, "n": 256, "k": 256, "dtype": m.name.removeprefix("matmul_")}
        assert m.extra["threads"] >= 1
    assert seen[-1] == (2, 2)


def test_cpu_run_saves_a_sweep_of_other_squares(monkeypatch):
    """The planner reads a CPU's rate by size from it (plan.gemm): the sides of CPU_SWEEP_SIDES but the main one, by
    increasing side, each with a positive rate, up to the first whose call exceeds the main side's budget."""
    monkeypatch.setattr(compute, "CPU_SIZE", {True: 256, False: 256})
    monkeypatch.setattr(compute, "CPU_TIMING", {True: (0.01, 2), False: (0.01, 2)})
    monkeypatch.setattr(compute, "CPU_SWEEP_SAMPLE_S", 0.001)
    monkeypatch.setattr(compute, "CPU_SWEEP_SIDES", (64, 128, 256, 512))
    (fp32,) = compute.run(BenchContext(quick=True, extra={"precisions": ["fp32"]}))
    sides = [side for side, _ in fp32.extra["sweep"]]
    assert sides[:2] == [64, 128] and fp32.size["m"] == 256 not in sides
    assert all(tflops > 0 for _, tflops in fp32.extra["sweep"])
    # nothing past a side too slow for the budget
    monkeypatch.setattr(compute, "CPU_CALL_S", {True: 0.0, False: 0.0})
    (slow,) = compute.run(BenchContext(quick=True, extra={"precisions": ["fp32"]}))
    assert slow.extra["sweep"] == []
    assert "extra.sweep" in fp32.method


def test_requested_precisions_and_unsupported_ones(monkeypatch):
    monkeypatch.setattr(compute, "CPU_SIZE", {True: 128, False: 128})
    monkeypatch.setattr(compute, "CPU_TIMING", {True: (0.01, 2), False: (0.01, 2)})
    only = compute.run(BenchContext(quick=True, extra={"precisions": ["bf16"]}))
    assert [m.name for m in only] == ["matmul_bf16"]
    with pytest.raises(BadInput, match="cannot measure fp8 on cpu"):
        compute.run(BenchContext(quick=True, extra={"precisions": ["fp8"]}))
    with pytest.raises(BadInput, match="unknown precision 'fp4'"):
        compute.run(BenchContext(quick=True, extra={"precisions": ["fp4"]}))


@pytest.mark.parametrize(
    ("capability", "measured", "skipped"),
    [
        ((9, 0), ["fp32", "tf32", "fp16", "bf16", "fp8"], []),
        ((8, 9), ["fp32", "tf32", "fp16", "bf16", "fp8"], []),
        ((8, 0), ["fp32", "tf32", "fp16", "bf16"], ["fp8"]),
        ((7, 0), ["fp32", "fp16"], ["tf32", "bf16", "fp8"]),
    ],
)
def test_gpu_precisions_follow_compute_capability(capability, measured, skipped):
    chosen, left_out = compute.select_precisions(None, "cuda:0", capability)
    assert chosen == measured and list(left_out) == skipped
    for reason in left_out.values():
        assert "compute capability" in reason
    if skipped:
        with pytest.raises(BadInput, match=f"cannot measure {skipped[-1]} on cuda:0"):
            compute.select_precisions([skipped[-1]], "cuda:0", capability)


def test_fp32_precision_is_scoped_and_restored():
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        with compute.fp32_matmul_precision("tf32"):
            assert torch.get_float32_matmul_precision() == "high"
        with compute.fp32_matmul_precision("fp32"), pytest.raises(ZeroDivisionError):
            assert torch.get_float32_matmul_precision() == "highest"
            raise ZeroDivisionError
        assert torch.get_float32_matmul_precision() == "medium"
    finally:
        torch.set_float32_matmul_precision(before)


def test_fp8_operands_are_e4m3_with_b_column_major():
    # the GPU path's operand builder; torch's CPU build also implements _scaled_mm, so it runs here
    call = compute.matmul_call("fp8", 64, "cpu")
    try:
        out = call()
    except RuntimeError as exc:  # a torch without CPU fp8 GEMM: the GPU check covers it
        pytest.skip(f"no CPU _scaled_mm here: {exc}")
    assert out.shape == (64, 64) and out.dtype == torch.bfloat16


def test_operands_are_random_and_rotate_when_they_fit_in_l2():
    call = compute.matmul_call("fp32", 64, "cpu", operand_sets=2)
    first, second, third = call().clone(), call().clone(), call().clone()
    assert first.abs().sum() > 0 and not torch.equal(first, second) and torch.equal(first, third)
    l2 = 50 * 2**20
    assert compute.operand_sets_for(8192, 2, l2) == 1  # 384 MiB of operands: no rotation needed
    assert compute.operand_sets_for(1024, 2, l2) == compute.MAX_OPERAND_SETS
    assert compute.operand_sets_for(1024, 2, None) == 1


def test_gpu_found_by_pci_address_not_by_index(monkeypatch):
    ctx = BenchContext(snapshot=healthy_server(4))
    # torch's device 0 is the GPU NVML lists third (bus 0x58)
    props = types.SimpleNamespace(pci_domain_id=0, pci_bus_id=0x58, pci_device_id=0, name="NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    gpu = compute.snapshot_gpu(ctx, 0)
    assert gpu is not None and gpu.index == 2
    spec = compute.catalog_spec(ctx, 0)
    assert spec is not None and spec.peak_tflops["bf16"] > 900
    assert compute.pci_address("00000000:3B:00.0") == (0, 0x3B, 0)
    assert compute.pci_address("garbage") is None


def test_cuda_on_a_machine_without_it_is_bad_input():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(BadInput, match="cannot use CUDA"):
        compute.run(BenchContext(device="cuda"))


def test_without_torch_the_suites_say_so(monkeypatch):
    from redline.bench import dataloader, memory

    monkeypatch.setitem(sys.modules, "torch", None)  # makes `import torch` raise ImportError
    for suite in (compute, memory, dataloader):
        with pytest.raises(BadInput, match="needs PyTorch"):
            suite.run(BenchContext())


def test_agrees_with_torch_utils_benchmark(monkeypatch):
    """The short version of benchmarks/compute_vs_torch.py: the same fp32 product timed by PyTorch's own
    harness. The band catches a wrong FLOP count or timing (a factor of 2) and tolerates a busy runner."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[2] / "benchmarks"))
    from compute_vs_torch import compare

    # the best round of each side: other jobs on a 2-core host slow a round of either side at random (the medians
    # of three were seen at 0.54 beside a four-rank test, and the best of three at 2.99 while another test suite
    # started beside it), while neither side's best round can beat its true rate; five rounds, so one is quiet
    ours, peer, ratio = compare("fp32", 768, rounds=5, repeats=15, min_run_time_s=0.2, statistic=max)
    assert ours > 0 and peer > 0
    # a factor-of-2 mistake lands outside; a loaded 2-core runner has been seen at 0.6 and 1.6
    assert 0.55 < ratio < 1.8, f"redline {ours:.4f} vs torch.utils.benchmark {peer:.4f} TFLOP/s"


def test_the_cpu_side_is_sized_by_a_first_call(monkeypatch):
    """n^3 work: a precision four times slower per call at the probe side gets a side 4^(1/3) smaller."""
    monkeypatch.setattr(compute, "matmul_call", lambda precision, size, device: precision)
    per_call = {"fp32": 0.001, "bf16": 0.008}
    monkeypatch.setattr(compute, "time_calls", lambda call, warmup, repeats: [per_call[call]] * repeats)
    fast = compute.cpu_size("fp32", 0.125, 4096)  # 256 * (0.125 / 0.001)^(1/3) = 1280
    slow = compute.cpu_size("bf16", 0.125, 4096)  # 256 * (0.125 / 0.008)^(1/3) = 640
    assert (fast, slow) == (1280, 640)
    assert compute.cpu_size("fp32", 10.0, 1536) == 1536  # capped
    assert compute.cpu_size("bf16", 1e-6, 1536) == compute.CPU_MIN_SIZE  # never below the floor


@pytest.mark.slow
def test_bf16_without_bf16_units_is_sized_down_and_said_to_be_emulated(tmp_path):
    """oneDNN capped at AVX2 has no bf16 instructions, as on a CPU without AVX512-BF16 or AMX: a fixed 1536^3
    side took 26 s a call there. The side follows the first call; the report says the precision is emulated."""
    # one thread: on a loaded host two threads of a small fp32 matmul wait on each other and its rate falls
    # towards the emulated one's; the judgment is about instructions, not threads
    env = {"ONEDNN_MAX_CPU_ISA": "AVX2", "OMP_NUM_THREADS": "1", "REDLINE_HOME": str(tmp_path)}
    result = run_cli("bench", "compute", "--quick", "--json", env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    by_name = {m["name"]: m for m in json.loads(result.stdout)["measurements"]}
    fp32, bf16 = by_name["matmul_fp32"], by_name["matmul_bf16"]
    assert bf16["extra"]["emulated"] is True and bf16["extra"]["vs_fp32_ratio"] < compute.EMULATED_BELOW
    assert "emulated" not in fp32["extra"]
    # less work where each flop costs more: sized below the old fixed side, and not above fp32's (under load
    # both may sit at the floor)
    assert bf16["size"]["m"] < compute.CPU_SIZE[True] and bf16["size"]["m"] <= fp32["size"]["m"]
    # a call of the chosen side takes about the target; generous, for a loaded machine
    assert 2 * bf16["size"]["m"] ** 3 / (bf16["value"] * 1e12) < 20 * compute.CPU_CALL_S[True]

    text = run_cli("bench", "compute", "--quick", "--precision", "bf16", env=env, timeout=300)
    assert text.returncode == 0, text.stderr
    assert "bf16 is emulated on this CPU" in " ".join(text.stdout.split())
