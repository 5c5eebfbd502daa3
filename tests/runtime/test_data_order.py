"""The data order and the last batch as the user set them: the order follows the process's seed (or the loader's
generator, or ``data.seed``), one order on every rank, replayed on resume; the loader's ``drop_last`` kept, a
short last batch split over the ranks and weighed by its samples (issue 42, item 8)."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import order_worker
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, SequentialSampler, TensorDataset

from ranks import spawn_ranks
from redline.plan.strategy import Strategy
from redline.runtime.config import RunConfig
from redline.runtime.data import BatchShare, DistributedView, fixed_seed
from redline.runtime.feed import micro_batches
from redline.runtime.prepare import prepare

WORKER = Path(order_worker.__file__)
# fp32 over gloo: each rank's mean over its share, weighed and averaged, adds in another order than one process's
# mean over the whole batch
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def ranks(tmp_path: Path, world: int = 2, **env: str | int) -> dict:
    """``order_worker`` as ``world`` gloo ranks; rank 0's result, with ``order``: per step, the global batch
    (each rank's share interleaved, as the ranks share the order out)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / "result.pt"
    settings = {"OUT": str(out), "SAMPLES": "64", "BATCH": "16"} | {key: str(value) for key, value in env.items()}
    spawn_ranks(WORKER, world, store=tmp_path / "store", env=settings)
    result = torch.load(out)
    result["order"] = [global_batch(step) for step in zip(*(r["seen"] for r in result["ranks"]), strict=True)]
    return result


def global_batch(shares: tuple[list[int], ...]) -> list[int]:
    """A step's global batch from the ranks' shares: rank ``r`` holds its samples ``r, r + world, ...``. A rank
    that holds none of a short last batch loaded one of another rank's, which the batch counts once."""
    merged = [i for column in itertools.zip_longest(*shares) for i in column if i is not None]
    return list(dict.fromkeys(merged))


def flat(order: list[list[int]]) -> list[int]:
    return [i for batch in order for i in batch]


# ------------------------------------------------------------------------------------------ seeds


@pytest.mark.ranks
@pytest.mark.slow
def test_the_order_follows_the_process_seed_and_ranks_seeded_apart_share_one(tmp_path: Path) -> None:
    """The data seed was 0 whatever the script seeded: runs of different seeds trained on one order. Each rank
    seeds itself apart (nanoGPT's ``1337 + rank``) and still the ranks share one order per epoch."""
    first = ranks(tmp_path / "a", SEED=1, EPOCHS=2)
    again = ranks(tmp_path / "b", SEED=1, EPOCHS=2)
    other = ranks(tmp_path / "c", SEED=2, EPOCHS=2)
    assert first["order"] == again["order"] != other["order"]
    for run in (first, other):
        epochs = [flat(run["order"][:4]), flat(run["order"][4:])]  # 64 samples, a global batch of 16
        assert [sorted(epoch) for epoch in epochs] == [list(range(64))] * 2  # one order shared, none twice
        assert epochs[0] != epochs[1]


@pytest.mark.ranks
@pytest.mark.slow
def test_a_loaders_generator_decides_the_order_and_its_workers_draws(tmp_path: Path) -> None:
    """``DataLoader(generator=torch.Generator().manual_seed(k))``: the order and the workers' random draws (a
    random augmentation) follow ``k``, whatever the process's seed, as without redline; each rank's workers draw
    their own. The workers' seeds used to come from the run's seed (0) alone."""
    five = ranks(tmp_path / "a", GENERATOR=5, SEED=1, WORKERS=1)
    five_again = ranks(tmp_path / "b", GENERATOR=5, SEED=2, WORKERS=1)
    six = ranks(tmp_path / "c", GENERATOR=6, SEED=1, WORKERS=1)
    assert five["order"] == five_again["order"] != six["order"]
    noise = [[r["noise"] for r in run["ranks"]] for run in (five, five_again, six)]
    assert noise[0] == noise[1] != noise[2]
    assert noise[0][0] != noise[0][1]


def test_the_seed_the_user_fixed_is_found_where_they_fixed_it() -> None:
    """The generator of the sampler (the one ``shuffle=True`` makes gets the loader's), else the loader's, else
    the run's ``data.seed``; a DDP script's DistributedSampler its ``seed``; None: drawn from the process's."""
    data = TensorDataset(torch.arange(20))
    own = RandomSampler(data, generator=torch.Generator().manual_seed(7))
    assert fixed_seed(DataLoader(data, sampler=own, generator=torch.Generator().manual_seed(8)), 3) == 7
    assert fixed_seed(DataLoader(data, shuffle=True, generator=torch.Generator().manual_seed(8)), 3) == 8
    assert fixed_seed(DataLoader(data, sampler=RandomSampler(data), generator=torch.Generator().manual_seed(9)), 3) == 9
    assert fixed_seed(DataLoader(data, shuffle=True), 3) == 3
    assert fixed_seed(DataLoader(data, shuffle=True), None) is None
    ddp = DistributedSampler(data, num_replicas=2, rank=1, seed=11)
    assert fixed_seed(DataLoader(data, sampler=ddp), None) == 11
    # the order a view draws is its seed's
    a, b = (DistributedView(own, world=1, rank=0, seed=seed) for seed in (7, 8))
    assert list(a) != list(b)


def test_a_resumed_run_replays_the_order_its_process_seed_drew(tmp_path: Path) -> None:
    """The seed drawn at the first start is in the checkpoint: a restart that seeds the process otherwise goes
    on in the same order."""

    def start(seed: int, checkpoints: Path, stop_at: int | None = None) -> list[int]:
        torch.manual_seed(seed)
        model = nn.Linear(1, 1)
        loader = DataLoader(TensorDataset(torch.arange(48.0).unsqueeze(1)), batch_size=4, shuffle=True)
        plan = RunConfig(strategy=Strategy(micro_batch=4, precision="fp32"))
        run = prepare(
            model, torch.optim.SGD(model.parameters(), lr=0.01), loader, plan=plan, checkpoint_dir=str(checkpoints)
        )
        seen = []
        for (x,) in run.micro_batches(epochs=2):
            if run.step == stop_at:
                break
            seen += x.flatten().int().tolist()
            with run.accumulate():
                run.backward(run.model(x).sum())
        return seen

    whole = start(3, tmp_path / "whole")
    assert start(4, tmp_path / "other") != whole  # another process seed, another order
    first = start(3, tmp_path / "cut", stop_at=5)
    assert first + start(99, tmp_path / "cut") == whole


# ------------------------------------------------------------------------------------------ the last batch


def test_a_short_last_batch_is_split_over_the_ranks_and_weighed_by_its_samples() -> None:
    """767 samples in global batches of 32 on 2 ranks: 23 whole batches, then 31 samples, 16 and 15; 769: one
    sample, which rank 1 loads too and weighs 0. With drop_last the 31 are left out."""
    sampler = SequentialSampler(range(767))
    views = [DistributedView(sampler, world=2, rank=r, seed=0, per_rank_batch=16, drop_last=False) for r in (0, 1)]
    assert sorted(flat([list(view) for view in views])) == list(range(767))
    assert [view.share(0) for view in views] == [BatchShare(16, 16, 32, 2, 16)] * 2
    assert [view.share(23) for view in views] == [
        BatchShare(16, 16, 31, 2, 15, True),
        BatchShare(15, 15, 31, 2, 15, True),
    ]
    assert views[1].share(23).loss_divisor(8) == 31 / 16  # its 8 samples' mean, weighed 8 of 31 over 2 ranks

    views = [
        DistributedView(SequentialSampler(range(769)), world=2, rank=r, seed=0, per_rank_batch=16, drop_last=False)
        for r in (0, 1)
    ]
    assert [list(view)[-1] for view in views] == [768, 768] and [len(view) for view in views] == [385, 385]
    last = views[1].share(24)
    assert (last.trained, last.loaded, last.fewest) == (0, 1, 1) and math.isinf(last.loss_divisor(1))

    dropped = [DistributedView(sampler, world=2, rank=r, seed=0, per_rank_batch=16, drop_last=True) for r in (0, 1)]
    assert sorted(flat([list(view) for view in dropped])) == list(range(736))


def test_each_rank_splits_a_short_batch_into_as_many_micro_batches() -> None:
    """Each micro-batch ends in a collective: a rank holding 15 splits 8 + 7 as the one holding 16 splits 8 + 8,
    and where one rank holds 1 sample every rank takes the batch whole."""
    halves = micro_batches(torch.arange(15), parts=2, share=BatchShare(15, 15, 31, 2, 15, True))
    assert [(len(micro), divisor) for micro, divisor in halves] == [(7, 31 / 14), (8, 31 / 16)]
    whole = micro_batches(torch.arange(3), parts=2, share=BatchShare(3, 3, 4, 2, 1, True))
    assert [(len(micro), divisor) for micro, divisor in whole] == [(3, 4 / 6)]


@pytest.mark.ranks
@pytest.mark.slow
@pytest.mark.parametrize(("samples", "accumulation", "sharding"), [(767, 2, "ddp"), (769, 1, "ddp"), (767, 2, "fsdp")])
def test_an_epoch_with_drop_last_false_trains_every_sample_as_one_process(
    tmp_path: Path, samples: int, accumulation: int, sharding: str
) -> None:
    """The loader's drop_last=False was overridden: 15 of 767 samples never trained, per epoch. Now its short
    last global batch (31 samples: 16 and 15 over two ranks, each in 2 micro-batches; or 1 sample, which rank 1
    weighs 0) is the mean over its samples, under DDP and FSDP2: the weights and the step losses are one
    process's on the whole dataset (fp32)."""
    got = ranks(tmp_path, SAMPLES=samples, BATCH=32, GENERATOR=3, ACCUMULATION=accumulation, SHARDING=sharding)
    order = flat(got["order"])
    assert sorted(order) == list(range(samples))
    assert len(got["order"]) == math.ceil(samples / 32)
    want = order_worker.plain_loop(samples, order, 32)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), **TOLERANCE)
    for name, value in want["weights"].items():
        torch.testing.assert_close(got["weights"][name], value, **TOLERANCE, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.ranks
@pytest.mark.slow
def test_drop_last_true_still_drops_the_short_last_batch(tmp_path: Path) -> None:
    got = ranks(tmp_path, SAMPLES=767, BATCH=32, GENERATOR=3, DROP_LAST=1)
    order = flat(got["order"])
    assert len(got["order"]) == 23 and len(set(order)) == len(order) == 736
    want = order_worker.plain_loop(767, order, 32)
    for name, value in want["weights"].items():
        torch.testing.assert_close(got["weights"][name], value, **TOLERANCE, msg=lambda m, name=name: f"{name}: {m}")
