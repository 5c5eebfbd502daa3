"""redline.prepare() on a real GPU: bf16 and fp16 policies, torch.compile, and out-of-memory adaptation on
the real caching allocator. Skipped where there is no CUDA device."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from redline.plan.strategy import Strategy
from redline.runtime.config import NumericsConfig, RunConfig
from redline.runtime.prepare import prepare

pytestmark = pytest.mark.gpu


def mlp(width: int = 4096, depth: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)))


def train(model: nn.Module, plan: RunConfig, samples: int, width: int = 4096, **overrides):
    data = torch.utils.data.TensorDataset(torch.randn(samples, width), torch.randn(samples, width))
    loader = torch.utils.data.DataLoader(data, batch_size=plan.per_rank_batch)
    run = prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4), loader, plan=plan, **overrides)
    for x, y in run.micro_batches():
        with run.accumulate():
            run.backward(nn.functional.mse_loss(run.model(x).float(), y))
    return run


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
def test_precision_policies_train(precision: str) -> None:
    plan = RunConfig(strategy=Strategy(precision=precision, micro_batch=64, accumulation=2))
    run = train(mlp(), plan, samples=64 * 2 * 8)
    assert run.step == 8
    assert run.optimizer.param_groups[0]["fused"] is True  # AdamW left to PyTorch's default (foreach) steps fused
    record = run.metrics.records[-1]
    assert record.peak_memory_bytes and record.peak_memory_bytes > 0
    assert record.mfu_catalog is None or 0 < record.mfu_catalog < 1


def test_compile_trains_to_the_same_loss_scale() -> None:
    plan = RunConfig(strategy=Strategy(precision="bf16", micro_batch=64), numerics=NumericsConfig(compile=True))
    run = train(mlp(depth=2), plan, samples=64 * 6)
    assert run.step == 6


def test_out_of_memory_on_the_real_allocator_halves_the_micro_batch() -> None:
    """Cap the caching allocator so that 16384 rows of activations cannot fit but 8192 can: a real CUDA
    out-of-memory error, raised by the allocator, adapted to."""
    width, rows = 4096, 16384
    model = mlp(width=width, depth=4)
    states = 4 * 4 * sum(p.numel() for p in model.parameters())  # weights, grads, Adam's two moments
    batch = 2 * rows * width * 4  # x and y of the per-rank batch, on the device
    per_row = 8 * width * 4  # four Linear inputs and four GELU inputs saved per row
    cap = states + batch + per_row * rows * 0.75  # room for 8192 rows and their temporaries, not 16384
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.get_device_properties(0).total_memory)
    try:
        plan = RunConfig(strategy=Strategy(precision="fp32", micro_batch=rows, accumulation=1))
        run = train(model, plan, samples=rows * 2, width=width)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    assert run.oom_events, "expected at least one out-of-memory adaptation"
    assert run.micro_batch * run.accumulation == rows  # the per-rank batch, and so the result, unchanged
    assert run.step == 2


def test_an_evaluation_and_the_whole_model_on_the_gpu() -> None:
    """``run.evaluating()`` under a bf16 plan autocasts as the training step does, without gradients, and puts
    the training mode back; ``run.state_dict()`` is the whole model, full fp32 tensors on the CPU."""
    plan = RunConfig(strategy=Strategy(precision="bf16", micro_batch=64))
    model = mlp(width=1024, depth=2)
    run = train(model, plan, samples=64 * 4, width=1024)
    with run.evaluating() as evaluated:
        out = evaluated(torch.randn(8, 1024, device=run.device))
        assert out.dtype == torch.bfloat16 and not out.requires_grad and not evaluated.training
    assert run.model.training
    state = run.state_dict()
    for name, param in model.named_parameters():
        assert state[name].device.type == "cpu" and state[name].dtype == torch.float32
        torch.testing.assert_close(state[name], param.detach().cpu())
