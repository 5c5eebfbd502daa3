"""The runtime's in-run adjustment of the data path: an epoch whose steps mostly wait for their batches is
followed by one loading with more DataLoader workers, recorded in the step metrics; where it may not add
workers, the run says why, once."""

from __future__ import annotations

import logging
import time

import pytest
import torch
from torch import nn

from redline.plan.strategy import Strategy
from redline.runtime import feed
from redline.runtime.config import RunConfig
from redline.runtime.prepare import prepare

SAMPLES, BATCH = 40, 8  # five steps per epoch (feed.ADAPT_MIN_STEPS)


class SlowDataset(torch.utils.data.Dataset):
    """Each sample takes a sleep to load: the steps wait for their batches far longer than a tiny model
    computes, however loaded the machine is."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(0.04)
        return torch.full((4,), float(index)), torch.zeros(1)


def train(epochs: int, **settings) -> list:
    model = nn.Linear(4, 1)
    loader = torch.utils.data.DataLoader(SlowDataset(), batch_size=BATCH)
    config = RunConfig(strategy=Strategy(micro_batch=BATCH, precision="fp32"))
    run = prepare(model, torch.optim.SGD(model.parameters(), lr=0.01), loader, plan=config, **settings)
    for x, y in run.micro_batches(epochs=epochs):
        with run.accumulate():
            run.backward(nn.functional.mse_loss(run.model(x), y))
        # a loader with workers waits for a hung one only so long (loader_stall_s), added workers too
        assert run.feed.loader.timeout == (300.0 if run.feed.loader.num_workers else 0)
    return run.metrics.records


def workers_per_epoch(records: list) -> list[int]:
    steps = SAMPLES // BATCH
    return [records[start].data_workers for start in range(0, len(records), steps)]


@pytest.mark.slow
def test_a_slow_loader_gets_more_workers_epoch_by_epoch(monkeypatch, caplog) -> None:
    monkeypatch.setattr(feed, "_cpus_per_rank", lambda: 5)  # room for four workers beside the loop
    with caplog.at_level(logging.WARNING, logger="redline.runtime"):
        records = train(epochs=4)
    # none, then two, then four (the share of the CPUs), then a deeper prefetch at four
    assert workers_per_epoch(records) == [0, 2, 4, 4]
    said = [r.getMessage() for r in caplog.records if "waited for their batches" in r.getMessage()]
    assert len(said) == 3 and "loads with 2 DataLoader workers (was 0)" in said[0]
    assert "4 DataLoader workers (was 2)" in said[1] and "(was 4), 4 batches ahead each" in said[2]
    for record in records:
        assert record.loss is not None  # the same samples trained, whatever the workers


@pytest.mark.slow
@pytest.mark.parametrize(
    ("settings", "why"),
    [
        ({"num_workers": 0}, "num_workers=0 was set for this run: kept"),
        ({"adapt_workers": False}, "adapt_workers is off"),
    ],
)
def test_where_it_may_not_add_workers_the_run_says_why_once(monkeypatch, caplog, settings, why) -> None:
    monkeypatch.setattr(feed, "_cpus_per_rank", lambda: 5)
    with caplog.at_level(logging.WARNING, logger="redline.runtime"):
        records = train(epochs=3, **settings)
    assert workers_per_epoch(records) == [0, 0, 0]
    said = [r.getMessage() for r in caplog.records if "waited for their batches" in r.getMessage()]
    assert len(said) == 1 and why in said[0], said


@pytest.mark.slow
def test_at_the_cpus_share_the_loading_is_named_the_bottleneck(monkeypatch, caplog) -> None:
    monkeypatch.setattr(feed, "_cpus_per_rank", lambda: 1)  # no CPU to spare for a worker
    with caplog.at_level(logging.WARNING, logger="redline.runtime"):
        records = train(epochs=2)
    assert workers_per_epoch(records) == [0, 0]
    assert any("the loading itself is the bottleneck" in r.getMessage() for r in caplog.records)


def test_a_fast_loop_over_a_fast_loader_is_left_alone(monkeypatch) -> None:
    """Tiny steps may wait for their batches most of their time, but an epoch that waited under half a second
    in all would lose more to starting workers than it could gain."""
    monkeypatch.setattr(feed, "_cpus_per_rank", lambda: 5)
    fast = lambda self, index: (torch.full((4,), float(index)), torch.zeros(1))  # noqa: E731
    monkeypatch.setattr(SlowDataset, "__getitem__", fast)
    assert workers_per_epoch(train(epochs=3)) == [0, 0, 0]


def test_the_limit_is_a_share_of_the_time() -> None:
    from redline.errors import BadInput

    with pytest.raises(BadInput, match=r"data_wait_limit is a share of the time, between 0 and 1, not 1\.5"):
        train(epochs=1, data_wait_limit=1.5)
