"""An optimizer of several parameter groups under every sharding: the common weight-decay/no-decay split (by
parameter name, as Hugging Face Accelerate's example makes it), given ready or made by a factory from
``params.named``, trains on two gloo ranks (fp32) to the weights of the same optimizer without redline in one
process (``start_worker.TOLERANCE``), each group's settings kept."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import start_worker
import torch

from redline.plan.strategy import Strategy
from redline.runtime.config import RunConfig
from redline.runtime.parallelize import ReadyOptimizer, Trainable, build_optimizer, build_scheduler, trainable
from redline.runtime.prepare import prepare

MLP = {"data": 2, "micro_batch": 4, "accumulation": 2}  # a global batch of 16, 4 steps


def expected_groups(kind: str) -> list[dict]:
    """Each group's weight decay, learning rate and elements, as one process's optimizer has them."""
    model = start_worker.build(kind, start_worker.SEED)
    groups = start_worker.decay_groups(model.named_parameters())
    return [
        {"weight_decay": g["weight_decay"], "lr": start_worker.LR, "elements": sum(p.numel() for p in g["params"])}
        for g in groups
    ]


@pytest.mark.ranks
@pytest.mark.parametrize("optimizer", ["ready", "factory"])
@pytest.mark.parametrize("sharding", ["fsdp", "zero1"])
def test_a_weight_decay_split_adamw_trains_as_one_process(tmp_path: Path, sharding: str, optimizer: str) -> None:
    """FSDP2 replaces the parameters with DTensor ones: a ready optimizer's groups are rebuilt over them by
    module path; ZeRO-1 shares each group's state out over the ranks."""
    strategy = MLP | {"sharding": sharding}
    weights, _ = start_worker.two_ranks(tmp_path, "mlp", strategy, OPTIMIZER=optimizer, SEEDS="alike")
    start_worker.assert_same(weights, start_worker.reference("mlp", "adamw", 16), "mlp")
    assert json.loads((tmp_path / "w.groups.json").read_text()) == expected_groups("mlp")


@pytest.mark.ranks
@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy", [{"tensor": 2, "micro_batch": 8}, {"pipeline": 2, "micro_batch": 2, "accumulation": 4}]
)
def test_a_ready_weight_decay_split_adamw_trains_as_one_process_beside_tensor_or_pipeline_parallelism(
    tmp_path: Path, strategy: dict
) -> None:
    """Tensor parallelism replaces the parameters with DTensor ones; a pipeline rank holds its stages' only."""
    weights, _ = start_worker.two_ranks(tmp_path, "gpt", strategy, OPTIMIZER="ready", SEEDS="alike")
    start_worker.assert_same(weights, start_worker.reference("gpt", "adamw", 8), "gpt")


def test_a_ready_optimizers_groups_are_rebuilt_by_module_path_with_the_settings_they_have_now() -> None:
    model = start_worker.build("mlp", 0)
    optimizer = torch.optim.AdamW(start_worker.decay_groups(model.named_parameters()), lr=0.01)
    optimizer.param_groups[1]["lr"] = 0.02  # changed since construction, as a scheduler or the user may
    ready = ReadyOptimizer.of(optimizer, model)
    replaced = copy.deepcopy(model)  # new parameter objects at the same paths, as FSDP2 makes them
    rebuilt = ready.rebuild(trainable(replaced))
    assert [(g["weight_decay"], g["lr"]) for g in rebuilt.param_groups] == [(0.5, 0.01), (0.0, 0.02)]
    by_path = dict(replaced.named_parameters())
    paths = [["fc_in.weight", "fc_out.weight"], ["fc_in.bias", "norm.weight", "norm.bias", "fc_out.bias"]]
    assert [[id(p) for p in g["params"]] for g in rebuilt.param_groups] == [[id(by_path[p]) for p in g] for g in paths]
    # a pipeline rank holding the norm alone: both groups are there, the decayed one empty, so that a
    # scheduler's per-group settings still line up
    held = Trainable([(path, p) for path, p in replaced.named_parameters() if path.startswith("norm.")])
    assert [len(g["params"]) for g in ready.rebuild(held).param_groups] == [0, 2]


def test_a_factory_receives_the_parameters_with_their_module_paths() -> None:
    model = start_worker.build("mlp", 0)
    received: list[Trainable] = []

    def factory(params: Trainable) -> torch.optim.Optimizer:
        received.append(params)
        return torch.optim.AdamW(start_worker.decay_groups(params.named), lr=start_worker.LR)

    loader = torch.utils.data.DataLoader(start_worker.dataset("mlp"), batch_size=16)
    plan = RunConfig(strategy=Strategy(micro_batch=16, precision="fp32"))
    run = prepare(model, factory, loader, plan=plan)
    assert [path for path, _ in received[0].named] == [path for path, _ in model.named_parameters()]
    assert [id(p) for p in received[0]] == [id(p) for p in model.parameters()]
    assert [len(g["params"]) for g in run.optimizer.param_groups] == [2, 4]


def test_a_ready_optimizer_without_state_is_kept_and_pointed_at_the_sharded_parameters() -> None:
    """Under FSDP2 (tensor, pipeline parallelism) the script's own optimizer object goes on, its groups holding
    the new parameters at the same paths, each setting as it is now: a scheduler made on it before
    ``prepare()`` (StepLR over epochs, as PyTorch's examples make it) still drives the optimizer that steps."""
    model = start_worker.build("mlp", 0)
    named = list(model.named_parameters())
    plain = [(name, p) for name, p in named if name.endswith("bias") or "norm" in name]
    decayed = [(name, p) for name, p in named if not (name.endswith("bias") or "norm" in name)]
    optimizer = torch.optim.AdamW([{"params": decayed, "weight_decay": 0.5}, {"params": plain}], lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    ready = ReadyOptimizer.of(optimizer, model)
    replaced = copy.deepcopy(model)  # new parameter objects at the same paths, as FSDP2 makes them
    assert build_optimizer(replaced, ready, world=2, sharding="fsdp") is optimizer
    by_path = dict(replaced.named_parameters())
    assert [[id(by_path[n]) for n in g["param_names"]] for g in optimizer.param_groups] == [
        [id(p) for p in g["params"]] for g in optimizer.param_groups
    ]
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == {id(p) for p in replaced.parameters()}
    assert build_scheduler(scheduler, optimizer) is scheduler
    optimizer.step()  # no gradients yet: nothing moves, but the scheduler sees its optimizer step
    scheduler.step()
    assert [g["lr"] for g in optimizer.param_groups] == [0.005, 0.005]


def test_a_ready_optimizer_with_state_is_rebuilt() -> None:
    """Its state is keyed by the tensors it held: a new one is made over the new parameters."""
    model = start_worker.build("mlp", 0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(start_worker.dataset("mlp")[0:2][0]).sum().backward()
    optimizer.step()
    replaced = copy.deepcopy(model)
    built = build_optimizer(replaced, ReadyOptimizer.of(optimizer, model), world=2, sharding="fsdp")
    assert built is not optimizer and {id(p) for p in built.param_groups[0]["params"]} == {
        id(p) for p in replaced.parameters()
    }


def test_a_zero_redundancy_optimizer_is_not_repointed(tmp_path: Path) -> None:
    """ZeroRedundancyOptimizer steps lists of its own beside its groups: re-pointed, it would step the old,
    unsharded tensors and leave the model as it was."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = start_worker.build("mlp", 0)
        zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
        assert not ReadyOptimizer.of(zero, model).repointable()
        assert ReadyOptimizer.of(torch.optim.SGD(model.parameters(), lr=0.1), model).repointable()
    finally:
        torch.distributed.destroy_process_group()
