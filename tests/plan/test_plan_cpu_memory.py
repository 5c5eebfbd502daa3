"""A plan for a CPU (``--hardware local`` on a machine without a GPU) counts the memory a CPU process needs: the
model states and activations, with none of a GPU's runtime (CUDA context, NCCL's buffers, cuBLAS's workspaces), and
says so in words that fit a CPU (issue 43: the example GPT's CPU plan showed 576 of its 597 MiB as CUDA context,
NCCL and cuBLAS, under a "mem/GPU" header)."""

from __future__ import annotations

import io

import pytest
from rich.console import Console
from rich.table import Table

from redline.bench import store
from redline.bench.model import BenchRun, Measurement
from redline.cli import ui
from redline.hw.snapshot import HostInfo, Snapshot
from redline.plan.estimate import Estimate, Goal, estimate
from redline.plan.hardware import Cluster, catalog_cluster, local_cluster
from redline.plan.inputs import Target
from redline.plan.memory import CUBLAS_WORKSPACE_BYTES, CUDA_CONTEXT_BYTES, FRAGMENTATION, NCCL_BUFFER_BYTES
from redline.plan.planner import plan_training
from redline.plan.strategy import Strategy
from redline.report.plan import plans_view
from redline.specs.catalog import find_gpu
from redline.units import fmt_bytes
from redline.workload.load import bare_params_profile
from tables import assert_whole

PROFILE = bare_params_profile(1e6, 64)  # `redline plan --params 1M --seq-len 64`
TARGET = Target(global_batch=32)
RAM_BYTES = 16 * 2**30


def cpu() -> Cluster:
    """``--hardware local`` on a machine without a GPU, with the ceilings ``redline bench compute memory --save``
    measured there."""
    snapshot = Snapshot(host=HostInfo(hostname="cpu-box", cpu_model="Test CPU", memory_total_bytes=RAM_BYTES))
    fingerprint, machine = store.fingerprint(snapshot)
    measured = [
        Measurement("compute", "matmul_fp32", 0.05, "TFLOP/s", "torch.matmul (test)", device="cpu"),
        Measurement("memory", "host_copy", 10.0, "GB/s", "dst.copy_(src) (test)", device="cpu"),
    ]
    return local_cluster(snapshot, BenchRun(fingerprint, machine, "2026-12-07T12:00:00+00:00", measured, quick=True))


def gpus(count: int) -> Cluster:
    return catalog_cluster(find_gpu("a100-sxm4-80gb"), count, name=f"{count}xa100-sxm4-80gb")


def one_device(strategy: str = "fp32") -> Strategy:
    return Strategy(data=1, micro_batch=4, accumulation=8, precision=strategy)


def estimated(cluster: Cluster, strategy: Strategy) -> Estimate:
    return estimate(PROFILE, strategy, cluster, Goal(global_batch=strategy.global_batch))


def test_a_cpu_plan_counts_no_cuda_context_nccl_or_cublas() -> None:
    cluster = cpu()
    strategy = one_device()
    on_cpu, on_gpu = estimated(cluster, strategy).memory, estimated(gpus(1), strategy).memory
    assert on_cpu.cuda_context == on_cpu.nccl == on_cpu.workspaces == 0
    # the same tensors as on a GPU, less cuBLAS's workspaces; the allocator's margin on top, nothing else
    assert on_cpu.allocated == pytest.approx(on_gpu.allocated - CUBLAS_WORKSPACE_BYTES)
    assert on_cpu.device_total == pytest.approx(on_cpu.allocated * (1 + FRAGMENTATION))
    held = on_cpu.weights + on_cpu.grads + on_cpu.optimizer + on_cpu.activations
    assert held <= on_cpu.allocated <= held + on_cpu.temporary + on_cpu.table_grads
    # the plans the search ranks are counted the same way
    assert all(
        e.memory.cuda_context == e.memory.workspaces == 0 for e in plan_training(PROFILE, cluster, TARGET).ranked
    )


def test_a_gpu_plan_keeps_its_runtime() -> None:
    one = estimated(gpus(1), one_device()).memory
    assert (one.cuda_context, one.nccl, one.workspaces) == (CUDA_CONTEXT_BYTES, 0, CUBLAS_WORKSPACE_BYTES)
    eight = estimated(gpus(8), Strategy(data=8, micro_batch=4, accumulation=1, precision="bf16")).memory
    assert (eight.cuda_context, eight.nccl, eight.workspaces) == (
        CUDA_CONTEXT_BYTES,
        NCCL_BUFFER_BYTES,
        CUBLAS_WORKSPACE_BYTES,
    )


def shown(cluster: Cluster, width: int = 80) -> str:
    """What `redline plan` prints of the plans for ``cluster``, at ``width`` columns."""
    out = io.StringIO()
    console = Console(file=out, width=width, color_system=None)
    for part in plans_view(plan_training(PROFILE, cluster, TARGET), []):
        if isinstance(part, Table):
            ui.print_table(part, out=console)
        else:
            console.print(part)
    return out.getvalue()


def test_a_cpu_plan_says_process_and_ram() -> None:
    text = shown(cpu())
    ram = f"of {fmt_bytes(RAM_BYTES)} RAM"
    assert_whole(text, "mem/process", ram, "Test CPU, this machine's CPU (16.0 GiB RAM)", width=80)
    for gpu_word in ("mem/GPU", "GPU-GPU", "CUDA context", "NCCL", "cuBLAS", "max_memory_allocated", " x Test CPU"):
        assert gpu_word not in text


def test_a_gpu_plan_reads_as_before() -> None:
    text = shown(gpus(8))
    assert_whole(text, "mem/GPU", "GPU-GPU", "CUDA context + NCCL", "cuBLAS workspaces", width=80)
    assert_whole(text, "8 x NVIDIA A100", "torch max_memory_allocated", width=80)
    assert "RAM" not in text and "mem/process" not in text
