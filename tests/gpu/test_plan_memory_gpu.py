"""The plan's peak memory against ``torch.cuda.max_memory_allocated`` over steps run by redline.prepare on a real
GPU: the issue's target, at most 5% over and never more than 3% under. Skipped where there is no CUDA device;
``pytest -s`` prints each ratio for the GPU check's log."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from redline.plan.memory import memory_per_gpu
from redline.plan.strategy import Strategy
from redline.runtime.config import RunConfig
from redline.runtime.prepare import prepare
from redline.workload.load import load_workload
from redline.workload.presets import preset_profile

pytestmark = pytest.mark.gpu


def measured_peak(model, inputs: torch.Tensor, loss_of, strategy: Strategy, steps: int = 3) -> int:
    """The peak over the steps after the first (which makes the optimizer's states) of a loop run by prepare()."""
    labels = torch.zeros(len(inputs), dtype=torch.long)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(inputs, labels), batch_size=strategy.micro_batch * strategy.accumulation
    )
    torch.cuda.empty_cache()
    run = prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4), loader, plan=RunConfig(strategy=strategy))
    for index, (x, y) in enumerate(run.micro_batches()):
        if index == strategy.accumulation:  # the second step begins
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        with run.accumulate():
            run.backward(loss_of(run.model(x), x, y))
    assert run.step == steps
    return torch.cuda.max_memory_allocated()


def check(name: str, profile, model, inputs, loss_of, **strategy) -> None:
    plan = Strategy(**({"data": 1, "precision": "bf16"} | strategy))
    predicted = memory_per_gpu(profile, plan, 1).allocated
    batches = plan.micro_batch * plan.accumulation
    ratio = predicted / measured_peak(model.cuda(), inputs[: batches * 3], loss_of, plan)
    print(f"plan memory on the GPU, {name} {plan.label()}: predicted/max_memory_allocated {ratio:.3f}")
    assert 0.97 <= ratio <= 1.05, f"{name}: predicted/measured = {ratio:.3f}"


def classify(logits, _x, y):
    return F.cross_entropy(logits.float(), y)


@pytest.mark.parametrize(("micro_batch", "accumulation", "checkpointing"), [(64, 1, "none"), (32, 2, "full")])
def test_vit(micro_batch: int, accumulation: int, checkpointing: str) -> None:
    from redline.workload import zoo

    torch.manual_seed(0)
    images = torch.randn(micro_batch * accumulation * 3, 3, 224, 224)
    check(
        "vit-b-16",
        preset_profile("vit-b-16"),
        zoo.vit_b_16(),
        images,
        classify,
        micro_batch=micro_batch,
        accumulation=accumulation,
        checkpointing=checkpointing,
    )


def test_resnet50() -> None:
    from redline.workload import zoo

    torch.manual_seed(0)
    images = torch.randn(3 * 128, 3, 224, 224)
    check("resnet50", preset_profile("resnet50"), zoo.resnet50(), images, classify, micro_batch=128)


@pytest.mark.parametrize("checkpointing", ["none", "selective", "full"])
def test_gpt2_from_its_config(tmp_path: Path, checkpointing: str) -> None:
    transformers = pytest.importorskip("transformers")
    config = {"n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024, "vocab_size": 50257}
    (tmp_path / "config.json").write_text(json.dumps(config | {"model_type": "gpt2"}))
    profile = load_workload(str(tmp_path / "config.json"), seq_len=1024)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**config))
    ids = torch.randint(0, 50257, (3 * 8, 1024))

    def lm_loss(out, x, _y):  # the loss the tracer measures: cross-entropy on fp32-upcast logits
        return F.cross_entropy(out.logits.float().flatten(0, 1), x.flatten())

    check("gpt2", profile, model, ids, lm_loss, micro_batch=8, checkpointing=checkpointing)
