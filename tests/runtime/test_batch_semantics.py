"""What the loader's batch means (issue 42, item 4): each rank's by default, as under DDP, Accelerate and
Lightning, or the global batch with ``loader_batch="global"``; what an optimizer step trains on said before the
first step on several ranks, and wherever a plan or a keyword changes the batch the script set; settings that
contradict each other refused in one line."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import batch_worker
import pytest
import torch
from order_worker import LR, Samples, model
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from ranks import spawn_ranks
from redline.errors import BadInput
from redline.plan.strategy import Strategy
from redline.runtime.config import DataConfig, RunConfig
from redline.runtime.feed import Feed, per_rank_batch_without_plan
from redline.runtime.prepare import prepare

WORKER = Path(batch_worker.__file__)
# fp32 over gloo: each rank's mean over its share, weighed and averaged, adds in another order than one mean
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def ranks(tmp_path: Path, **env: str) -> tuple[dict, list[str]]:
    """``batch_worker`` as 2 gloo ranks: rank 0's result and each rank's output."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / "result.pt"
    settings = {"OUT": str(out), "SAMPLES": "64", "BATCH": "4"} | env
    outputs = spawn_ranks(WORKER, 2, store=tmp_path / "store", env=settings)
    return torch.load(out), outputs


def plain_loop(batches: list[list[int]]) -> dict[str, torch.Tensor]:
    """One process without redline: a step per batch of ``batches``, the loss its mean."""
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    for x, y, _, _ in DataLoader(Samples(64), batch_sampler=batches):
        nn.functional.mse_loss(net(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {name: p.detach() for name, p in net.named_parameters()}


def assert_same_weights(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for name in got:
        torch.testing.assert_close(got[name], expected[name], **TOLERANCE)


@pytest.mark.ranks
@pytest.mark.slow
def test_a_ddp_scripts_per_rank_batch_trains_as_under_ddp(tmp_path: Path) -> None:
    """A literal port of a DDP script (a DistributedSampler, ``batch_size`` per rank) halved its global batch:
    the loader's batch was taken for the global one. Now 2 ranks of 4 train on 8 per step, as under DDP."""
    ddp, _ = ranks(tmp_path / "ddp", MODE="ddp", EPOCHS="2")
    port, outputs = ranks(tmp_path / "port", MODE="redline", EPOCHS="2")
    assert_same_weights(port["weights"], ddp["weights"])
    assert [r["steps"] for r in port["ranks"]] == [16, 16]  # 64 samples / (4 x 2 ranks), 2 epochs
    assert [r["steps_per_epoch"] for r in port["ranks"]] == [8, 8]
    said = "the loader's batch_size=4 is each rank's, as under DDP (loader_batch='per_rank'): 4 per rank x 2"
    assert outputs[0].count(said) == 1, outputs[0][-2000:]  # once, before the first step
    assert said not in outputs[1]
    assert "8 per optimizer step, 8 optimizer steps per epoch" in outputs[0]


@pytest.mark.ranks
def test_a_batch_samplers_batches_are_each_ranks_and_a_step_their_mean(tmp_path: Path) -> None:
    """Batches of a sampler of the script's own (by length, by token budget), of every size: each rank takes
    whole ones in turn (rank r the r-th of every two), the step weighs every sample alike, as one process
    stepping on the two batches together; the last one that makes no step for both ranks is left out."""
    batches = [[0, 1, 2], [3, 4, 5, 6, 7], [8], [9, 10, 11, 12], [13, 14], [15, 16, 17], [18]]
    port, _ = ranks(tmp_path, MODE="redline", BATCHES=json.dumps(batches))
    assert [r["seen"] for r in port["ranks"]] == [batches[0:6:2], batches[1:6:2]]
    assert [r["samples"] for r in port["ranks"]] == [[8, 5, 5], [8, 5, 5]]  # the step's, both ranks' batches
    expected = plain_loop([batches[0] + batches[1], batches[2] + batches[3], batches[4] + batches[5]])
    assert_same_weights(port["weights"], expected)


def _loader(batch: int) -> DataLoader:
    return DataLoader(Samples(64), batch_size=batch, shuffle=True)


def _plan(micro_batch: int, accumulation: int) -> RunConfig:
    return RunConfig(strategy=Strategy(data=1, micro_batch=micro_batch, accumulation=accumulation, precision="fp32"))


def _said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "redline.runtime" and r.levelno >= logging.WARNING]


def test_a_plan_that_changes_the_loaders_batch_says_so_and_the_steps_to_size_a_scheduler_by(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The plan's batch replaced the script's without a word, after the script had sized its LR schedule by
    its own loader: 96 steps planned, 46 run. Now the line says what a step trains on and the steps per epoch,
    and ``run.total_steps`` gives the length before the first step."""
    net = model()
    with caplog.at_level(logging.WARNING, logger="redline.runtime"):
        run = prepare(net, torch.optim.SGD(net.parameters(), lr=LR), _loader(32), plan=_plan(4, 2))
    assert _said(caplog) == [
        "the plan's batch replaces the loader's batch_size=32 (each rank's): 8 per rank x 1 rank(s) = 8 per "
        "optimizer step (micro-batch 4 x accumulation 2), 8 optimizer steps per epoch; size schedulers with "
        "run.total_steps(epochs)"
    ]
    assert (run.steps_per_epoch, run.total_steps(3)) == (8, 24)
    run.close(checkpoint=False)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="redline.runtime"):
        prepare(net, torch.optim.SGD(net.parameters(), lr=LR), _loader(8), plan=_plan(4, 2)).close(checkpoint=False)
    assert _said(caplog) == []  # the plan's batch is the loader's: nothing to say


def test_an_accumulation_keyword_that_resplits_the_plans_batch_says_so(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The script's ``accumulation=`` silently overrode the plan's micro-batch (the one the planner found to
    fit). Now it says so, naming where it came from: the script's keyword or ``redline run``'s option."""
    net = model()
    with caplog.at_level(logging.WARNING, logger="redline.runtime"):
        run = prepare(net, torch.optim.SGD(net.parameters(), lr=LR), _loader(8), plan=_plan(8, 1), accumulation=4)
    assert _said(caplog) == [
        "prepare(accumulation=...) splits the plan's per-rank batch of 8 in 4 micro-batch(es) of 2, not the "
        "plan's 1 of 8"
    ]
    assert (run.micro_batch, run.accumulation) == (2, 4)
    run.close(checkpoint=False)
    caplog.clear()
    monkeypatch.setenv("REDLINE_RUNTIME", json.dumps({"accumulation": 2}))
    with caplog.at_level(logging.WARNING, logger="redline.runtime"):
        prepare(net, torch.optim.SGD(net.parameters(), lr=LR), _loader(8), plan=_plan(8, 1)).close(checkpoint=False)
    assert _said(caplog) == [
        "--accumulation splits the plan's per-rank batch of 8 in 2 micro-batch(es) of 4, not the plan's 1 of 8"
    ]


def test_without_a_plan_one_process_says_nothing_of_the_batch(caplog: pytest.LogCaptureFixture) -> None:
    """On one process each rank's batch is the global batch: nothing to tell apart."""
    net = model()
    with caplog.at_level(logging.WARNING, logger="redline.runtime"):
        run = prepare(net, torch.optim.SGD(net.parameters(), lr=LR), _loader(16))
    assert _said(caplog) == []
    assert (run.micro_batch, run.steps_per_epoch) == (16, 4)
    run.close(checkpoint=False)


def test_a_distributed_sampler_with_a_global_loader_batch_is_refused() -> None:
    """A DistributedSampler makes the loader's batch each rank's; ``loader_batch="global"`` says the
    opposite: one of them does not hold (without a plan, where the loader's batch is read)."""
    data = Samples(64)
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, num_replicas=2, rank=0))
    with pytest.raises(BadInput, match=r"^the loader has a DistributedSampler, .* loader_batch='global' makes it"):
        per_rank_batch_without_plan(loader, "global", world=2)
    assert per_rank_batch_without_plan(loader, "per_rank", world=2) == 8


def test_a_batch_samplers_position_resumes_under_either_reading() -> None:
    """A checkpoint counts steps: of a batch sampler's batches, one per step (each split over the ranks, as
    every checkpoint before ``loader_batch`` counted them) or ``world`` per step (each one rank's). A resume
    under either reading, or after the ranks changed, goes on from the same drawn batch."""
    batches = batch_worker.GivenBatches([[i] for i in range(40)])
    loader = DataLoader(Samples(64), batch_sampler=batches)
    cpu = torch.device("cpu")

    def feed(setting: str) -> Feed:
        config = RunConfig(strategy=Strategy(data=2, micro_batch=1), data=DataConfig(loader_batch=setting))
        return Feed(loader, config, world=2, rank=0, device=cpu)

    per_rank, split = feed("per_rank"), feed("global")
    older = {"batch_in_epoch": 6, "world_size": 2}  # 6 steps of one drawn batch each
    assert (per_rank.batches_done(older), split.batches_done(older)) == (3, 6)
    mine = {"batch_in_epoch": 3, "world_size": 4, "loader_batch": "per_rank"}  # 3 steps of 4 drawn batches
    assert (per_rank.batches_done(mine), split.batches_done(mine)) == (6, 12)


def test_an_unknown_loader_batch_is_one_line() -> None:
    with pytest.raises(BadInput, match=r"^loader_batch must be one of per_rank, global, not 'per-rank'$"):
        DataConfig(loader_batch="per-rank")
