"""The user's DataLoader kept: its settings, its sampler (any), an IterableDataset, any batch shape."""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import multiprocessing
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, SequentialSampler, TensorDataset, WeightedRandomSampler

from ranks import spawn_ranks
from redline.errors import BadInput
from redline.plan.strategy import Strategy
from redline.runtime.batch import split, to_device
from redline.runtime.config import RunConfig
from redline.runtime.data import DistributedView, distributed_loader, fixed_seed, set_position
from redline.runtime.prepare import prepare


def config(micro_batch: int, accumulation: int = 1) -> RunConfig:
    return RunConfig(strategy=Strategy(micro_batch=micro_batch, accumulation=accumulation, precision="fp32"))


def _init_worker(worker_id: int) -> None:
    torch.manual_seed(1000 + worker_id)


def _collate(samples, scale):
    return torch.stack([s[0] for s in samples]) * scale


# ------------------------------------------------------------------------------------------ settings


def test_every_setting_of_the_users_loader_is_kept() -> None:
    """A rebuilt loader used to drop timeout, worker_init_fn, multiprocessing_context, generator, drop_last and
    a collate_fn's options: each changes what training sees. The generator's seed seeds the order and the
    workers (test_data_order.py); the generator itself is left as it is."""
    generator = torch.Generator().manual_seed(5)
    collate = functools.partial(_collate, scale=3.0)
    loader = DataLoader(
        TensorDataset(torch.arange(32.0).reshape(16, 2)),
        batch_size=4,
        num_workers=2,
        collate_fn=collate,
        timeout=7.5,
        worker_init_fn=_init_worker,
        multiprocessing_context=multiprocessing.get_context("spawn"),
        generator=generator,
        prefetch_factor=3,
        persistent_workers=True,
        in_order=False,
    )
    rebuilt = distributed_loader(loader, world=2, rank=1, per_rank_batch=2, seed=0, overrides={})
    assert rebuilt.collate_fn is collate and rebuilt.worker_init_fn is _init_worker
    assert rebuilt.timeout == 7.5 and fixed_seed(loader, None) == 5
    assert rebuilt.multiprocessing_context is loader.multiprocessing_context
    assert (rebuilt.num_workers, rebuilt.prefetch_factor, rebuilt.persistent_workers) == (2, 3, True)
    assert rebuilt.in_order is False
    assert rebuilt.batch_size == 2 and not rebuilt.drop_last
    set_position(rebuilt, epoch=1, batches_done=0, seed=5, rank=1)
    assert rebuilt.generator.initial_seed() == 5 + 1_000_003 + 1 and generator.initial_seed() == 5
    # the run's config wins where it sets a value
    tuned = distributed_loader(loader, world=1, rank=0, per_rank_batch=4, seed=0, overrides={"num_workers": 0})
    assert tuned.num_workers == 0 and tuned.timeout == 7.5 and tuned.collate_fn is collate


class ByLength(torch.utils.data.Sampler):
    """A user's batch sampler of the kind that buckets by length: batches of 2 to 9 samples (of an even number
    with ``even``), drawn in a random order from its own generator."""

    def __init__(self, n: int, generator: torch.Generator | None = None, even: bool = False) -> None:
        self.n = n
        self.generator = generator
        self.even = even

    def __iter__(self):
        order = torch.randperm(self.n, generator=self.generator).tolist()
        if self.even:
            sizes = (torch.randint(1, 5, (self.n,), generator=self.generator) * 2).tolist()
        else:
            sizes = torch.randint(2, 10, (self.n,), generator=self.generator).tolist()
        start = 0
        for size in sizes:
            if start >= self.n:
                return
            yield order[start : start + size]
            start += size


def test_a_batch_sampler_of_the_users_own_keeps_its_batches_split_over_the_ranks() -> None:
    data = TensorDataset(torch.arange(60))
    loader = DataLoader(data, batch_sampler=ByLength(60, torch.Generator().manual_seed(3)))
    ranks = [distributed_loader(loader, world=2, rank=r, per_rank_batch=1, seed=0, overrides={}) for r in range(2)]
    (alone,) = [distributed_loader(loader, world=1, rank=0, per_rank_batch=1, seed=0, overrides={})]
    whole = [b[0].tolist() for b in alone]
    assert len({len(b) for b in whole}) > 2  # the sizes vary
    pairs = list(zip(*([b[0].tolist() for b in rank] for rank in ranks), strict=True))
    shared = [batch for batch in whole if len(batch) >= 2]
    assert len(pairs) == len(shared)
    for (mine, theirs), batch in zip(pairs, shared, strict=True):
        assert mine == batch[0 : len(batch) // 2 * 2 : 2] and theirs == batch[1 : len(batch) // 2 * 2 : 2]
    assert ranks[0].batch_sampler.sizes == [len(b) for b, _ in pairs]
    # resumed two batches in, the epoch goes on from the third
    set_position(ranks[0], epoch=0, batches_done=2, seed=0, rank=0)
    assert [b[0].tolist() for b in ranks[0]] == [mine for mine, _ in pairs[2:]]
    # the user's generator is where it was: the draws used one seeded per epoch
    assert loader.batch_sampler.generator.initial_seed() == 3


def test_torchs_batch_sampler_is_its_sampler_and_batch_size() -> None:
    sampler = torch.utils.data.BatchSampler(SequentialSampler(range(12)), batch_size=6, drop_last=False)
    loader = DataLoader(TensorDataset(torch.arange(12)), batch_sampler=sampler)
    rebuilt = distributed_loader(loader, world=2, rank=1, per_rank_batch=3, seed=0, overrides={})
    assert [b[0].tolist() for b in rebuilt] == [[1, 3, 5], [7, 9, 11]]


# ------------------------------------------------------------------------------------------ samplers


def shares(sampler, world: int, epoch: int = 0) -> list[list[int]]:
    views = [DistributedView(sampler, world=world, rank=r, seed=0) for r in range(world)]
    for view in views:
        view.set_epoch(epoch)
    assert len({view.fingerprint() for view in views}) == 1
    return [list(view) for view in views]


def test_a_weighted_sampler_keeps_its_weights_over_the_ranks() -> None:
    """The old DistributedSampler replaced it: items of weight 0 were drawn 32 times of 64."""
    weights = torch.tensor([0.0, 1.0, 0.0, 3.0] * 16)  # 64 items: half never drawn, odd ones 1:3
    sampler = WeightedRandomSampler(weights, num_samples=4000, replacement=True)
    rank0, rank1 = shares(sampler, world=2)
    drawn = collections.Counter(rank0 + rank1)
    assert len(rank0) == len(rank1) == 2000
    assert all(weights[i] > 0 for i in drawn)  # no item of weight 0, on either rank
    light = sum(n for i, n in drawn.items() if weights[i] == 1.0)
    assert 0.2 < light / 4000 < 0.3  # 1/4 expected; binomial sd 0.007
    # the ranks together see what one process sees, in its order: rank r takes every 2nd from r
    (alone,) = shares(sampler, world=1)
    assert alone[0::2] == rank0 and alone[1::2] == rank1


def test_the_order_is_fixed_per_epoch_and_changes_between_epochs() -> None:
    sampler = torch.utils.data.RandomSampler(range(50))
    first, again, other = shares(sampler, 2, epoch=0), shares(sampler, 2, epoch=0), shares(sampler, 2, epoch=1)
    assert first == again != other
    assert sorted(first[0] + first[1]) == list(range(50))  # 25 each, none twice


def test_ranks_that_draw_different_orders_are_told(monkeypatch) -> None:
    class Unseeded(SequentialSampler):  # no generator, no set_epoch: deterministic or not, redline cannot say
        def __iter__(self):
            return iter(torch.randperm(len(self.data_source)).tolist())

    views = [DistributedView(Unseeded(range(100)), world=2, rank=r, seed=0) for r in range(2)]
    assert views[0].fingerprint() != views[1].fingerprint()


def test_a_resumed_epoch_skips_what_was_trained() -> None:
    loader = DataLoader(TensorDataset(torch.arange(40)), batch_size=4, shuffle=True)
    rebuilt = distributed_loader(loader, world=2, rank=0, per_rank_batch=4, seed=0, overrides={})
    set_position(rebuilt, epoch=3, batches_done=0, seed=0, rank=0)
    whole = [b[0].tolist() for b in rebuilt]
    set_position(rebuilt, epoch=3, batches_done=2, seed=0, rank=0)
    assert [b[0].tolist() for b in rebuilt] == whole[2:]


# ------------------------------------------------------------------------------------------ streams


class Stream(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(torch.arange(self.n, dtype=torch.float32).unsqueeze(1))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_is_shared_over_ranks_and_workers_without_overlap(workers: int) -> None:
    loader = DataLoader(Stream(48), batch_size=3, num_workers=workers)
    seen = []
    for rank in range(2):
        rebuilt = distributed_loader(loader, world=2, rank=rank, per_rank_batch=3, seed=0, overrides={})
        set_position(rebuilt, epoch=0, batches_done=0, seed=0, rank=rank)
        seen += [v for b in rebuilt for v in b.flatten().int().tolist()]
    assert sorted(seen) == list(range(48))


def test_a_resumed_stream_skips_what_was_trained() -> None:
    loader = DataLoader(Stream(60), batch_size=2, num_workers=2)
    rebuilt = distributed_loader(loader, world=2, rank=1, per_rank_batch=2, seed=0, overrides={})
    set_position(rebuilt, epoch=0, batches_done=0, seed=0, rank=1)
    whole = [b.flatten().tolist() for b in rebuilt]
    set_position(rebuilt, epoch=0, batches_done=3, seed=0, rank=1)
    assert [b.flatten().tolist() for b in rebuilt] == whole[3:]


def test_an_iterable_dataset_trains_through_prepare() -> None:
    """It used to fail with a raw TypeError (no len())."""
    model = nn.Linear(1, 1)
    run = prepare(
        model, torch.optim.SGD(model.parameters(), lr=0.01), DataLoader(Stream(32), batch_size=8), plan=config(4, 2)
    )
    micros = 0
    for x in run.micro_batches():
        with run.accumulate():
            run.backward(model(x).pow(2).mean())
        micros += 1
    assert micros == 8 and run.step == 4  # 4 batches of 2 micro-batches, a step after each batch


# ------------------------------------------------------------------------------------------ batches


@dataclasses.dataclass
class Pair:
    x: torch.Tensor
    names: list[str]
    temperature: float = 1.0


def test_every_field_with_a_batch_dimension_is_split() -> None:
    from transformers import BatchEncoding

    batch = {
        "enc": BatchEncoding({"input_ids": torch.arange(16).reshape(8, 2), "attention_mask": torch.ones(8, 2)}),
        "text": [f"s{i}" for i in range(8)],
        "pair": Pair(torch.arange(8), [f"n{i}" for i in range(8)]),
        "shared": torch.ones(1, 5),  # one row for every sample: goes to each micro-batch whole
        "scale": torch.tensor(2.0),
        "tag": "train",
    }
    parts = split(batch, 2, 8)
    assert type(parts[0]["enc"]) is BatchEncoding
    assert parts[1]["enc"]["input_ids"].tolist() == [[8, 9], [10, 11], [12, 13], [14, 15]]
    assert parts[1]["text"] == ["s4", "s5", "s6", "s7"]
    assert parts[0]["pair"].names == ["n0", "n1", "n2", "n3"] and parts[0]["pair"].x.tolist() == [0, 1, 2, 3]
    assert parts[0]["pair"].temperature == 1.0
    assert parts[0]["shared"].shape == (1, 5) and parts[0]["scale"].item() == 2.0 and parts[0]["tag"] == "train"
    moved = to_device(parts[0], torch.device("meta"))
    assert moved["enc"]["input_ids"].device.type == "meta" and moved["text"] == ["s0", "s1", "s2", "s3"]
    assert type(moved["enc"]) is BatchEncoding and isinstance(moved["pair"], Pair)


def test_a_batch_that_does_not_divide_is_refused() -> None:
    with pytest.raises(BadInput, match="6 samples does not split into 4"):
        split((torch.zeros(6, 1), torch.zeros(6)), 4, 6)
    with pytest.raises(BadInput, match="no field of the dict batch has 4 entries"):
        split({"a": 1.0, "b": torch.zeros(3)}, 2, 4)


def test_per_sample_lists_are_split_by_sample() -> None:
    """Detection collators give a tuple of per-sample images of their own sizes: the batch size is not any
    tensor's first dimension (3, the channels), and each micro-batch must get its own samples."""
    images = tuple(torch.zeros(3, 8 + i, 8) for i in range(4))
    targets = [{"boxes": torch.zeros(i + 1, 4)} for i in range(4)]
    first, second = split((images, targets), 2, 4)
    assert [t.shape[1] for t in second[0]] == [10, 11] and second[1] == targets[2:]
    assert len(first[0]) == len(first[1]) == 2


def test_a_hugging_face_batch_is_split_into_micro_batches() -> None:
    """A BatchEncoding was neither split (each micro-batch had all 16 samples: 2x compute) nor moved."""
    from transformers import BatchEncoding

    class Encoded(torch.utils.data.Dataset):
        def __len__(self):
            return 16

        def __getitem__(self, i):
            return {"input_ids": torch.full((3,), i)}

    def collate(samples):
        return BatchEncoding({"input_ids": torch.stack([s["input_ids"] for s in samples])})

    model = nn.Embedding(16, 2)
    loader = DataLoader(Encoded(), batch_size=8, collate_fn=collate)
    run = prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), loader, plan=config(4, 2))
    sizes = []
    for micro in run.micro_batches():
        sizes.append(micro["input_ids"].shape[0])
        with run.accumulate():
            run.backward(model(micro["input_ids"]).sum())
    assert sizes == [4] * 4


# ------------------------------------------------------------------------------- two ranks, real loops

VOCAB = 40


def gpt2_loop() -> dict:
    """A Hugging Face GPT-2 (from a config, no dropout) on token ids, batched by DataCollatorForLanguageModeling
    and drawn by a WeightedRandomSampler that never draws half the items; no plan: the loader's batch of 8 is
    the global batch. Returns the trained weights and the reported losses."""
    import transformers
    from tokenizers import Tokenizer, models

    vocab = {"[PAD]": 0, "[UNK]": 1} | {f"w{i}": i for i in range(2, VOCAB)}
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")), pad_token="[PAD]", unk_token="[UNK]"
    )
    collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)
    ids = torch.randint(2, VOCAB, (32, 12), generator=torch.Generator().manual_seed(4))
    samples = [{"input_ids": row.tolist()} for row in ids]
    weights = torch.tensor([1.0, 0.0] * 16)
    sampler = WeightedRandomSampler(weights, num_samples=32, generator=torch.Generator().manual_seed(9))
    loader = DataLoader(samples, batch_size=8, sampler=sampler, collate_fn=collator)
    torch.manual_seed(0)
    settings = {"n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 16, "vocab_size": VOCAB}
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            **settings, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=1, eos_token_id=1
        )
    )
    # no plan: fp32 on a CPU; the loader's batch the global batch, which any number of ranks share out
    run = prepare(model, torch.optim.SGD(model.parameters(), lr=0.5), loader, loader_batch="global")
    seen = []
    for batch in run.micro_batches():
        assert set(batch) == {"input_ids", "attention_mask", "labels"}
        seen += batch["input_ids"][:, 0].tolist()
        with run.accumulate():
            run.backward(run.model(**batch).loss)
    return {
        "weights": {name: p.detach().clone() for name, p in model.named_parameters()},
        "losses": [record.loss for record in run.metrics.records],
        "first_tokens": seen,
    }


TWO_RANKS = """
import os, sys
import torch
sys.path.insert(0, {tests!r})
torch.distributed.init_process_group(
    "gloo", init_method="file://" + os.environ["STORE"], rank=int(os.environ["RANK"]),
    world_size=int(os.environ["WORLD_SIZE"]),
)
from test_data import {loop}
result = {loop}()
gathered = [None] * int(os.environ["WORLD_SIZE"])
torch.distributed.all_gather_object(gathered, result["first_tokens"])
if os.environ["RANK"] == "0":
    torch.save(result | {{"first_tokens": gathered}}, os.environ["OUT"])
torch.distributed.barrier()
torch.distributed.destroy_process_group()
os._exit(0)  # the results are written: skip gloo's teardown at interpreter exit (see test_prepare)
"""


def two_ranks(tmp_path, loop: str, world: int = 2) -> dict:
    """``loop`` run by ``world`` fresh processes (one: the reference, out of this test process's state)."""
    tmp_path.mkdir(exist_ok=True)
    script = tmp_path / "worker.py"
    script.write_text(TWO_RANKS.format(tests=str(Path(__file__).parent), loop=loop))
    out = tmp_path / "result.pt"
    spawn_ranks(script, world, store=tmp_path / "store", env={"OUT": str(out)})
    return torch.load(out)


@pytest.mark.ranks
@pytest.mark.slow
def test_two_ranks_train_a_hugging_face_loop_as_one_process(tmp_path) -> None:
    """Collator batches (BatchEncoding) split over the ranks, the weighted sampler kept, the loader's batch the
    global batch, the reported loss the global batch's: weights and losses match one process (fp32)."""
    pytest.importorskip("transformers")
    alone = two_ranks(tmp_path / "one", "gpt2_loop", world=1)
    ranks = two_ranks(tmp_path / "two", "gpt2_loop")
    for name, param in alone["weights"].items():
        torch.testing.assert_close(ranks["weights"][name], param, rtol=1e-4, atol=1e-5)
    assert len(ranks["losses"]) == len(alone["losses"]) == 4  # 32 samples, a global batch of 8
    torch.testing.assert_close(torch.tensor(ranks["losses"]), torch.tensor(alone["losses"]), rtol=1e-4, atol=1e-5)
    # every sample drawn has weight 1 (the even items), and the ranks drew disjoint halves of each batch
    rank0, rank1 = ranks["first_tokens"]
    assert len(rank0) == len(rank1) == 16
    assert sorted(rank0 + rank1) == sorted(alone["first_tokens"][0])


def classifier_loop() -> dict:
    """A Hugging Face GPT-2 sequence classifier on sentences of 3 to 11 tokens, padded per batch by
    DataCollatorWithPadding: each rank pads its share to its own longest, and the attention mask and the last
    real token make the padding not count, so the ranks train as one process padding the whole batch."""
    import transformers
    from tokenizers import Tokenizer, models

    vocab = {"[PAD]": 0, "[UNK]": 1} | {f"w{i}": i for i in range(2, VOCAB)}
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")), pad_token="[PAD]", unk_token="[UNK]"
    )
    draw = torch.Generator().manual_seed(6)
    lengths = torch.randint(3, 12, (32,), generator=draw).tolist()
    samples = [
        {"input_ids": torch.randint(2, VOCAB, (n,), generator=draw).tolist(), "labels": int(n > 7)} for n in lengths
    ]
    loader = DataLoader(samples, batch_size=8, shuffle=True, collate_fn=transformers.DataCollatorWithPadding(tokenizer))
    torch.manual_seed(0)
    model = transformers.GPT2ForSequenceClassification(
        transformers.GPT2Config(
            n_embd=32,
            n_layer=2,
            n_head=2,
            n_positions=16,
            vocab_size=VOCAB,
            num_labels=2,
            pad_token_id=0,
            attn_pdrop=0.0,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            summary_first_dropout=0.0,
        )
    )
    run = prepare(model, torch.optim.SGD(model.parameters(), lr=0.5), loader, loader_batch="global")
    widths = []
    for batch in run.micro_batches():
        widths.append(batch["input_ids"].shape[1])
        with run.accumulate():
            run.backward(run.model(**batch).loss)
    return {
        "weights": {name: p.detach().clone() for name, p in model.named_parameters()},
        "losses": [record.loss for record in run.metrics.records],
        "first_tokens": widths,
    }


@pytest.mark.ranks
@pytest.mark.slow
def test_two_ranks_train_a_padded_hugging_face_classifier_as_one_process(tmp_path) -> None:
    pytest.importorskip("transformers")
    alone = two_ranks(tmp_path / "one", "classifier_loop", world=1)
    ranks = two_ranks(tmp_path / "two", "classifier_loop")
    assert ranks["first_tokens"][0] != ranks["first_tokens"][1]  # the ranks padded to different widths
    assert len(ranks["losses"]) == len(alone["losses"]) == 4
    for name, value in alone["weights"].items():
        torch.testing.assert_close(ranks["weights"][name], value, rtol=1e-4, atol=1e-5, msg=name)
    torch.testing.assert_close(torch.tensor(ranks["losses"]), torch.tensor(alone["losses"]), rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------- stalls, BatchNorm


class HangsAt(torch.utils.data.Dataset):
    def __init__(self, index: int) -> None:
        self.index = index

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.index:
            import time

            time.sleep(3600)  # a read that never returns (a dead NFS mount, a deadlock)
        return torch.full((1,), float(i))


@pytest.mark.slow
def test_a_hung_worker_ends_the_run_naming_it() -> None:
    """A loader with workers and no timeout used to wait forever, with no report."""
    from redline.runtime.data import LoaderStalled

    model = nn.Linear(1, 1)
    loader = DataLoader(HangsAt(9), batch_size=4, num_workers=1)  # batch 2 of 4 never comes
    run = prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), loader, plan=config(4), loader_stall_s=5)
    assert run.loader.timeout == 5
    steps = 0
    with pytest.raises(LoaderStalled, match=r"no batch for 5 s: worker 0 \(pid \d+, \w+\) owes batch 2"):
        for x in run.micro_batches():
            with run.accumulate():
                run.backward(model(x).sum())
            steps += 1
    assert steps == 2  # the batches before it trained
    # a timeout the user chose is theirs
    mine = prepare(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        DataLoader(HangsAt(99), batch_size=4, num_workers=1, timeout=60),
        plan=config(4),
    )
    assert mine.loader.timeout == 60


def test_a_dataset_stuck_in_the_main_process_ends_the_run_naming_the_line() -> None:
    """Without workers the DataLoader has no timeout at all: a stuck read hung the run forever."""
    import signal

    from redline.runtime.data import LoaderStalled

    model = nn.Linear(1, 1)
    loader = DataLoader(HangsAt(9), batch_size=4)
    run = prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), loader, plan=config(4), loader_stall_s=2)
    steps = 0
    with pytest.raises(LoaderStalled, match=r"no batch for 2 s: .* stuck at .*test_data.py:\d+ in __getitem__"):
        for x in run.micro_batches():
            with run.accumulate():
                run.backward(model(x).sum())
            steps += 1
    assert steps == 2
    assert signal.getsignal(signal.SIGALRM) == signal.SIG_DFL and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_batchnorm_becomes_sync_batchnorm_for_gpus() -> None:
    from redline.runtime.parallelize import sync_batchnorm

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    sync_batchnorm(model)
    assert isinstance(model[1], nn.SyncBatchNorm) and model[1].num_features == 4


def cnn_loop() -> dict:
    """A small BatchNorm CNN, SGD, 4 steps of a global batch of 8 (no plan): BatchNorm's statistics must be the
    global batch's for the ranks to match one process."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 3),
    )
    g = torch.Generator().manual_seed(5)
    images, labels = torch.randn(32, 3, 10, 10, generator=g) * 3 + 1, torch.randint(0, 3, (32,), generator=g)
    loader = DataLoader(TensorDataset(images, labels), batch_size=8)
    run = prepare(model, torch.optim.SGD(model.parameters(), lr=0.2), loader, loader_batch="global")
    for x, y in run.micro_batches():
        with run.accumulate():
            run.backward(nn.functional.cross_entropy(run.model(x), y))
    state = {name: t.detach().clone() for name, t in model.state_dict().items() if t.is_floating_point()}
    return {"weights": state, "losses": [r.loss for r in run.metrics.records], "first_tokens": []}


@pytest.mark.ranks
def test_two_ranks_train_a_batchnorm_cnn_as_one_process(tmp_path, caplog) -> None:
    """Per-rank BatchNorm statistics made two ranks differ from one process by 0.17 with no warning; the
    running statistics must agree too."""
    alone = two_ranks(tmp_path / "one", "cnn_loop", world=1)
    ranks = two_ranks(tmp_path / "two", "cnn_loop")
    for name, value in alone["weights"].items():
        torch.testing.assert_close(ranks["weights"][name], value, rtol=1e-4, atol=1e-5, msg=name)
    torch.testing.assert_close(torch.tensor(ranks["losses"]), torch.tensor(alone["losses"]), rtol=1e-4, atol=1e-5)


def bucketed_loop() -> dict:
    """A regression trained on the batches of a user's batch sampler (2 to 9 samples each), each batch split
    in 2 micro-batches per rank: on two ranks these are uneven (a share of 3 is 2 + 1), and each micro-batch's
    loss must count by its samples for the step to be the batch's mean. Batches of an even size: two ranks
    would leave out an odd batch's last sample, one process would not."""
    import os

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    x = torch.randn(80, 4, generator=torch.Generator().manual_seed(1))
    y = x.sum(dim=1, keepdim=True).sin()
    loader = DataLoader(TensorDataset(x, y), batch_sampler=ByLength(80, torch.Generator().manual_seed(5), even=True))
    world = int(os.environ["WORLD_SIZE"])
    plan = RunConfig(strategy=Strategy(data=world, micro_batch=1, accumulation=2, precision="fp32"))
    # each batch of the sampler one global batch, split over the ranks (loader_batch="global")
    run = prepare(model, torch.optim.SGD(model.parameters(), lr=0.2), loader, plan=plan, loader_batch="global")
    sizes = []
    for inputs, targets in run.micro_batches():
        sizes.append(len(inputs))
        with run.accumulate():
            run.backward(nn.functional.mse_loss(run.model(inputs), targets))
    return {
        "weights": {name: p.detach().clone() for name, p in model.named_parameters()},
        "losses": [record.loss for record in run.metrics.records],
        "first_tokens": sizes,
    }


@pytest.mark.ranks
def test_two_ranks_train_a_batch_samplers_batches_as_one_process(tmp_path) -> None:
    alone = two_ranks(tmp_path / "one", "bucketed_loop", world=1)
    ranks = two_ranks(tmp_path / "two", "bucketed_loop")
    assert any(a != b for a, b in itertools.pairwise(ranks["first_tokens"][0][::2])), "uneven micro-batches"
    assert len(ranks["losses"]) == len(alone["losses"]) > 5
    for name, value in alone["weights"].items():
        torch.testing.assert_close(ranks["weights"][name], value, rtol=1e-4, atol=1e-5, msg=name)
    torch.testing.assert_close(torch.tensor(ranks["losses"]), torch.tensor(alone["losses"]), rtol=1e-4, atol=1e-5)


def test_cross_rank_batchnorm_is_batchnorm_in_one_process() -> None:
    """With one rank (the all-reduce a no-op) it computes what nn.BatchNorm2d does: outputs, gradients, running
    statistics."""
    from redline.runtime.batchnorm import cross_rank_batchnorm

    torch.distributed.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        plain = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, momentum=None))
        ours = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, momentum=None))
        ours.load_state_dict(plain.state_dict())
        assert cross_rank_batchnorm(ours) == 1
        x = torch.randn(6, 3, 7, 7) * 2 + 3
        weights = torch.randn(6, 4, 5, 5)  # a loss whose gradient through the normalisation is not ~0
        for _ in range(3):
            a, b = plain(x), ours(x)
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
            (a * weights).sum().backward()
            (b * weights).sum().backward()
        for (name, p), q in zip(plain.named_parameters(), ours.parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-4, msg=name)
        torch.testing.assert_close(ours[1].running_var, plain[1].running_var)
        torch.testing.assert_close(ours[1].running_mean, plain[1].running_mean)
        plain.eval(), ours.eval()
        torch.testing.assert_close(ours(x), plain(x))
    finally:
        torch.distributed.destroy_process_group()


# ------------------------------------------------------------------------------- from a review


def test_a_users_distributed_sampler_is_shared_out_once() -> None:
    """A DDP script's own DistributedSampler already took one rank's share: wrapped as it was, each rank got a
    quarter, and the ranks drew different orders."""
    dataset = TensorDataset(torch.arange(16))
    mine = torch.utils.data.DistributedSampler(dataset, num_replicas=2, rank=1, shuffle=False)
    loader = DataLoader(dataset, batch_size=4, sampler=mine)
    seen = []
    for rank in range(2):
        rebuilt = distributed_loader(loader, world=2, rank=rank, per_rank_batch=4, seed=0, overrides={})
        set_position(rebuilt, epoch=0, batches_done=0, seed=0, rank=rank)
        seen += [v for (b,) in rebuilt for v in b.tolist()]
    assert sorted(seen) == list(range(16))


def test_a_stream_keeps_no_persistent_workers_and_its_own_attributes(caplog) -> None:
    """A persistent worker keeps the epoch and skip it started with; a worker_init_fn reads the user's dataset."""
    stream = Stream(8)
    stream.shard_names = ["a", "b"]
    loader = DataLoader(stream, batch_size=2, num_workers=1, persistent_workers=True)
    with caplog.at_level("WARNING", logger="redline.runtime"):
        rebuilt = distributed_loader(loader, world=2, rank=0, per_rank_batch=2, seed=0, overrides={})
    assert rebuilt.persistent_workers is False and "persistent_workers=True set to False" in caplog.text
    assert rebuilt.dataset.shard_names == ["a", "b"]


def test_a_hugging_face_stream_is_not_sharded_twice() -> None:
    class Streaming(Stream):  # what datasets.IterableDataset has: it shards itself over workers
        n_shards = 4
        _distributed = None

    loader = DataLoader(Streaming(8), batch_size=2)
    with pytest.raises(BadInput, match="split_dataset_by_node"):
        distributed_loader(loader, world=2, rank=0, per_rank_batch=2, seed=0, overrides={})
    kept = distributed_loader(loader, world=2, rank=0, per_rank_batch=2, seed=0, overrides={}, shard_stream=False)
    assert isinstance(kept.dataset, Streaming)


def test_a_second_sigterm_is_the_same_request(tmp_path) -> None:
    """One sent to a process group reaches the script directly and again through its launcher: the second
    used to skip the checkpoint."""
    import signal

    model = nn.Linear(1, 1)
    loader = DataLoader(Stream(8), batch_size=4)
    run = prepare(
        model, torch.optim.SGD(model.parameters(), lr=0.1), loader, plan=config(4), checkpoint_dir=str(tmp_path)
    )
    stop = run._stop_signals
    try:
        stop.handle(signal.SIGTERM, None)
        stop.handle(signal.SIGTERM, None)  # would raise the default action (end the process) if taken
        assert stop.requested == signal.SIGTERM and signal.getsignal(signal.SIGTERM) == stop.handle
    finally:
        run.close(checkpoint=False)
    assert signal.getsignal(signal.SIGTERM) != stop.handle


def _term_myself() -> None:
    import os
    import signal
    import time

    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)  # reached only if the signal was taken as the run's stop request


def test_a_forked_process_leaves_on_sigterm_as_it_would_have(tmp_path) -> None:
    """A process forked from the training process (a user's multiprocessing.Process) inherits the run's stop
    handler: a SIGTERM meant for it must end it, not be taken as the run's request to checkpoint. (DataLoader
    workers set their own SIGTERM handler in torch's C code.)"""
    import signal

    model = nn.Linear(1, 1)
    run = prepare(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        DataLoader(TensorDataset(torch.zeros(8, 1)), batch_size=4),
        plan=config(4),
        checkpoint_dir=str(tmp_path),
    )
    try:
        child = multiprocessing.get_context("fork").Process(target=_term_myself)
        child.start()
        child.join(timeout=60)  # a hang guard: the child ends at once
        assert child.exitcode == -signal.SIGTERM
        assert run._stop_signals.requested is None
    finally:
        run.close(checkpoint=False)


def test_a_resume_with_another_batch_layout_goes_on_from_the_same_sample(tmp_path, caplog) -> None:
    """An elastic restart with fewer nodes changes the ranks (and a new plan the per-rank batch): the position
    counts samples of the shared order, not batches."""
    dataset = TensorDataset(torch.arange(32.0).unsqueeze(1))

    def start(batch: int):
        torch.manual_seed(0)
        model = nn.Linear(1, 1)
        loader = DataLoader(dataset, batch_size=batch)
        return prepare(
            model,
            torch.optim.SGD(model.parameters(), lr=0.01),
            loader,
            plan=config(batch),
            checkpoint_dir=str(tmp_path),
        )

    run = start(4)
    for step, (x,) in enumerate(run.micro_batches(), 1):
        with run.accumulate():
            run.backward(run.model(x).sum())
        if step == 4:  # 16 samples trained on
            break
    with caplog.at_level("WARNING", logger="redline.runtime"):
        resumed = start(8)
    assert resumed.batch_in_epoch == 2 and "goes on from sample 16 of its order" in caplog.text
    firsts = [x[0].item() for (x,) in resumed.micro_batches()]
    assert firsts == [16.0, 24.0]
